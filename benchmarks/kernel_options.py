"""A/Bs of either framework's kernel launch in one process: private launch-plan attributes of its
kernel module (tile tables, sizing, program order) replaced for a while.

torch: :mod:`sebp_torch_ref.kernels`, whose launch plans are cached per shape (cleared before and
after). JAX: :mod:`sebp_jax.backends.pallas`, whose tile choices are made when a layer's
backward is traced, so a variant traced under the options keeps them in its compiled step.
``benchmarks.layer_torch`` times one layer's launch under each of its A/Bs, ``benchmarks.workloads``
runs a model variant under its ``Variant.launch``; both beside the default in the same process, so
that their ratios compare. Only the framework asked for is imported.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Iterator, Sequence
from unittest import mock

__all__ = ["KERNEL_GRID", "launch_options"]

# torch: every eager launch through Triton's kernel[grid] instead of sebp_torch_ref.launch.CachedLaunch.
KERNEL_GRID = (("_CACHED_LAUNCH", False),)

# framework -> (kernel module, its functions that cache launch plans)
_KERNELS = {
  "torch": ("sebp_torch_ref.kernels", ("_default_gemm_plan",)),
  "jax": ("sebp_jax.backends.pallas", ()),
}


@contextlib.contextmanager
def launch_options(options: Sequence[tuple[str, Any]], framework: str = "torch") -> Iterator[None]:
  """``framework``'s kernel module's attributes set to ``options``' values, with no launch plan
  cached under other values before or after."""
  if not options:
    yield
    return
  if framework not in _KERNELS:
    raise ValueError(f"launch options: `framework` must be one of {sorted(_KERNELS)}, "
                     f"got {framework!r}.")
  module_name, caches = _KERNELS[framework]
  kernels = importlib.import_module(module_name)
  for name, _ in options:
    if not hasattr(kernels, name):
      raise ValueError(f"launch option {name!r}: {module_name} has no such attribute.")

  def clear_caches():
    for cache in caches:
      getattr(kernels, cache).cache_clear()

  clear_caches()
  try:
    with mock.patch.multiple(kernels, **dict(options)):
      yield
  finally:
    clear_caches()
