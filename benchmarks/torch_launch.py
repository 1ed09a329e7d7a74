"""A/Bs of the torch reference's GEMM launch in one process: private launch-plan attributes of
:mod:`sebp_torch_ref.kernels` (sizing, program order, tiles) replaced for a while.

``benchmarks.layer_torch`` times one layer's launch under each of its A/Bs, ``benchmarks.workloads``
runs a model variant under its ``Variant.launch``; both beside the default in the same process, so
that their ratios compare. Imports nothing from ``sebp_jax``; the kernels are imported when used.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence
from unittest import mock

__all__ = ["launch_options"]


@contextlib.contextmanager
def launch_options(options: Sequence[tuple[str, Any]]) -> Iterator[None]:
  """:mod:`sebp_torch_ref.kernels`' attributes set to ``options``' values, with no launch plan
  cached under other values before or after (the plans are built once per shape and cached)."""
  if not options:
    yield
    return
  from sebp_torch_ref import kernels

  for name, _ in options:
    if not hasattr(kernels, name):
      raise ValueError(f"launch option {name!r}: sebp_torch_ref.kernels has no such attribute.")
  kernels._default_gemm_plan.cache_clear()
  try:
    with mock.patch.multiple(kernels, **dict(options)):
      yield
  finally:
    kernels._default_gemm_plan.cache_clear()
