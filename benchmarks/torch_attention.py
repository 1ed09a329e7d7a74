"""Padding-aware attention for the torch benchmark models: flash attention over segments that
never cross padding, with a fixed number of segments (no host sync, CUDA-graph capturable).

Why: the JAX models of :mod:`benchmarks.bert` and :mod:`benchmarks.llama` run cuDNN attention
with the batch's sequence lengths and skip the padding, while Hugging Face's SDPA attention does
the whole ``S x S`` work (BERT: the memory-efficient kernel under a key mask; LLaMA: the causal
flash kernel over 4096 positions). Every torch variant (dense, SEBP, bound, graphed) runs this
attention alike, so torch's dense baseline gets the same saving and the comparison stays fair
(issue 19).

Segments. The batch is right-padded (a precondition: each sequence's real tokens are a prefix of
its row, so its real length is ``attention_mask.sum(-1)``). Tokens stay in place: ``q``, ``k``
and ``v`` ``(B, S, H, D)`` are viewed as ``(B * S, H, D)`` and cut into segments; a token attends
only to tokens of its own segment (causally inside it for LLaMA). Per sequence of real length
``L``, with ``n = ceil(S / T)`` for a block ``T``, the ``n + 1`` segment ends, relative to the
sequence's start, are ``e_j = min(max(L, j * T), S)`` for ``j = 0 .. n``:

* the real prefix ``[0, L)`` is one segment (``e_0 = L``);
* the padded tail ``[L, S)`` is cut at the multiples of ``T`` above ``L``: no tail segment is
  longer than ``T``, so padded rows cost next to nothing;
* where ``L`` is a multiple of ``T`` (``0`` and ``S`` included) some ends repeat: zero-length
  segments, which the kernel skips. A sequence without real tokens (``L = 0``) gets an empty
  first segment and tail blocks only.

So ``cu_seqlens`` (:func:`padding_segments`) always has ``B * (n + 1) + 1`` entries, computed on
the device from the mask; the kernel's ``max_q = max_k = S`` is a Python int known in advance (an
upper bound is all flash varlen needs). Nothing reads the device: the forward is graph-capturable.

Why exact: in the masked Hugging Face model a real token attends only to real tokens (BERT: the
key mask; LLaMA: the causal mask over a right-padded row), and here it attends to exactly the same
tokens, its real prefix, with the same causality. Padded rows compute something else (BERT's
padded queries see their tail block instead of the real keys), but nothing flows from a padded
row to a real row or to the loss: padded rows only feed token-wise layers' padded rows and, as
keys and values, padded queries of their own tail segment; the loss reads real rows only (BERT's
``[CLS]`` at position 0, LLaMA's labels are -100 on padding). So the loss and every gradient equal
the masked model's, and the padded rows of every linear layer's output gradient are exactly zero
(the attention backward of a segment whose queries all have zero output gradient is zero), which
SEBP relies on.

Kernel. On CUDA: ``torch.ops.aten._flash_attention_forward`` / ``_flash_attention_backward``
(FlashAttention-2's varlen path, the ops SDPA's flash backend and
``torch.nn.attention.varlen.varlen_attn`` call) in a small :class:`torch.autograd.Function`,
called with positional arguments whose order has been stable since torch 2.1 (``varlen_attn``'s
own signature changed between releases: ``is_causal`` became ``window_size``). GQA (LLaMA's 24
query / 8 key-value heads) goes to the kernel as is: FlashAttention-2 shares each key-value head
among its query heads. Flash needs float16 or bfloat16 on the GPU; anything else there is refused
with a clear error. On the CPU, :func:`reference_segment_attention` (SDPA under the segments'
block-diagonal mask, same semantics, ``O((B S)^2)`` memory per sequence: tests and tiny smoke runs
only) runs instead.

Plugging into Hugging Face: :func:`register` adds :data:`ATTN_IMPLEMENTATION` to
``transformers.AttentionInterface``; a model built with that ``attn_implementation`` builds no 4-D
mask (the name has no mask function) and calls :func:`segment_attention` per layer, which takes
the step's :class:`Segments` from the ``segments`` keyword argument that
:class:`RightPaddedModel` computes once per forward and Hugging Face forwards to every attention
call (BERT and LLaMA pass their ``**kwargs`` down).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

__all__ = ["ATTN_IMPLEMENTATION", "DEFAULT_BLOCK", "Segments", "padding_segments",
           "segment_ids", "reference_segment_attention", "flash_segment_attention",
           "varlen_segment_attention", "segment_attention", "register", "RightPaddedModel"]

ATTN_IMPLEMENTATION = "sebp_padding_segments"
# Tail block: FlashAttention-2's row block for head dims 64 and 128, so a padded tail block is one
# tile; a smaller block adds segments (each costs the kernel's grid max_len / 128 empty tiles).
DEFAULT_BLOCK = 128
_FLASH_DTYPES = (torch.float16, torch.bfloat16)


class Segments(NamedTuple):
  """The segments of a right-padded batch (:func:`padding_segments`).

  Attributes:
    cu_seqlens: ``(B * (ceil(S / block) + 1) + 1,)`` int32, on the mask's device: segment ``i``
      is tokens ``[cu_seqlens[i], cu_seqlens[i + 1])`` of the flattened ``(B * S)`` batch.
    max_len: ``S``, an upper bound of every segment's length (a Python int: no device read).
  """

  cu_seqlens: torch.Tensor
  max_len: int


def padding_segments(attention_mask: torch.Tensor, block: int = DEFAULT_BLOCK) -> Segments:
  """The segments of a right-padded batch: per sequence its real prefix, then its padded tail cut
  at the multiples of ``block`` (see the module docstring).

  Args:
    attention_mask: ``(B, S)``, nonzero on real tokens; each row's real tokens must be a prefix
      (right padding; not checked, as that would read the device). Only ``mask.sum(-1)`` is used.
    block: the longest tail segment, ``>= 1``.

  Returns:
    :class:`Segments` with ``B * (ceil(S / block) + 1) + 1`` boundaries, non-decreasing, computed
    on the mask's device.
  """
  if attention_mask.ndim != 2:
    raise ValueError(f"padding_segments: `attention_mask` must be (batch, seq_len), got shape "
                     f"{tuple(attention_mask.shape)}.")
  if block < 1:
    raise ValueError(f"padding_segments: `block` must be >= 1, got {block}.")
  batch, seq_len = attention_mask.shape
  n_blocks = math.ceil(seq_len / block)
  device = attention_mask.device
  lengths = (attention_mask != 0).sum(-1, dtype=torch.int32)  # right padding: the real prefix
  starts = torch.arange(n_blocks + 1, device=device, dtype=torch.int32) * block
  ends = torch.clamp(torch.maximum(lengths[:, None], starts[None, :]), max=seq_len)  # (B, n + 1)
  ends = ends + torch.arange(batch, device=device, dtype=torch.int32)[:, None] * seq_len
  cu_seqlens = torch.cat([torch.zeros(1, device=device, dtype=torch.int32), ends.reshape(-1)])
  return Segments(cu_seqlens, seq_len)


def segment_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
  """``(total,)`` int64: the index of the (non-empty) segment holding each token."""
  tokens = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
  return torch.searchsorted(cu_seqlens, tokens, right=True) - 1


def reference_segment_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                cu_seqlens: torch.Tensor, *, causal: bool,
                                scale: float | None = None) -> torch.Tensor:
  """What :func:`flash_segment_attention` computes, by SDPA under a block-diagonal mask (any
  device and dtype; memory ``O(T^2)`` in the token count ``T``: tests and tiny runs).

  Args:
    query: ``(T, Hq, D)``; key, value: ``(T, Hkv, D)`` with ``Hq`` a multiple of ``Hkv``.
    cu_seqlens: the segment boundaries (``cu_seqlens[-1] == T``).
    causal: each token attends only to its segment's earlier tokens and itself.
    scale: of the scores; ``1 / sqrt(D)`` if ``None``.

  Returns:
    ``(T, Hq, D)``.
  """
  total, heads = query.shape[:2]
  if key.shape[1] != heads:
    key = key.repeat_interleave(heads // key.shape[1], dim=1)
    value = value.repeat_interleave(heads // value.shape[1], dim=1)
  ids = segment_ids(cu_seqlens, total)
  allowed = ids[:, None] == ids[None, :]
  if causal:
    allowed = allowed & torch.ones(total, total, dtype=torch.bool, device=query.device).tril()
  out = torch.nn.functional.scaled_dot_product_attention(
    query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), attn_mask=allowed,
    scale=scale)
  return out.transpose(0, 1)


class _FlashVarlen(torch.autograd.Function):
  """FlashAttention-2 varlen forward and backward (aten ops), dropout off."""

  @staticmethod
  def forward(ctx, query, key, value, cu_seqlens, max_len, causal, scale):
    # Positional order of aten::_flash_attention_forward since torch 2.1: query, key, value,
    # cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask; its outputs:
    # output, logsumexp, then two RNG tensors (philox seed/offset, later rng_state/unused) that
    # the backward takes back in the same places.
    out, lse, rng_a, rng_b, _ = torch.ops.aten._flash_attention_forward(
      query, key, value, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, causal, False,
      scale=scale)
    ctx.save_for_backward(query, key, value, out, lse, cu_seqlens, rng_a, rng_b)
    ctx.max_len, ctx.causal, ctx.scale = max_len, causal, scale
    return out

  @staticmethod
  def backward(ctx, grad_out):
    query, key, value, out, lse, cu_seqlens, rng_a, rng_b = ctx.saved_tensors
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
      grad_out.contiguous(), query, key, value, out, lse, cu_seqlens, cu_seqlens, ctx.max_len,
      ctx.max_len, 0.0, ctx.causal, rng_a, rng_b, scale=ctx.scale)
    return dq, dk, dv, None, None, None, None


def flash_segment_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            segments: Segments, *, causal: bool,
                            scale: float | None = None) -> torch.Tensor:
  """Flash varlen attention over ``segments`` on CUDA (float16/bfloat16); arguments and result as
  :func:`reference_segment_attention`'s. Differentiable in ``query``, ``key`` and ``value``."""
  if query.device.type != "cuda":
    raise ValueError(f"flash_segment_attention: FlashAttention runs on CUDA only, got a "
                     f"{query.device.type} tensor (use reference_segment_attention there).")
  if query.dtype not in _FLASH_DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
    raise ValueError(f"flash_segment_attention: FlashAttention needs float16 or bfloat16 query, "
                     f"key and value of one dtype, got {query.dtype}, {key.dtype}, "
                     f"{value.dtype}.")
  if query.shape[1] % key.shape[1]:
    raise ValueError(f"flash_segment_attention: {query.shape[1]} query heads are not a multiple "
                     f"of {key.shape[1]} key-value heads.")
  cu_seqlens = segments.cu_seqlens.to(torch.int32)
  return _FlashVarlen.apply(query.contiguous(), key.contiguous(), value.contiguous(), cu_seqlens,
                            int(segments.max_len), bool(causal), scale)


