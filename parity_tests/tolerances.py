"""Comparison tolerances keyed by dtype, and a NaN-aware ``assert_close`` that says where values differ.

The tolerances are for results that were accumulated in float32 (or better) and rounded once to
their own dtype, compared with a float32/float64 reference on O(1) data: matmul gradients, row
sums, layer outputs. The dtype is that of the value under test (the primal's dtype for a
gradient), never the reference's.

Works on anything ``numpy`` can read, including JAX arrays and (detached, CPU or CUDA) torch
tensors of any float dtype, bfloat16 included.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = ["Tolerance", "TOLERANCES", "tolerance", "assert_close", "relative_error"]


@dataclasses.dataclass(frozen=True)
class Tolerance:
  """``|actual - expected| <= atol + rtol * |expected|`` elementwise."""

  rtol: float
  atol: float


TOLERANCES: dict[str, Tolerance] = {
  "float64": Tolerance(rtol=1e-9, atol=1e-9),
  # Float32 accumulation in a different order than the reference: a few ulps of sums of ~1e2
  # terms, plus the cancellation near zero.
  "float32": Tolerance(rtol=2e-5, atol=2e-5),
  # One rounding to 8 significant bits is <= 2**-8 relative; a second rounding (a bf16
  # intermediate such as an activation) doubles it. Cancellation near zero needs the atol.
  "bfloat16": Tolerance(rtol=1.6e-2, atol=1.6e-2),
  "float16": Tolerance(rtol=2e-3, atol=2e-3),
}


def _dtype_name(dtype: Any) -> str:
  """``"float32"`` for ``np.float32``, ``jnp.bfloat16``, ``torch.bfloat16``, ``"bfloat16"``..."""
  if isinstance(dtype, str):
    return dtype.removeprefix("torch.")
  if str(dtype).startswith("torch."):  # torch dtypes are not numpy dtypes
    return str(dtype).removeprefix("torch.")
  return np.dtype(dtype).name


def tolerance(dtype: Any) -> Tolerance:
  """The :class:`Tolerance` for values of ``dtype`` (numpy, JAX or torch dtype, or its name)."""
  name = _dtype_name(dtype)
  if name not in TOLERANCES:
    raise ValueError(f"tolerance: no tolerance for dtype {name!r}; known: {sorted(TOLERANCES)}.")
  return TOLERANCES[name]


def _to_float64(value: Any) -> tuple[np.ndarray, str]:
  """``value`` as a float64 numpy array, and the name of its own dtype."""
  if hasattr(value, "detach"):  # a torch tensor; numpy has no bfloat16 for torch's
    name = _dtype_name(value.dtype)
    return value.detach().cpu().double().numpy(), name
  array = np.asarray(value)
  return array.astype(np.float64), _dtype_name(array.dtype)


def assert_close(
  actual: Any,
  expected: Any,
  dtype: Any = None,
  *,
  what: str = "value",
  rtol: float | None = None,
  atol: float | None = None,
) -> None:
  """Assert that ``actual`` matches ``expected`` within the tolerance of ``dtype``.

  NaNs must sit at the same positions and infinities must match exactly (sign included); finite
  values must satisfy ``|actual - expected| <= atol + rtol * |expected|``.

  Args:
    actual: the value under test, any shape.
    expected: the reference, same shape (any float dtype; compared in float64).
    dtype: the dtype whose tolerance applies; defaults to ``actual``'s dtype.
    what: a name for the value in the failure message, e.g. ``"dW of layer 3"``.
    rtol, atol: override the dtype's tolerance.

  Raises:
    AssertionError: naming ``what``, the tolerance, how many elements differ, and the worst one
      (index, actual, expected).
  """
  got, own_dtype = _to_float64(actual)
  want, _ = _to_float64(expected)
  name = _dtype_name(dtype) if dtype is not None else own_dtype
  tol = tolerance(name)
  tol = Tolerance(rtol=tol.rtol if rtol is None else rtol, atol=tol.atol if atol is None else atol)
  if got.shape != want.shape:
    raise AssertionError(f"{what}: shape {got.shape} != expected shape {want.shape}.")

  nan_got, nan_want = np.isnan(got), np.isnan(want)
  if not np.array_equal(nan_got, nan_want):
    spurious = np.argwhere(nan_got & ~nan_want)
    missing = np.argwhere(nan_want & ~nan_got)
    raise AssertionError(
      f"{what}: NaN positions differ: {len(spurious)} unexpected NaN (first at "
      f"{_first(spurious)}), {len(missing)} expected NaN missing (first at {_first(missing)}).")
  inf_mismatch = (np.isinf(got) | np.isinf(want)) & (got != want) & ~nan_want
  if inf_mismatch.any():
    index = tuple(np.argwhere(inf_mismatch)[0])
    raise AssertionError(
      f"{what}: {int(inf_mismatch.sum())} infinite values differ; first at {index}: "
      f"actual {got[index]!r}, expected {want[index]!r}.")

  finite = np.isfinite(want)
  with np.errstate(invalid="ignore"):  # inf - inf where both are the same infinity
    diff = np.where(finite, np.abs(got - want), 0.0)
  allowed = tol.atol + tol.rtol * np.abs(np.where(finite, want, 0.0))
  bad = diff > allowed
  if bad.any():
    excess = np.where(bad, diff / allowed, 0.0)
    index = np.unravel_index(int(np.argmax(excess)), excess.shape)
    rel = diff / np.maximum(np.abs(np.where(finite, want, 0.0)), np.finfo(np.float64).tiny)
    raise AssertionError(
      f"{what} ({name}, rtol={tol.rtol:g}, atol={tol.atol:g}): {int(bad.sum())} of {bad.size} "
      f"elements differ; worst at {tuple(int(i) for i in index)}: actual {got[index]!r}, "
      f"expected {want[index]!r} (|diff| {diff[index]:.3g}); max |diff| {diff.max():.3g}, "
      f"max rel diff {rel[bad].max():.3g}.")


def relative_error(actual: Any, expected: Any) -> float:
  """Worst deviation against the reference's scale: ``max |actual - expected| / max |expected|``.

  One number per comparison, for reports: taken over the entries where ``expected`` is finite
  (NaN and Inf positions are :func:`assert_close`'s business); ``0.0`` for an exact match, and
  ``inf`` where ``expected`` is all zero but ``actual`` is not.
  """
  got, _ = _to_float64(actual)
  want, _ = _to_float64(expected)
  if got.shape != want.shape:
    raise ValueError(f"relative_error: shape {got.shape} != expected shape {want.shape}.")
  finite = np.isfinite(want)
  if not finite.any():
    return 0.0
  with np.errstate(invalid="ignore"):
    diff = float(np.max(np.abs(got[finite] - want[finite])))
  scale = float(np.max(np.abs(want[finite])))
  if np.isnan(diff):  # a NaN where the reference is finite
    return float("inf")
  return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


def _first(indices: np.ndarray) -> tuple[int, ...] | None:
  return tuple(int(i) for i in indices[0]) if len(indices) else None
