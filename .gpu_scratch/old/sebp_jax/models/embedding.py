"""``nn.Embed`` whose table gradient is accumulated in float32.

The gradient of an embedding lookup is a scatter-add of the output gradient's rows into the table.
XLA:GPU lowers a bfloat16 scatter-add to emulated atomics, and in a BERT-base training step
(batch 32 × 512 tokens, H200) that one scatter took 40 ms — longer than the whole rest of the
forward and backward (23 ms) — and 83 ms when every token is real (``benchmarks/NOTES.md``,
"The embedding scatter"). Accumulating in float32, which GPUs add atomically in hardware, and
casting the summed table gradient once gives the same result up to one rounding (the sum of
bfloat16 terms in float32 is more accurate than a bfloat16 running sum, not less). The price is
a float32 table-sized temporary in the backward: 1.6 GB for LLaMA-3.2-3B's 128256 x 3072 table,
against 0.8 GB in bfloat16.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ["Embed", "embedding_lookup"]


@jax.custom_vjp
def embedding_lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
  """``table[ids]``: ``(V, D)`` and integer ``(...)`` → ``(..., D)``, as ``nn.Embed`` gathers
  (``jnp.take``: out-of-range ids read NaN and receive no gradient)."""
  return jnp.take(table, ids, axis=0)


def _lookup_fwd(table, ids):
  # The table is a parameter, alive anyway: keeping it costs no memory; only its shape and dtype
  # are read.
  return embedding_lookup(table, ids), (table, ids)


def _lookup_bwd(residuals, dy):
  table, ids = residuals
  dtable = jnp.zeros(table.shape, jnp.float32).at[ids].add(dy.astype(jnp.float32))
  return dtable.astype(table.dtype), None


embedding_lookup.defvjp(_lookup_fwd, _lookup_bwd)


class Embed(nn.Embed):
  """:class:`flax.linen.Embed` with the float32-accumulated gradient of :func:`embedding_lookup`.

  Same attributes, parameter (``embedding``, ``(num_embeddings, features)``) and ``attend`` as
  ``nn.Embed``, so checkpoints and :func:`sebp_jax.swap_dense` treat it as one.

  >>> import jax, jax.numpy as jnp
  >>> layer = Embed(num_embeddings=10, features=4)
  >>> ids = jnp.array([[1, 2, 0]])
  >>> params = layer.init(jax.random.key(0), ids)
  >>> layer.apply(params, ids).shape
  (1, 3, 4)
  """

  def __call__(self, inputs: jax.Array) -> jax.Array:
    """``(...)`` integer ids → ``(..., features)``."""
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
      raise ValueError(
        f"`inputs` to {type(self).__name__} must be integer ids, got {inputs.dtype}.")
    (embedding,) = self.promote_dtype(self.embedding, dtype=self.dtype, inexact=False)
    if self.num_embeddings == 1:
      return jnp.broadcast_to(embedding, inputs.shape + (self.features,))
    return embedding_lookup(embedding, inputs)