def varlen_segment_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             segments: Segments, *, causal: bool, scale: float | None = None,
                             impl: str = "auto") -> torch.Tensor:
  """Segment attention ``(T, H, D)``: ``impl="flash"`` (:func:`flash_segment_attention`),
  ``"reference"`` (:func:`reference_segment_attention`) or ``"auto"``: flash on CUDA, the
  reference on the CPU, an error elsewhere."""
  if impl == "auto":
    if query.device.type == "cuda":
      impl = "flash"
    elif query.device.type == "cpu":
      impl = "reference"
    else:
      raise ValueError(f"varlen_segment_attention: no padding-aware attention on "
                       f"{query.device.type}: flash needs CUDA, the reference runs on the CPU.")
  if impl == "flash":
    return flash_segment_attention(query, key, value, segments, causal=causal, scale=scale)
  if impl == "reference":
    return reference_segment_attention(query, key, value, segments.cu_seqlens, causal=causal,
                                       scale=scale)
  raise ValueError(f"varlen_segment_attention: `impl` must be 'auto', 'flash' or 'reference', "
                   f"got {impl!r}.")


def segment_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: Any, dropout: float = 0.0,
                      scaling: float | None = None, segments: Segments | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
  """A Hugging Face attention function (``transformers.AttentionInterface``): ``query``
  ``(B, Hq, S, D)``, ``key``/``value`` ``(B, Hkv, S, D)``; returns ``((B, S, Hq, D), None)``.

  Attends within ``segments`` (from :class:`RightPaddedModel`), causally where the layer says so
  (``module.is_causal``: LLaMA yes, BERT's encoder no); ``attention_mask`` is ignored (the name
  has no mask function, so Hugging Face passes ``None`` or the 2-D mask the segments came from).
  Dropout is refused: the benchmarks run without it.
  """
  del attention_mask, kwargs
  if segments is None:
    raise ValueError(f"segment_attention: no `segments`; a model with attn_implementation="
                     f"{ATTN_IMPLEMENTATION!r} must be called through RightPaddedModel (or with "
                     f"segments=padding_segments(attention_mask)).")
  if dropout:
    raise ValueError(f"segment_attention: attention dropout is not supported, got {dropout}.")
  batch, heads, seq_len, head_dim = query.shape
  if seq_len != segments.max_len:
    raise ValueError(f"segment_attention: segments of {segments.max_len} positions per sequence, "
                     f"attention over {seq_len}.")

  def tokens(x):  # (B, H, S, D) -> (B * S, H, D)
    return x.transpose(1, 2).reshape(batch * seq_len, x.shape[1], head_dim)

  out = varlen_segment_attention(tokens(query), tokens(key), tokens(value), segments,
                                 causal=bool(getattr(module, "is_causal", False)), scale=scaling)
  return out.view(batch, seq_len, heads, head_dim), None


