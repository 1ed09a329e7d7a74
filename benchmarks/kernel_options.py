"""A/Bs of either framework's kernel launch in one process: private launch-plan attributes of its
kernel module (tile tables, sizing, program order) replaced for a while.

torch: :mod:`sebp_torch_ref.kernels`, whose launch plans are cached per shape (cleared before and
after). JAX: :mod:`sebp_jax.backends.pallas`, whose tile choices are made when a layer's
backward is traced, so a variant traced under the options keeps them in its compiled step, and
:mod:`sebp_jax.linen`, whose swap decides when a model is traced how its layers' rules are formed.
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

# framework -> (its modules, each option set on the first that has it; the functions of the
# first that cache launch plans)
_KERNELS = {
  "torch": (("sebp_torch_ref.kernels",), ("_default_gemm_plan",)),
  "jax": (("sebp_jax.backends.pallas", "sebp_jax.linen"), ()),
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
  module_names, caches = _KERNELS[framework]
  modules = [importlib.import_module(name) for name in module_names]
  patches = []
  for name, value in options:
    owner = next((module for module in modules if hasattr(module, name)), None)
    if owner is None:
      raise ValueError(f"launch option {name!r}: {' or '.join(module_names)} has no such "
                       "attribute.")
    patches.append(mock.patch.object(owner, name, value))

  def clear_caches():
    for cache in caches:
      getattr(modules[0], cache).cache_clear()

  clear_caches()
  try:
    with contextlib.ExitStack() as stack:
      for patch in patches:
        stack.enter_context(patch)
      yield
  finally:
    clear_caches()
