"""The JAX backends the contract tests run on, and the policies each of them implements."""

from __future__ import annotations

import pytest

from sebp_jax import RowPolicy

__all__ = ["JAX_IMPLS", "impl_params", "implements"]

# Every backend is held to the same tests: "interpret" runs the Pallas kernels in the Pallas
# interpreter (CPU), "pallas" runs them on a GPU.
JAX_IMPLS = ["xla", "dense", "interpret", "pallas"]

# Marks a backend's test cases carry: a GPU-only backend is skipped without a GPU (conftest.py).
_MARKS = {"pallas": [pytest.mark.gpu]}


def impl_params() -> list:
  """``JAX_IMPLS`` as ``pytest.param``s carrying each backend's marks, for ``parametrize``."""
  return [pytest.param(impl, id=impl, marks=_MARKS.get(impl, [])) for impl in JAX_IMPLS]


def implements(impl: str, policy: RowPolicy) -> bool:
  """Whether ``impl`` implements ``policy``: ``"dense"`` is the plain backward, exact only."""
  return impl != "dense" or policy.is_exact

