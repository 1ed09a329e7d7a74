"""LLaMA-3.2-3B causal-LM fine-tuning: a training step on real reasoning-task lengths, every variant.

The exact Llama-3.2-3B architecture (28 layers, hidden 3072, GQA 24/8 heads, tied 128,256-token
embeddings, llama3 RoPE scaling) with random bfloat16 weights, context 4096, batch 1 and 4.
The ``-einsum`` variants run the same model built from Gemma-style ``nn.Einsum`` layers.
Workloads: the real token lengths of PIQA, SIQA, CommonsenseQA and OpenBookQA training texts
(prompt, options and answer; SmolLM2's LLaMA-architecture tokenizer,
:data:`benchmarks.workloads.LENGTHS_FILE`), and ``full_length``: every row real, where SEBP has
nothing to skip and must cost nothing. The loss is the next-token cross-entropy with labels -100 on
padding. Variants and measurement: :mod:`benchmarks.workloads`.

The torch model runs padding-aware flash attention (:mod:`benchmarks.torch_attention`: causal
within each sequence's real prefix, padded tail in blocks of 128; exact for right padding), as the
JAX model's ``right_padded=True`` uses its padding-aware attention.

Memory: 3.2B parameters, gradients and AdamW moments in bfloat16 are 25.7 GB before activations;
batch 4 at context 4096 adds tens of GB (the logits alone are 16384 x 128256): it may not fit an
80 GB card, in which case its rows carry the out-of-memory error.

Usage (writes ``llama.json``, ``llama.md`` and figures under ``--out-dir``)::

    python -m benchmarks.llama --out-dir benchmarks/results/h100
    python -m benchmarks.llama --tiny --in-process --out-dir /tmp/llama_tiny   # CPU smoke run
"""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks.workloads import ModelSpec, Workload, dataset_lengths, main

__all__ = ["DATASETS", "build"]

DATASETS = ("piqa", "siqa", "csqa", "obqa")
IGNORE_INDEX = -100  # label of positions without loss, in both frameworks
_PAD_ID = 0
_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def _config(tiny: bool, layers: int | None = None, scan_layers: bool = False):
  from sebp_jax.models import LlamaConfig

  layers = {} if layers is None else {"num_hidden_layers": layers}
  return LlamaConfig.llama_3_2_3b(**{**(_TINY if tiny else {}), **layers},
                                  scan_layers=scan_layers)


def make_batch(lengths: np.ndarray, seq_len: int, rng: np.random.Generator,
               vocab_size: int) -> dict[str, np.ndarray]:
  """``input_ids``, ``attention_mask`` and ``labels`` ``(B, seq_len)`` int32, right-padded to
  ``lengths``: random token ids, labels equal to the ids on real tokens and -100 on padding."""
  real = np.arange(seq_len)[None, :] < np.asarray(lengths)[:, None]
  ids = rng.integers(1, vocab_size, size=real.shape)
  return {"input_ids": np.where(real, ids, _PAD_ID).astype(np.int32),
          "attention_mask": real.astype(np.int32),
          "labels": np.where(real, ids, IGNORE_INDEX).astype(np.int32)}


def _jax_module(config):
  import jax.numpy as jnp

  from sebp_jax.models import LlamaForCausalLM

  return LlamaForCausalLM(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)


def _jax_einsum_module(config):
  """The same model from Gemma-style ``nn.Einsum`` layers (``projections="einsum"``)."""
  import dataclasses

  return _jax_module(dataclasses.replace(config, projections="einsum"))


def _jax_loss(module, params: Any, batch: dict) -> Any:
  from sebp_jax.models import causal_lm_loss

  logits = module.apply(params, batch["input_ids"], batch["attention_mask"], right_padded=True)
  return causal_lm_loss(logits, batch["labels"])


def _torch_model(config, device: str):
  """HF ``LlamaForCausalLM`` of the same config, bfloat16, with padding-aware attention: a
  :class:`benchmarks.torch_attention.RightPaddedModel` (``model(input_ids=..., attention_mask=...,
  labels=...)``; the inner model as ``.model``) whose attention layers run causal flash attention
  over each sequence's real prefix and over blocks of its padded tail, never across padding.

  Exact for right-padded batches: under the causal mask a real token attends only to earlier,
  real tokens, its prefix segment here, and position ids do not depend on the mask. Padded
  positions compute something, but their labels are -100 and nothing flows from them back to a
  real token, so the loss and every gradient are those of the masked model, and the padded rows of
  every linear layer's output gradient stay zero (:mod:`benchmarks.torch_attention`)."""
  import torch
  import transformers

  from benchmarks.torch_attention import RightPaddedModel, register

  rope = config.rope_scaling
  hf_config = transformers.LlamaConfig(
    vocab_size=config.vocab_size, hidden_size=config.hidden_size,
    intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
    num_attention_heads=config.num_attention_heads,
    num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
    max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.rms_norm_eps,
    rope_theta=config.rope_theta, tie_word_embeddings=config.tie_word_embeddings,
    rope_scaling=None if rope is None else dict(
      rope_type="llama3", factor=rope.factor, low_freq_factor=rope.low_freq_factor,
      high_freq_factor=rope.high_freq_factor,
      original_max_position_embeddings=rope.original_max_position_embeddings),
    pad_token_id=_PAD_ID, attn_implementation=register())
  # Built in bfloat16 directly on the device: a float32 copy of 3.2B parameters would need 13 GB.
  previous = torch.get_default_dtype()
  torch.set_default_dtype(torch.bfloat16)
  try:
    with torch.device(device):
      return RightPaddedModel(transformers.LlamaForCausalLM(hf_config))
  finally:
    torch.set_default_dtype(previous)


def build(tiny: bool, layers: int | None = None, scan_layers: bool = False) -> ModelSpec:
  """The LLaMA-3.2-3B benchmark (``tiny``: a 1-layer model at context 128, batch 1 and 2);
  ``layers``: that many of its decoder layers instead of all 28 (or the tiny model's 1);
  ``scan_layers``: the JAX model's layers as one ``nn.scan`` (``LlamaConfig.scan_layers``)."""
  config = _config(tiny, layers, scan_layers)
  seq_len = 128 if tiny else 4096
  workloads = tuple(Workload(name, name, dataset_lengths("llama", name)) for name in DATASETS)
  workloads += (Workload("full_length", "every row real", np.array([seq_len])),)
  if tiny:
    workloads = workloads[:1] + workloads[-1:]
  return ModelSpec(
    name="llama",
    seq_len=seq_len,
    batch_sizes=(1, 2) if tiny else (1, 4),
    dynamic_multiple=64,
    workloads=workloads,
    make_batch=lambda lengths, seq_len, rng: make_batch(lengths, seq_len, rng, config.vocab_size),
    jax_module=lambda: _jax_module(config),
    jax_einsum_module=lambda: _jax_einsum_module(config),
    jax_loss=_jax_loss,
    torch_model=lambda device: _torch_model(config, device),
    # Steps of a 3B model last 0.1-1 s and vary little; compiling dominates the run anyway.
    warmup=1,
    steps=5,
  )


if __name__ == "__main__":
  main(build)
