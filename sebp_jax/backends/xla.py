"""Portable SEBP backward in plain XLA: bucketed static capacities with a dense fallback.

XLA needs static shapes, but the number of kept rows is a runtime value. So the backward compiles a
few branches, each for a static capacity ``C`` (``M/32 .. M/2`` rows), plus the dense backward, and
``lax.switch`` runs the smallest one that holds ``count``. A branch gathers the first ``C`` rows of
the active-first permutation, runs the two matmuls on ``C`` rows and scatters ``dX`` back. The
compiled program is the same whatever the padding: nothing retraces when ``count`` changes.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from sebp_jax.plan import RowPlan
from sebp_jax.policy import RowPolicy, active_first_permutation, keep_mask

__all__ = ["backward", "accumulate_siblings", "full_column_sums", "dense_backward", "capacities",
           "DX_DIMS", "DX_NK_DIMS", "DW_DIMS"]

# Smallest capacity worth a branch, and the granularity capacities are rounded up to: small
# branches cost compile time and gain nothing.
_MIN_CAPACITY = 8
# Capacities as fractions of M. Above M/2 the gather/scatter overhead eats most of the saving,
# so the dense branch takes over.
_CAPACITY_FRACTIONS = (1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2)

# Contractions, in lax.dot_general's dimension numbers.
DX_DIMS = (((1,), (1,)), ((), ()))  # (M, N) x (K, N) -> (M, K)
DX_NK_DIMS = (((1,), (0,)), ((), ()))  # (M, N) x (N, K) -> (M, K): a kernel stored (N, K)
DW_DIMS = (((0,), (0,)), ((), ()))  # (M, K) x (M, N) -> (K, N); (M, N) x (M, K) -> (N, K)


def capacities(num_rows: int) -> tuple[int, ...]:
  """Static row capacities of the compact branches for ``num_rows`` rows (may be empty)."""
  caps = set()
  for fraction in _CAPACITY_FRACTIONS:
    cap = -(-int(num_rows * fraction) // _MIN_CAPACITY) * _MIN_CAPACITY
    if _MIN_CAPACITY <= cap < num_rows:
      caps.add(cap)
  return tuple(sorted(caps))


def _dot(a, b, dims, *, precision, dtype):
  """``lax.dot_general(a, b, dims)`` accumulated in (at least) float32 and returned in ``dtype``.

  XLA:GPU turns a product with a unit output dimension (a matrix-vector product: ``K == 1`` or
  ``N == 1``) into a reduction that sums in its output dtype: in bfloat16 that misses the
  float32-accumulated sum by up to 15x bfloat16's tolerance over 4,000 rows, where every product
  without a unit dimension (cuBLAS or XLA's Triton GEMM) met it in every case measured
  (``benchmarks/NOTES.md``, "Matrix-vector products"). Those products get a float32 output and one
  rounding; the output is a vector, so it costs nothing. The others keep ``dtype`` as their output:
  a float32 ``dW`` then a cast cost up to +7 % of the GEMM (LLaMA's MLP, same note).
  """
  (contract_a, contract_b), _ = dims
  free = ([n for i, n in enumerate(a.shape) if i not in contract_a]
          + [n for i, n in enumerate(b.shape) if i not in contract_b])
  out = jnp.promote_types(dtype, jnp.float32) if 1 in free else dtype
  return lax.dot_general(a, b, dims, precision=precision,
                         preferred_element_type=out).astype(dtype)


def _products(x, kernel, dy, precision, kernel_nk: bool = False):
  """``(dy @ kernel.T, x.T @ dy)``, each ``None`` where its operand is ``None``; with
  ``kernel_nk`` the kernel is stored ``(N, K)``: ``(dy @ kernel, dy.T @ x)``, ``dw`` in that layout.

  Dots accumulate in float32 (:func:`_dot`) and return the primal dtype.
  """
  dx = None
  if kernel is not None:
    dx = _dot(dy, kernel, DX_NK_DIMS if kernel_nk else DX_DIMS, precision=precision,
              dtype=kernel.dtype)
  dw = None
  if x is not None:
    dw = _dot(*((dy, x) if kernel_nk else (x, dy)), DW_DIMS, precision=precision, dtype=x.dtype)
  return dx, dw


def dense_backward(x, kernel, dy, keep, *, policy: RowPolicy, precision=None,
                   planned: bool = False, kernel_nk: bool = False):
  """The dense backward of the masked gradient ``dy * keep[:, None]``.

  Under the exact policy every dropped row is already zero, so the mask is skipped; a ``planned``
  ``keep`` (a :class:`~sebp_jax.plan.RowPlan`'s) is not read off ``dy`` and is always applied.
  ``kernel_nk``: as in :func:`backward`.
  """
  if planned or not policy.is_exact:
    dy = jnp.where(keep[:, None], dy, jnp.zeros((), dy.dtype))
  return _products(x, kernel, dy, precision, kernel_nk)


def _compact_backward(capacity, x, kernel, dy, perm, count, *, precision, kernel_nk):
  """The backward on the first ``capacity`` rows of ``perm``, of which ``count`` are kept."""
  num_rows = dy.shape[0]
  rows = perm[:capacity]
  valid = (jnp.arange(capacity, dtype=jnp.int32) < count)[:, None]
  gather = dict(mode="promise_in_bounds", unique_indices=True)
  # Rows past `count` are dropped rows: their gradient is zeroed, as the contract's masked
  # gradient has it.
  dy_rows = jnp.where(valid, dy.at[rows].get(**gather), jnp.zeros((), dy.dtype))
  x_rows = None if x is None else x.at[rows].get(**gather)
  dx_rows, dw = _products(x_rows, kernel, dy_rows, precision, kernel_nk)
  dx = None
  if dx_rows is not None:
    dx = jnp.zeros((num_rows, dx_rows.shape[1]), dx_rows.dtype).at[rows].set(
      dx_rows, **gather)
  return dx, dw


def backward(x, kernel, dy, *, policy: RowPolicy, precision=None, plan: RowPlan | None = None,
             kernel_nk: bool = False, dx_into=None):
  """SEBP backward of ``y = x @ kernel`` in XLA.

  Args:
    x: ``(M, K)`` input, or ``None`` when ``dW`` is not needed.
    kernel: ``(K, N)`` weight, or ``None`` when ``dX`` is not needed.
    dy: ``(M, N)`` output gradient.
    policy: which rows to keep.
    precision: ``lax.Precision`` of the two matmuls.
    plan: the kept rows, decided once per step (:class:`sebp_jax.plan.RowPlan`): no score read
      and no partition here. ``policy`` must then be the exact one.
    kernel_nk: the weight is stored ``(N, K)`` and the product is ``x @ kernel.T`` (a tied
      output embedding): ``kernel`` is that ``(N, K)`` array and ``dw`` comes back ``(N, K)``,
      so that no transpose of either is made.
    dx_into: ``(M, K)`` or ``None``: ``dx`` comes back as ``dx_into + dx`` (a sibling
      projection's ``dx`` summed in; the Pallas backend adds it in place, XLA fuses the add).

  Returns:
    ``(dx, dw)``: ``(M, K)`` and ``(K, N)`` (``(N, K)`` with ``kernel_nk``), ``None`` where not
    asked for; equal to the dense backward of ``dy * keep[:, None]`` up to summation order.
  """
  if dx_into is not None:
    if kernel is None:
      raise ValueError("backward: `dx_into` needs `kernel` (there is no dx to add to it).")
    dx, dw = backward(x, kernel, dy, policy=policy, precision=precision, plan=plan,
                      kernel_nk=kernel_nk)
    return dx_into + dx, dw
  keep = keep_mask(dy, policy) if plan is None else plan.keep
  caps = capacities(dy.shape[0])
  dense = lambda: dense_backward(x, kernel, dy, keep, policy=policy, precision=precision,
                                 planned=plan is not None, kernel_nk=kernel_nk)
  if not caps:
    return dense()
  if plan is None:
    perm, count = active_first_permutation(keep)
  else:  # positions below every capacity (< M) name real rows only
    perm, count = plan.perm, plan.count[0]
  branches = [
    lambda cap=cap: _compact_backward(cap, x, kernel, dy, perm, count, precision=precision,
                                      kernel_nk=kernel_nk)
    for cap in caps
  ]
  # The smallest capacity that holds `count`; the dense branch past the largest. Compared with
  # all of them at once: the default binary search is a while loop, which XLA:GPU steers from
  # the host, one round trip per iteration.
  branch = jnp.searchsorted(jnp.asarray(caps, jnp.int32), count, side="left",
                            method="compare_all")
  return lax.switch(branch, [*branches, dense])


def accumulate_siblings(sibling_backward, x, kernels, dys, *, column_sums: bool = False,
                        with_dw=None, **options):
  """``(dx, dws, dbs)`` of sibling products ``x @ kernels[i]`` of one input, ``dx`` summed over
  them: ``sibling_backward`` (a backend's ``backward``) for each in turn, each adding its ``dx``
  into the running sum (``dx_into``); ``dbs``: :func:`full_column_sums` of ``dys`` with
  ``column_sums``, else ``None``. The XLA backend's sibling backward, and the Pallas backend's
  where its siblings cannot share one gather.

  ``x`` ``None``: no ``dW``; ``kernels`` all ``None``: no ``dx`` (``None``). ``with_dw``: which
  siblings' ``dW`` to compute (default: every one's); the others' are ``None``, as is their
  whole backward where they need no ``dx`` either."""
  dx, dws = None, []
  for index, (kernel, dy) in enumerate(zip(kernels, dys)):
    own_x = x if with_dw is None or with_dw[index] else None
    if own_x is None and kernel is None:
      dws.append(None)
      continue
    dx_i, dw = sibling_backward(own_x, kernel, dy, dx_into=None if kernel is None else dx,
                                **options)
    dx = dx if kernel is None else dx_i
    dws.append(dw)
  return dx, dws, (full_column_sums(dys) if column_sums else None)


def full_column_sums(dys):
  """Each ``(M, N_i)`` ``dy``'s float32 sum over all its rows: the bias gradients, which the
  contract sums over every row whatever the policy keeps."""
  return [jnp.sum(dy, axis=0, dtype=jnp.float32) for dy in dys]
