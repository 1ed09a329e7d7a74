"""The linear-layer shapes of the paper's workloads, and padded gradients to feed them.

A workload is ``batch`` sequences padded to ``seq_len`` tokens; a layer maps ``in_features`` to
``out_features``. Active rows of the output gradient are a right-padded prefix of each sequence,
as padding makes them in a real model; every other row is exactly zero.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

__all__ = ["LayerShape", "LAYER_SHAPES", "padded_gradient"]


@dataclasses.dataclass(frozen=True)
class LayerShape:
  batch: int
  seq_len: int
  in_features: int
  out_features: int

  @property
  def rows(self) -> int:
    return self.batch * self.seq_len


LAYER_SHAPES = {
  # BERT-base FFN, batch 32 at context 512.
  "bert_up": LayerShape(32, 512, 768, 3072),
  "bert_down": LayerShape(32, 512, 3072, 768),
  # LLaMA-3.2-3B at context 4096: MLP up/gate, MLP down, attention q/o, attention k/v (GQA).
  "llama_up_b1": LayerShape(1, 4096, 3072, 8192),
  "llama_down_b1": LayerShape(1, 4096, 8192, 3072),
  "llama_qo_b1": LayerShape(1, 4096, 3072, 3072),
  "llama_kv_b1": LayerShape(1, 4096, 3072, 1024),
  "llama_up_b8": LayerShape(8, 4096, 3072, 8192),
  "llama_down_b8": LayerShape(8, 4096, 8192, 3072),
  "llama_qo_b8": LayerShape(8, 4096, 3072, 3072),
  "llama_kv_b8": LayerShape(8, 4096, 3072, 1024),
}


def padded_gradient(shape: LayerShape, fraction: float, dtype, seed: int):
  """Random ``(x, kernel, dy, count)`` for ``shape`` with ``fraction`` of each sequence real.

  Returns ``x (M, K)``, ``kernel (K, N)``, ``dy (M, N)`` (zero past each sequence's real tokens)
  and the number of non-zero rows of ``dy``.
  """
  kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
  m, k, n = shape.rows, shape.in_features, shape.out_features
  real = max(1, round(fraction * shape.seq_len))
  x = jax.random.normal(kx, (m, k), dtype)
  kernel = (jax.random.normal(kw, (k, n), jnp.float32) / k**0.5).astype(dtype)
  token = jnp.arange(shape.seq_len) < real
  dy = jax.random.normal(kd, (shape.batch, shape.seq_len, n), dtype) * token[None, :, None]
  return x, kernel, dy.reshape(m, n).astype(dtype), real * shape.batch
