"""Model parity: flax BERT classifier and LLaMA against Hugging Face torch, SEBP on in both.

Tiny random HF models move into flax through ``sebp_jax.models.from_hf`` (identical weights).
SEBP is switched on with ``swap_dense`` in JAX and ``apply_sebp`` in torch; on a padded batch the
loss and every parameter gradient must agree in float32 (rel 1e-4), for the exact policy, a
threshold and a ``max_rows`` policy, and every linear layer must keep the same rows in both
frameworks. The policies are chosen, and checked on both frameworks' gradients, so that no
decision hinges on rounding (:func:`parity_tests.comparisons.model_comparisons`).
"""

from __future__ import annotations

import pytest

from parity_tests import comparisons

pytest.importorskip("transformers")

IMPLS = [pytest.param(("xla", "torch"), id="xla-torch"),
         pytest.param(("pallas", "triton"), id="pallas-triton", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("impls", IMPLS)
@pytest.mark.parametrize("policy", comparisons.MODEL_POLICIES)
@pytest.mark.parametrize("arch", comparisons.MODEL_ARCHS)
def test_model_matches_hf_torch(arch, policy, impls):
  results = comparisons.model_comparisons(arch, policy, *impls)
  quantities = {c.quantity for c in results}
  assert quantities == {"loss", "parameter gradients", "kept rows"}, quantities
  for comparison in results:
    comparison.check()
