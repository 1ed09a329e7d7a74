"""Multi-head attention core shared by the BERT and LLaMA models.

One entry point, :func:`attend`, runs softmax attention over already projected heads through
``jax.nn.dot_product_attention``. Padding reaches it in one of two forms, chosen statically:

* an explicit boolean mask built from ``attention_mask`` (XLA; correct for any mask, left padding
  included), or
* per-sequence lengths (``query_seq_lengths``/``key_value_seq_lengths``) for cuDNN's fused
  attention, which skips the padded blocks. Lengths describe a mask only when every row of
  ``attention_mask`` is a right-padded prefix (ones, then zeros): mask values are traced, so the
  caller promises this with ``right_padded=True``; nothing can check it at trace time.

Attention-probability dropout needs the probabilities, which the fused kernels never form, so a
training call with a non-zero attention dropout rate takes an explicit softmax path.
"""

from __future__ import annotations

from typing import Literal

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ["ATTENTION_IMPLS", "AttentionImpl", "attend", "resolve_attention_impl"]

AttentionImpl = Literal["auto", "xla", "cudnn"]
ATTENTION_IMPLS: tuple[str, ...] = ("auto", "xla", "cudnn")

# cuDNN flash attention (the path jax.nn.dot_product_attention calls) takes half-precision inputs
# and head sizes that are multiples of 8, up to 128.
_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
_CUDNN_MAX_HEAD_DIM = 128


def _check_impl(impl: str) -> None:
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f"`attention_impl` must be one of {ATTENTION_IMPLS}, got {impl!r}.")


def _cudnn_unsupported(dtype, head_dim: int) -> str | None:
  """Why cuDNN cannot run these operands, or ``None`` when it can."""
  if not any(dtype == d for d in _CUDNN_DTYPES):
    return f"cuDNN attention needs bfloat16 or float16 operands, got {jnp.dtype(dtype).name}"
  if head_dim % 8 or head_dim > _CUDNN_MAX_HEAD_DIM:
    return f"cuDNN attention needs a head size that is a multiple of 8 up to 128, got {head_dim}"
  return None


def resolve_attention_impl(
  impl: str, *, dtype, head_dim: int, right_padded: bool, uses_dropout: bool
) -> str:
  """The concrete attention path, ``"xla"``, ``"cudnn"`` or ``"softmax"`` (explicit, with dropout).

  ``"auto"`` takes cuDNN only where it is exact and fast: on a GPU, with half-precision operands,
  a supported head size, a right-padded mask and no attention dropout; XLA with a mask otherwise.
  ``"cudnn"`` asks for cuDNN and raises a ``ValueError`` saying why where it cannot be used.
  """
  _check_impl(impl)
  if uses_dropout:
    if impl == "cudnn":
      raise ValueError(
        "`attention_impl='cudnn'` cannot apply attention-probability dropout; set the attention "
        "dropout rate to 0 or call with deterministic=True.")
    return "softmax"
  if impl == "xla":
    return "xla"
  reason = _cudnn_unsupported(dtype, head_dim)
  if reason is None and not right_padded:
    reason = "cuDNN attention takes sequence lengths, which need right_padded=True"
  if impl == "cudnn":
    if reason is not None:
      raise ValueError(f"`attention_impl='cudnn'`: {reason}.")
    return "cudnn"
  return "cudnn" if reason is None and jax.default_backend() == "gpu" else "xla"


def attend(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  attention_mask: jax.Array | None,
  *,
  causal: bool,
  impl: str = "auto",
  right_padded: bool = False,
  dropout_rate: float = 0.0,
  deterministic: bool = True,
  dropout_rng: jax.Array | None = None,
) -> jax.Array:
  """Softmax attention of projected heads.

  Args:
    query: ``(B, T, N, H)``.
    key, value: ``(B, T, K, H)`` with ``N % K == 0`` (grouped-query attention when ``K < N``).
    attention_mask: ``(B, T)``, non-zero on real tokens; ``None`` attends everywhere.
    causal: each position attends to itself and earlier positions only.
    impl: ``"auto"``, ``"xla"`` or ``"cudnn"`` (see :func:`resolve_attention_impl`).
    right_padded: the caller's promise that every mask row is ones followed by zeros.
    dropout_rate: attention-probability dropout, applied when ``deterministic`` is false.
    deterministic: disables dropout.
    dropout_rng: PRNG key for dropout; needed when dropout is applied.

  Returns:
    ``(B, T, N, H)`` in the dtype of ``query``. Rows of padded queries hold unspecified finite
    values (zeros under cuDNN); real-token rows never depend on them.
  """
  batch, length, num_heads, head_dim = query.shape
  path = resolve_attention_impl(
    impl, dtype=query.dtype, head_dim=head_dim, right_padded=right_padded,
    uses_dropout=dropout_rate > 0.0 and not deterministic)

  if path == "cudnn":
    lengths = None
    if attention_mask is not None:
      lengths = jnp.sum(attention_mask != 0, axis=-1, dtype=jnp.int32)
    return jax.nn.dot_product_attention(
      query, key, value, is_causal=causal, query_seq_lengths=lengths,
      key_value_seq_lengths=lengths, implementation="cudnn")

  # (B, 1, 1, T): masks keys only, so a padded query still sees the real keys, as in HF.
  mask = None if attention_mask is None else (attention_mask != 0)[:, None, None, :]
  if path == "xla":
    return jax.nn.dot_product_attention(
      query, key, value, mask=mask, is_causal=causal, implementation="xla")

  # Explicit softmax for dropout; K/V heads are repeated to the query heads (GQA).
  groups = num_heads // key.shape[2]
  key = jnp.repeat(key, groups, axis=2)
  value = jnp.repeat(value, groups, axis=2)
  if causal:
    causal_mask = nn.make_causal_mask(jnp.ones((batch, length), bool))
    mask = causal_mask if mask is None else jnp.logical_and(mask, causal_mask)
  # Element-wise dropout on the probabilities (not broadcast over queries), as torch does.
  return nn.dot_product_attention(
    query, key, value, mask=mask, dropout_rng=dropout_rng, dropout_rate=dropout_rate,
    broadcast_dropout=False, deterministic=False, dtype=query.dtype)
