"""Layer parity across frameworks: ``sebp_jax.sebp_matmul`` against ``sebp_torch_ref.sebp_linear``.

The same numpy inputs (values exact in the dtype under test) go through every JAX backend and
every torch backend; ``y``, ``dX``, ``dW`` (flax layout ``(in, out)`` against torch's ``(out,
in)``, transposed), ``db`` and the kept rows must agree, within the tolerance of the dtype
(:mod:`parity_tests.tolerances`), for every policy. The comparisons live in
:mod:`parity_tests.comparisons`, shared with ``python -m parity_tests.report``.

``pallas`` and ``triton`` cases carry the ``gpu`` marker; the Triton interpreter on CPU is covered
by test_torch_sebp_linear.py (it needs a process of its own).
"""

from __future__ import annotations

import itertools
import zlib

import numpy as np
import pytest

from parity_tests import comparisons

DTYPES = ("float32", "bfloat16")
JAX_IMPLS = (*comparisons.JAX_IMPLS, "pallas")
TORCH_IMPLS = (*comparisons.TORCH_IMPLS, "triton")


def _cases():
  for dtype, policy, jax_impl, torch_impl in itertools.product(
      DTYPES, comparisons.POLICIES, JAX_IMPLS, TORCH_IMPLS):
    if comparisons.supports(jax_impl, policy) and comparisons.supports(torch_impl, policy):
      gpu = {jax_impl, torch_impl} & comparisons.GPU_IMPLS
      yield pytest.param(dtype, policy, jax_impl, torch_impl,
                         id=f"{dtype}-{policy}-{jax_impl}-{torch_impl}",
                         marks=[pytest.mark.gpu] if gpu else [])


def _seed(*key) -> int:
  """Fresh inputs per dtype and policy, shared by every backend pair (results are cached)."""
  return zlib.crc32(repr(key).encode())


@pytest.mark.parametrize("dtype, policy, jax_impl, torch_impl", list(_cases()))
def test_layer_matches_torch(dtype, policy, jax_impl, torch_impl):
  for comparison in comparisons.layer_comparisons(dtype, policy, jax_impl, torch_impl,
                                                  seed=_seed(dtype, policy)):
    comparison.check()


@pytest.mark.parametrize("policy", ["threshold", "max_rows", "both"])
def test_policies_change_the_gradients(policy):
  """The inputs tell the policies apart: a backend that ignored the policy would fail above
  (its kept rows, compared exactly, would be the exact policy's)."""
  seed = _seed("float32", policy)
  sebp = comparisons.torch_layer("float32", seed, policy, "torch")
  dense = comparisons.torch_layer("float32", seed, "exact", "torch")
  dropped = dense.kept & ~sebp.kept
  assert dropped.any()
  rows = lambda result: result.dx.reshape(-1, comparisons.LAYER_IN)
  assert np.all(rows(sebp)[dropped] == 0) and np.all(np.any(rows(dense)[dropped] != 0, axis=1))
  assert np.any(sebp.dkernel != dense.dkernel)
  np.testing.assert_array_equal(sebp.dbias, dense.dbias)  # db is always the full row sum


def test_layouts_are_transposed():
  """dW is compared in flax layout; a torch weight gradient left as (out, in) is caught."""
  seed = _seed("float32", "exact")
  got = comparisons.jax_layer("float32", seed, "exact", "xla")
  want = comparisons.torch_layer("float32", seed, "exact", "torch")
  assert got.dkernel.shape == want.dkernel.shape == (comparisons.LAYER_IN, comparisons.LAYER_OUT)


def test_rejects_a_policy_a_backend_lacks():
  with pytest.raises(ValueError, match="dense"):
    comparisons.layer_comparisons("float32", "threshold", "dense", "torch")
