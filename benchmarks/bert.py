"""BERT-base sequence classification: a training step on real short-text lengths, every variant.

The exact bert-base-uncased architecture with random bfloat16 weights, context 512, batch 32.
Workloads: the real token lengths of Rotten Tomatoes, TREC and SMS spam (bundled BERT tokenizer,
:data:`benchmarks.workloads.LENGTHS_FILE`), and lengths synthesized from the paper's GLUE
statistics (its Table 1: :func:`benchmarks.workloads.glue_lengths`). The loss is the
cross-entropy of the ``[CLS]`` classifier against random labels, so padded rows get zero
gradient in every layer. Variants and measurement: :mod:`benchmarks.workloads`.

Usage (writes ``bert.json``, ``bert.md`` and figures under ``--out-dir``)::

    python -m benchmarks.bert --out-dir benchmarks/results/h100
    python -m benchmarks.bert --tiny --in-process --out-dir /tmp/bert_tiny   # CPU smoke run
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from benchmarks.workloads import (GLUE_STATS, ModelSpec, Workload, dataset_lengths, glue_lengths,
                                  main)

__all__ = ["DATASETS", "build"]

DATASETS = ("rotten_tomatoes", "trec", "sms_spam")
_PAD_ID, _FIRST_TOKEN_ID = 0, 1000  # [PAD]; ids below 1000 are special or unused in the vocab
# Dropout off (see benchmarks.workloads); attention dropout would also rule out cuDNN attention.
_NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
_TINY = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
             vocab_size=1500)


def _config(tiny: bool):
  from sebp_jax.models import BertConfig

  return BertConfig.bert_base(**_NO_DROPOUT, **(_TINY if tiny else {}))


def make_batch(lengths: np.ndarray, seq_len: int, rng: np.random.Generator,
               vocab_size: int) -> dict[str, np.ndarray]:
  """``input_ids``/``attention_mask`` ``(B, seq_len)`` right-padded to ``lengths``, random token
  ids, and random binary ``labels`` ``(B,)``; all int32."""
  real = np.arange(seq_len)[None, :] < np.asarray(lengths)[:, None]
  ids = rng.integers(_FIRST_TOKEN_ID, vocab_size, size=real.shape)
  return {"input_ids": np.where(real, ids, _PAD_ID).astype(np.int32),
          "attention_mask": real.astype(np.int32),
          "labels": rng.integers(0, 2, size=len(lengths)).astype(np.int32)}


def _jax_module(config):
  import jax.numpy as jnp

  from sebp_jax.models import BertForSequenceClassification

  return BertForSequenceClassification(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)


def _jax_loss(module, params: Any, batch: dict) -> Any:
  import jax.numpy as jnp
  import optax

  logits = module.apply(params, batch["input_ids"], batch["attention_mask"], deterministic=True,
                        right_padded=True)
  return optax.softmax_cross_entropy_with_integer_labels(
    logits.astype(jnp.float32), batch["labels"]).mean()


def _torch_model(config, device: str):
  """HF ``BertForSequenceClassification`` of the same config, bfloat16, with padding-aware
  attention: a :class:`benchmarks.torch_attention.RightPaddedModel` (``model(input_ids=...,
  attention_mask=..., labels=...)``; the inner model as ``.model``) whose attention layers run
  flash attention over each sequence's real prefix and over blocks of its padded tail.

  Exact for right-padded batches: a real token attends to the real tokens, as under the HF key
  mask; padded queries attend within their tail block instead of to the real keys, but nothing
  flows from a padded row to ``[CLS]`` or the loss (:mod:`benchmarks.torch_attention`)."""
  import torch
  import transformers

  from benchmarks.torch_attention import RightPaddedModel, register

  hf_config = transformers.BertConfig(
    **{k: v for k, v in dataclasses.asdict(config).items() if k != "attention_impl"},
    attn_implementation=register())
  with torch.device(device):
    model = transformers.BertForSequenceClassification(hf_config).to(torch.bfloat16)
  return RightPaddedModel(model)


def build(tiny: bool) -> ModelSpec:
  """The BERT-base benchmark (``tiny``: a 1-layer model at context 64, batch 4)."""
  config = _config(tiny)
  workloads = tuple(Workload(name, name, dataset_lengths("bert", name)) for name in DATASETS)
  workloads += tuple(Workload(f"glue_{task}", f"{task} (synthetic, paper Table 1)",
                              glue_lengths(task)) for task in GLUE_STATS)
  if tiny:
    workloads = workloads[:2] + workloads[-1:]
  return ModelSpec(
    name="bert",
    seq_len=64 if tiny else 512,
    batch_sizes=(4,) if tiny else (32,),
    dynamic_multiple=16 if tiny else 64,
    workloads=workloads,
    make_batch=lambda lengths, seq_len, rng: make_batch(lengths, seq_len, rng, config.vocab_size),
    jax_module=lambda: _jax_module(config),
    jax_loss=_jax_loss,
    torch_model=lambda device: _torch_model(config, device),
    paper_max_rows=None if tiny else 3456,  # the paper's fixed Top-N for BERT-base (its §4)
  )


if __name__ == "__main__":
  main(build)
