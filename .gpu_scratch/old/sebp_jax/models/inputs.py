"""The token inputs every model's entry point takes, checked and given their defaults."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["token_inputs"]


def token_inputs(
  input_ids, attention_mask=None, position_ids=None
) -> tuple[jax.Array, jax.Array | None, jax.Array]:
  """``(input_ids, attention_mask, position_ids)`` as arrays.

  Args:
    input_ids: ``(B, T)`` token ids; anything else raises a ``ValueError`` naming it.
    attention_mask: ``(B, T)`` or ``None`` (left ``None``).
    position_ids: ``(B, T)``; ``None``: ``0 .. T-1`` in every row (HF's default, whatever the
      padding side).
  """
  input_ids = jnp.asarray(input_ids)
  if input_ids.ndim != 2:
    raise ValueError(f"`input_ids` must be (batch, length), got shape {input_ids.shape}.")
  if attention_mask is not None:
    attention_mask = jnp.asarray(attention_mask)
  if position_ids is None:
    position_ids = jnp.broadcast_to(jnp.arange(input_ids.shape[1]), input_ids.shape)
  return input_ids, attention_mask, position_ids