def register() -> str:
  """Registers :func:`segment_attention` as :data:`ATTN_IMPLEMENTATION` with Hugging Face's
  ``AttentionInterface`` (idempotent); returns the name, for ``attn_implementation=``."""
  import transformers

  transformers.AttentionInterface.register(ATTN_IMPLEMENTATION, segment_attention)
  return ATTN_IMPLEMENTATION


class RightPaddedModel(torch.nn.Module):
  """A Hugging Face model built with ``attn_implementation=ATTN_IMPLEMENTATION``, called as
  ``model(input_ids=..., attention_mask=..., labels=...)`` on right-padded batches: computes the
  step's :class:`Segments` from the mask (on the device, once per forward, so inside a captured
  graph it is recomputed from the static mask on each replay) and hands them to every attention
  layer. The inner model gets no ``attention_mask``: the segments carry all of it (exactness: see
  the module docstring).

  Attributes:
    model: the Hugging Face model.
    block: the longest padded-tail segment (:func:`padding_segments`).
  """

  def __init__(self, model: torch.nn.Module, block: int = DEFAULT_BLOCK) -> None:
    super().__init__()
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if implementation != ATTN_IMPLEMENTATION:
      raise ValueError(f"RightPaddedModel: the model's attn_implementation is "
                       f"{implementation!r}, not {ATTN_IMPLEMENTATION!r} (see register()).")
    self.model = model
    self.block = block

  def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor):
    segments = padding_segments(attention_mask, self.block)
    return self.model(input_ids=input_ids, labels=labels, segments=segments)
