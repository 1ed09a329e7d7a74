"""Which rows of the output gradient SEBP keeps: the contract every backend shares.

For a flattened output gradient ``dy`` of shape ``(M, N)``:

* the row score is ``s_i = max_j |dy_ij|`` in float32;
* a row is *active* if ``s_i > threshold`` or it holds a NaN/Inf (a NaN is never hidden);
* with ``max_rows=k`` and more than ``k`` active rows, the ``k`` with the largest float32 L2 norm
  are kept (non-finite rows first, ties broken by the lower row index).

Every backend computes ``dX``/``dW`` as the dense backward of ``dy * keep[:, None]``; the functions
here decide ``keep`` and order the rows so that kernels can walk the kept rows only.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
  "RowPolicy",
  "row_scores",
  "keep_mask",
  "active_first_permutation",
]


@dataclasses.dataclass(frozen=True)
class RowPolicy:
  """Which output-gradient rows the SEBP backward keeps.

  Attributes:
    threshold: a row is active if its largest absolute entry exceeds this (float32). ``0.0`` (the
      default) keeps every row with any non-zero entry, so the backward is exact. The paper's noise
      cut for LLaMA-3.2-3B is ``3.98e-5``.
    max_rows: keep at most this many rows per call: when more rows are active, those with the
      largest L2 norm (the paper's fixed Top-N). ``None`` keeps every active row.

  Frozen and hashable, so it can be a static argument of ``jit`` and ``custom_vjp``.

  >>> RowPolicy().is_exact
  True
  >>> RowPolicy(threshold=3.98e-5, max_rows=2048).is_exact
  False
  """

  threshold: float = 0.0
  max_rows: int | None = None

  def __post_init__(self):
    threshold = self.threshold
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
      raise TypeError(
        f"RowPolicy: `threshold` must be a real number, got {threshold!r} "
        f"of type {type(threshold).__name__}."
      )
    if math.isnan(threshold) or threshold < 0 or math.isinf(threshold):
      raise ValueError(
        f"RowPolicy: `threshold` must be finite and >= 0, got {threshold!r}."
      )
    # Normalise so that equal policies hash equally (0 and 0.0 are one static argument).
    object.__setattr__(self, "threshold", float(threshold))
    max_rows = self.max_rows
    if max_rows is not None:
      if isinstance(max_rows, bool) or not isinstance(max_rows, numbers.Integral):
        raise TypeError(
          f"RowPolicy: `max_rows` must be an int or None, got {max_rows!r} "
          f"of type {type(max_rows).__name__}."
        )
      if max_rows < 1:
        raise ValueError(f"RowPolicy: `max_rows` must be >= 1, got {max_rows}.")
      object.__setattr__(self, "max_rows", int(max_rows))  # np.int64(3) and 3: one static arg

  @property
  def is_exact(self) -> bool:
    """True if the policy drops only all-zero rows, so the backward equals the dense one."""
    return self.threshold == 0.0 and self.max_rows is None


def row_scores(dy: jax.Array) -> jax.Array:
  """Largest absolute entry of each row, in float32; ``+inf`` for every row with a NaN or Inf.

  Args:
    dy: ``(M, N)`` output gradient.

  Returns:
    ``(M,)`` float32 scores. NaN entries count as ``+inf``: one reduction both scores the rows and
    flags the non-finite ones (XLA:CPU's ``max`` does not propagate NaN through large
    reductions). ``max`` is exact in any float dtype, so the cast comes after the reduction: one
    read of ``dy`` in its own dtype.
  """
  magnitude = jnp.abs(dy)
  magnitude = jnp.where(jnp.isnan(magnitude), jnp.array(jnp.inf, dy.dtype), magnitude)
  return jnp.max(magnitude, axis=1).astype(jnp.float32)


def _row_norms(dy: jax.Array, scores: jax.Array) -> jax.Array:
  """Float32 L2 norm of each finite row, never overflowing or underflowing on the way.

  Each row is scaled by a power of two near its max before squaring. A power of two (not the max
  itself) keeps the scale's reciprocal exact and normal, so the multiply XLA turns the division
  into cannot flush a huge row to zero. A norm past float32's range is clamped to its max, so a
  finite row still ranks below a non-finite one.
  """
  _, exponent = jnp.frexp(jnp.where(scores > 0, scores, 1.0))
  scale = jnp.ldexp(jnp.float32(1.0), jnp.clip(exponent, -100, 100))
  scaled = dy.astype(jnp.float32) / scale[:, None]
  norms = scale * jnp.sqrt(jnp.sum(scaled * scaled, axis=1))
  return jnp.minimum(norms, jnp.finfo(jnp.float32).max)


def keep_mask(dy: jax.Array, policy: RowPolicy) -> jax.Array:
  """Rows of ``dy`` that the backward keeps under ``policy``.

  Args:
    dy: ``(M, N)`` output gradient, any float dtype.
    policy: the :class:`RowPolicy`.

  Returns:
    ``(M,)`` bool mask.
  """
  scores = row_scores(dy)
  nonfinite = jnp.isinf(scores)
  active = (scores > policy.threshold) | nonfinite
  num_rows = dy.shape[0]
  if policy.max_rows is None or policy.max_rows >= num_rows:
    return active
  # Rank active rows by norm, non-finite rows above every finite one; inactive rows below all.
  # lax.top_k returns the lower index first among equal keys: the contract's tie-break.
  norms = _row_norms(dy, jnp.where(nonfinite, 1.0, scores))
  rank_key = jnp.where(nonfinite, jnp.inf, jnp.where(active, norms, -1.0))
  _, top = lax.top_k(rank_key, policy.max_rows)
  in_top = jnp.zeros((num_rows,), jnp.bool_).at[top].set(True, unique_indices=True)
  return active & in_top


def active_first_permutation(keep: jax.Array) -> tuple[jax.Array, jax.Array]:
  """A permutation of the rows with the kept rows first, each part in row order.

  A stable partition by two prefix sums and one scatter: no sort.

  Args:
    keep: ``(M,)`` bool mask.

  Returns:
    ``(perm, count)``: ``perm`` is ``(M,)`` int32 with ``perm[:count]`` the kept rows in increasing
    order and ``perm[count:]`` the dropped ones; ``count`` is an int32 scalar.
  """
  num_rows = keep.shape[0]
  kept_before = jnp.cumsum(keep, dtype=jnp.int32)  # kept rows in [0, i]
  count = kept_before[-1] if num_rows else jnp.int32(0)
  row = jnp.arange(num_rows, dtype=jnp.int32)
  # Kept row i goes to slot kept_before[i]-1; dropped row i after all kept rows, at
  # count + (dropped rows before i).
  dest = jnp.where(keep, kept_before - 1, count + row - kept_before)
  perm = jnp.zeros((num_rows,), jnp.int32).at[dest].set(row, unique_indices=True)
  return perm, count
