"""Token cross-entropy whose gradient is one pass over the logits.

Autodiff of ``log_softmax`` followed by ``take_along_axis`` differentiates the pick as a
scatter-add into a float32 zeros buffer of the logits' full size, then reads that buffer back
with the logits to form the logits' gradient. For LLaMA-3.2-3B at 4,096 tokens the buffer is
2.1 GB per sequence: on an H100 the scatter and the fusion reading it took ~1.7 ms of every
training step, dense or SEBP, and the buffer was alive at the step's memory peak (without it,
LLaMA-3.2-3B at batch 4 × 4096 fits an H100: ``benchmarks/NOTES.md``, "v16").
:func:`token_cross_entropy`'s backward writes ``weight * (softmax - one_hot)`` directly,
comparing the vocabulary index with the target inside the same elementwise pass: the logits are
read once and their gradient written once, in the logits' dtype, with no float32 buffer of their
size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["token_cross_entropy"]


@jax.custom_vjp
def token_cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> jax.Array:
  """``sum(weights * (logsumexp(logits) - logits[targets]))`` over the rows, in float32.

  Args:
    logits: ``(rows, vocab)``, any floating dtype (computed in float32).
    targets: ``(rows,)`` integer ids in ``[0, vocab)``; a row of weight 0 may hold any id in range.
    weights: ``(rows,)`` float32; a row of weight 0 adds nothing and gets a zero gradient, even
      where its logits are not finite (as the loss ignores it).

  Returns:
    A float32 scalar. Its gradient for ``logits`` has the logits' dtype; ``targets`` and
    ``weights`` get none (zeros).

  >>> logits = jnp.log(jnp.array([[0.25, 0.75], [0.5, 0.5]]))
  >>> token_cross_entropy(logits, jnp.array([1, 0]), jnp.array([1.0, 0.0])).round(4)
  Array(0.2877, dtype=float32)
  """
  return _forward(logits, targets, weights)[0]


def _forward(logits, targets, weights):
  wide = logits.astype(jnp.float32)
  logsumexp = jax.nn.logsumexp(wide, axis=-1)
  picked = jnp.take_along_axis(wide, targets[:, None], axis=-1)[:, 0]
  # `where`, not a product: a weight-0 row with a non-finite logit must not turn the sum into NaN.
  loss = jnp.sum(jnp.where(weights != 0, weights * (logsumexp - picked), 0.0))
  return loss, logsumexp


def _fwd(logits, targets, weights):
  loss, logsumexp = _forward(logits, targets, weights)
  return loss, (logits, targets, weights, logsumexp)


def _bwd(residuals, dloss):
  logits, targets, weights, logsumexp = residuals
  scale = (dloss * weights)[:, None]
  softmax = jnp.exp(logits.astype(jnp.float32) - logsumexp[:, None])
  one_hot = jax.lax.broadcasted_iota(targets.dtype, logits.shape, 1) == targets[:, None]
  dlogits = jnp.where(scale != 0, scale * (softmax - one_hot), 0.0)
  return dlogits.astype(logits.dtype), None, jnp.zeros_like(weights)


token_cross_entropy.defvjp(_fwd, _bwd)
