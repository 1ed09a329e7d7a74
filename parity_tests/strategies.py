"""Hypothesis strategies for the JAX contract tests: layer shapes, sparsity patterns, policies.

A case is a linear layer ``(..., K) -> (..., N)`` of rank 2-4 with odd sizes, an output gradient
whose active rows follow one of :data:`ROW_PATTERNS`, and a :class:`sebp_jax.RowPolicy`. Inputs
are drawn with numpy from a seed hypothesis picks, so every example is fresh random data.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import strategies as st

from sebp_jax import RowPolicy
from sebp_jax.backends.xla import capacities

__all__ = ["ROW_PATTERNS", "LayerCase", "row_mask", "layer_cases", "policies"]

# How the active rows of dy lie on the (..., tokens) grid. "near_capacity" puts the number of
# active rows at, or one off, a static capacity of the XLA backend (its branch boundaries).
ROW_PATTERNS = ("random", "right_pad", "left_pad", "all_zero", "all_active", "near_capacity")

# Scale of "quiet" rows: non-zero (the exact policy keeps them), below the tested threshold.
QUIET = 1e-3
THRESHOLD = 0.5


@dataclasses.dataclass(frozen=True)
class LayerCase:
  """``x (*lead, K)``, ``kernel (K, N)``, ``bias (N,)`` and ``dy (*lead, N)`` as float32 numpy."""

  x: np.ndarray
  kernel: np.ndarray
  bias: np.ndarray
  dy: np.ndarray
  pattern: str

  @property
  def rows(self) -> int:
    return int(np.prod(self.dy.shape[:-1]))


def row_mask(pattern: str, lead_shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
  """Which rows of a ``(*lead_shape, N)`` gradient are active under ``pattern``.

  The last lead dim is the token axis: padding patterns give each sequence a random length.
  """
  tokens = lead_shape[-1]
  position = np.arange(tokens)
  if pattern == "random":
    return rng.random(lead_shape) < rng.random()
  if pattern in ("right_pad", "left_pad"):
    lengths = rng.integers(0, tokens + 1, size=lead_shape[:-1] + (1,))
    return position < lengths if pattern == "right_pad" else position >= tokens - lengths
  if pattern == "all_zero":
    return np.zeros(lead_shape, bool)
  if pattern == "all_active":
    return np.ones(lead_shape, bool)
  if pattern == "near_capacity":
    num_rows = int(np.prod(lead_shape))
    caps = capacities(num_rows)
    target = rng.choice(caps) + rng.integers(-1, 2) if caps else rng.integers(0, num_rows + 1)
    mask = np.zeros(num_rows, bool)
    mask[rng.choice(num_rows, size=int(np.clip(target, 0, num_rows)), replace=False)] = True
    return mask.reshape(lead_shape)
  raise ValueError(f"unknown row pattern {pattern!r}")


@st.composite
def layer_cases(draw, *, max_rows: int = 400, nonfinite: bool = True) -> LayerCase:
  """A random :class:`LayerCase`: rank 2-4, up to ``max_rows`` rows, sizes odd or even.

  Some active rows are "quiet" (entries ~``QUIET``, below ``THRESHOLD``); with ``nonfinite``,
  some rows may hold a NaN or an infinity.
  """
  rank = draw(st.integers(2, 4), label="rank")
  if rank == 2:
    lead = (draw(st.integers(1, max_rows)),)
  elif rank == 3:
    lead = (draw(st.integers(1, 8)), draw(st.integers(1, max_rows // 8)))
  else:
    lead = (draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, max_rows // 12)))
  k = draw(st.integers(1, 37), label="K")
  n = draw(st.integers(1, 37), label="N")
  pattern = draw(st.sampled_from(ROW_PATTERNS), label="pattern")
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1), label="seed"))

  x = rng.standard_normal(lead + (k,), np.float32)
  kernel = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
  bias = rng.standard_normal(n).astype(np.float32)
  active = row_mask(pattern, lead, rng)
  scale = np.where(rng.random(lead) < 0.2, QUIET, 1.0).astype(np.float32)
  dy = rng.standard_normal(lead + (n,), np.float32) * (active * scale)[..., None]
  if nonfinite and draw(st.booleans(), label="nonfinite"):
    flat = dy.reshape(-1, n)
    rows = rng.choice(len(flat), size=min(len(flat), 3), replace=False)
    flat[rows, rng.integers(0, n, size=len(rows))] = rng.choice([np.nan, np.inf, -np.inf], len(rows))
  return LayerCase(x=x, kernel=kernel, bias=bias, dy=dy, pattern=pattern)


def policies(num_rows: int) -> st.SearchStrategy[RowPolicy]:
  """Exact, threshold, max_rows and threshold+max_rows policies for ``num_rows`` rows."""
  max_rows = st.none() | st.integers(1, num_rows + 2)
  return st.builds(RowPolicy, threshold=st.sampled_from([0.0, THRESHOLD]), max_rows=max_rows)
