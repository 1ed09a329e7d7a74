"""Shared pytest setup of parity_tests: JAX in float32 mode, and GPU tests skipped without a GPU.

A test marked ``@pytest.mark.gpu`` runs only where every framework its module imports (``jax``,
``torch``; both if it imports neither directly) sees a GPU: JAX through a ``gpu`` backend, torch
through ``torch.cuda.is_available()``. Elsewhere it is skipped, saying which framework lacks one,
so the same files serve CPU CI and the GPU machine.
"""

from __future__ import annotations

import functools
import importlib
import types

import pytest

try:
  import jax
except ImportError:  # a torch-only environment
  pass
else:
  # The contract is tested in the dtypes users run; x64 would change default dtypes silently.
  jax.config.update("jax_enable_x64", False)
  # On GPUs both XLA and the Pallas kernels run float32 matmuls in TF32 by default; the tests
  # compare against an IEEE float32 reference, so they ask for IEEE float32 everywhere (a
  # `precision=None` dot, in XLA or inside a kernel, follows this setting).
  jax.config.update("jax_default_matmul_precision", "highest")

_FRAMEWORKS = frozenset({"jax", "torch"})


@functools.cache
def _has_gpu(framework: str) -> bool:
  try:
    module = importlib.import_module(framework)
  except ImportError:
    return False
  if framework == "torch":
    return module.cuda.is_available()
  try:
    return bool(module.devices("gpu"))
  except RuntimeError:  # no GPU backend, or JAX_PLATFORMS=cpu
    return False


def _frameworks_of(module: types.ModuleType | None) -> frozenset[str]:
  """The frameworks a test module imported as modules (``import torch``, ``import jax.numpy``)."""
  if module is None:
    return _FRAMEWORKS
  names = {value.__name__.split(".")[0] for value in vars(module).values()
           if isinstance(value, types.ModuleType)}
  return frozenset(names & _FRAMEWORKS) or _FRAMEWORKS


def pytest_runtest_setup(item: pytest.Item) -> None:
  if item.get_closest_marker("gpu") is None:
    return
  missing = sorted(f for f in _frameworks_of(getattr(item, "module", None)) if not _has_gpu(f))
  if missing:
    pytest.skip(f"needs a GPU visible to {' and '.join(missing)}")
