"""The linear-layer shapes of the paper's workloads, and padded gradients to feed them.

A workload is ``batch`` sequences padded to ``seq_len`` tokens; a layer maps ``in_features`` to
``out_features``. Active rows of the output gradient are a right-padded prefix of each sequence,
as padding makes them in a real model, with lengths that vary between sequences; every other row
is exactly zero.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["LayerShape", "LAYER_SHAPES", "real_lengths", "padded_gradient"]


@dataclasses.dataclass(frozen=True)
class LayerShape:
  """``batch`` sequences of ``seq_len`` tokens through a ``in_features -> out_features`` layer;
  ``tied``: its weight is stored ``(out_features, in_features)``, as a tied embedding is (the
  model's ``transpose_kernel``), which ``benchmarks.tune_blocks`` times in that layout."""

  batch: int
  seq_len: int
  in_features: int
  out_features: int
  tied: bool = False

  @property
  def rows(self) -> int:
    return self.batch * self.seq_len


LAYER_SHAPES = {
  # BERT-base FFN, batch 32 at context 512.
  "bert_up": LayerShape(32, 512, 768, 3072),
  "bert_down": LayerShape(32, 512, 3072, 768),
  "bert_attn": LayerShape(32, 512, 768, 768),  # q, k, v and the attention output
  # LLaMA-3.2-3B at context 4096: MLP up/gate, MLP down, attention q/o, attention k/v (GQA).
  "llama_up_b1": LayerShape(1, 4096, 3072, 8192),
  "llama_down_b1": LayerShape(1, 4096, 8192, 3072),
  "llama_qo_b1": LayerShape(1, 4096, 3072, 3072),
  "llama_kv_b1": LayerShape(1, 4096, 3072, 1024),
  # The tied LM head (vocabulary 128,256): read in place, not compacted (BlockConfig.compact).
  "llama_head_b1": LayerShape(1, 4096, 3072, 128256, tied=True),
  "llama_head_b4": LayerShape(4, 4096, 3072, 128256, tied=True),
  "llama_up_b4": LayerShape(4, 4096, 3072, 8192),
  "llama_down_b4": LayerShape(4, 4096, 8192, 3072),
  "llama_qo_b4": LayerShape(4, 4096, 3072, 3072),
  "llama_kv_b4": LayerShape(4, 4096, 3072, 1024),
  "llama_up_b8": LayerShape(8, 4096, 3072, 8192),
  "llama_down_b8": LayerShape(8, 4096, 8192, 3072),
  "llama_qo_b8": LayerShape(8, 4096, 3072, 3072),
  "llama_kv_b8": LayerShape(8, 4096, 3072, 1024),
}


def real_lengths(shape: LayerShape, fraction: float, seed: int) -> np.ndarray:
  """Each sequence's real tokens, drawn as padding makes them: ``N(fraction, fraction / 2)`` of
  ``seq_len``, clipped to ``[1, seq_len]``; every token real at ``fraction >= 1``."""
  if fraction >= 1:
    return np.full(shape.batch, shape.seq_len)
  rng = np.random.default_rng(seed)
  mean = fraction * shape.seq_len
  lengths = np.rint(rng.normal(mean, mean / 2, size=shape.batch))
  return np.clip(lengths, 1, shape.seq_len).astype(np.int64)


def padded_gradient(shape: LayerShape, fraction: float, dtype, seed: int):
  """Random ``(x, kernel, dy, count)`` for ``shape``, each sequence's real tokens a prefix of
  :func:`real_lengths` tokens.

  Returns ``x (M, K)``, ``kernel (K, N)``, ``dy (M, N)`` (zero past each sequence's real tokens)
  and the number of non-zero rows of ``dy``.
  """
  kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
  m, k, n = shape.rows, shape.in_features, shape.out_features
  lengths = real_lengths(shape, fraction, seed)
  x = jax.random.normal(kx, (m, k), dtype)
  kernel = (jax.random.normal(kw, (k, n), jnp.float32) / k**0.5).astype(dtype)
  real = jnp.asarray(np.arange(shape.seq_len)[None, :] < lengths[:, None])
  dy = jax.random.normal(kd, (shape.batch, shape.seq_len, n), dtype) * real[:, :, None]
  return x, kernel, dy.reshape(m, n).astype(dtype), int(lengths.sum())
