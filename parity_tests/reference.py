"""The independent reference of the SEBP contract (DESIGN §2) for the JAX tests.

``keep_mask`` reads the row-selection rules straight from the contract, in numpy, sharing no code
with :mod:`sebp_jax.policy`; ``dense_vjp`` is ``jax.vjp`` of the plain dense matmul in float32 at
the highest precision. The SEBP backward must equal ``dense_vjp(x, kernel, where(keep, dy, 0))``,
with ``db`` the full row sum of the unmasked ``dy`` (``sebp_reference``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["keep_mask", "dense_vjp", "sebp_reference"]


def keep_mask(dy: Any, threshold: float = 0.0, max_rows: int | None = None) -> np.ndarray:
  """Rows of the flattened ``dy`` kept under ``RowPolicy(threshold, max_rows)``.

  Args:
    dy: ``(..., N)`` output gradient, any float dtype.
    threshold: a row is active if its float32 max-abs entry exceeds this (in float32).
    max_rows: keep at most this many active rows: non-finite rows first, then larger L2 norm,
      then lower row index.

  Returns:
    ``(M,)`` bool, ``M`` the product of ``dy``'s leading dims.
  """
  rows = np.asarray(dy).astype(np.float32).reshape(-1, np.shape(dy)[-1])
  nonfinite = ~np.isfinite(rows).all(axis=1)
  with np.errstate(invalid="ignore"):
    scores = np.abs(rows).max(axis=1, initial=np.float32(0))
    active = nonfinite | (scores > np.float32(threshold))
  if max_rows is None or active.sum() <= max_rows:
    return active
  # float64 norms: a finite row's norm never overflows or rounds into a tie.
  norms = np.sqrt(np.sum(np.where(nonfinite[:, None], 0.0, rows.astype(np.float64)) ** 2, axis=1))
  index = np.arange(len(rows))
  # np.lexsort sorts by the last key first: inactive last, non-finite first, larger norm, index.
  order = np.lexsort((index, -norms, ~nonfinite, ~active))
  keep = np.zeros(len(rows), bool)
  keep[order[:max_rows]] = True
  return keep


def dense_vjp(x: Any, kernel: Any, dy: Any) -> tuple[jax.Array, jax.Array]:
  """``jax.vjp`` of the dense ``x @ kernel`` at ``dy``, in float32 at the highest precision.

  Args:
    x: ``(..., K)``; kernel: ``(K, N)``; dy: ``(..., N)``; any float dtypes.

  Returns:
    ``(dx (..., K), dkernel (K, N))``, float32.
  """
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  matmul = lambda x, k: jnp.matmul(x, k, precision=jax.lax.Precision.HIGHEST)
  _, vjp = jax.vjp(matmul, f32(x), f32(kernel))
  return vjp(f32(dy))


def sebp_reference(x: Any, kernel: Any, bias: Any, dy: Any, threshold: float = 0.0,
                   max_rows: int | None = None) -> tuple[jax.Array, ...]:
  """What the SEBP backward must return (in float32): the contract's definition.

  ``dx``/``dkernel`` are the dense backward of ``dy`` with the dropped rows zeroed; ``dbias`` (if
  ``bias`` is given) is the full row sum of ``dy``.
  """
  dy = np.asarray(dy).astype(np.float32)
  keep = keep_mask(dy, threshold, max_rows).reshape(dy.shape[:-1] + (1,))
  grads = dense_vjp(x, kernel, np.where(keep, dy, 0.0))
  if bias is None:
    return grads
  with np.errstate(invalid="ignore"):  # inf + -inf in a column is NaN, as it should be
    dbias = dy.reshape(-1, dy.shape[-1]).sum(axis=0, dtype=np.float64)
  return (*grads, jnp.asarray(dbias, jnp.float32))
