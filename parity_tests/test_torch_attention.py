"""``benchmarks/torch_attention.py``: the torch benchmark models' padding-aware attention.

The segments are checked against hand-computed boundaries and the properties that make them
exact (the real prefix is one segment, no segment crosses padding, tail segments are at most one
block); the CPU reference path against Hugging Face-style masked attention (BERT's key mask,
LLaMA's causal mask with GQA) in outputs and gradients, and the tiny BERT and LLaMA benchmark
models against the same models with SDPA and the mask, in the loss and every parameter's
gradient. The ``gpu`` tests run the flash path against the reference on CUDA in bfloat16, inside
a CUDA graph too.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from benchmarks.torch_attention import (ATTN_IMPLEMENTATION, RightPaddedModel,
                                        flash_segment_attention, padding_segments,
                                        segment_attention, varlen_segment_attention)


def _mask(lengths, seq_len):
  return (torch.arange(seq_len)[None, :] < torch.as_tensor(lengths)[:, None]).long()


@pytest.mark.parametrize("lengths, seq_len, block, ends", [
  # e_j = min(max(L, j * block), S), j = 0 .. ceil(S / block), per sequence
  ([0, 1, 4, 5, 8], 8, 4, [[0, 4, 8], [1, 4, 8], [4, 4, 8], [5, 5, 8], [8, 8, 8]]),
  ([3, 10, 9, 0], 10, 4, [[3, 4, 8, 10], [10, 10, 10, 10], [9, 9, 9, 10], [0, 4, 8, 10]]),
  ([2], 5, 1, [[2, 2, 2, 3, 4, 5]]),
  ([3, 7], 7, 7, [[3, 7], [7, 7]]),
  ([3, 7], 7, 100, [[3, 7], [7, 7]]),
])
def test_padding_segments_are_the_expected_boundaries(lengths, seq_len, block, ends):
  segments = padding_segments(_mask(lengths, seq_len), block)
  offsets = torch.arange(len(lengths))[:, None] * seq_len
  want = torch.cat([torch.zeros(1, dtype=torch.int64),
                    (torch.tensor(ends) + offsets).reshape(-1)])
  assert segments.cu_seqlens.dtype == torch.int32
  assert segments.max_len == seq_len
  torch.testing.assert_close(segments.cu_seqlens.long(), want, rtol=0, atol=0)


@pytest.mark.parametrize("seq_len, block", [(64, 16), (64, 1), (100, 7), (100, 128), (128, 128)])
def test_padding_segments_never_cross_padding(seq_len, block):
  rng = np.random.default_rng(seq_len + block)
  edges = [0, 1, seq_len, seq_len - 1, min(block, seq_len), min(2 * block, seq_len)]
  lengths = np.concatenate([edges, rng.integers(0, seq_len + 1, size=10)])
  for mask in (_mask(lengths, seq_len), _mask(lengths, seq_len).bool(),
               _mask(lengths, seq_len).float()):
    cu = padding_segments(mask, block).cu_seqlens.long().tolist()
    batch = len(lengths)
    assert len(cu) == batch * (math.ceil(seq_len / block) + 1) + 1  # fixed, whatever the lengths
    assert cu[0] == 0 and cu[-1] == batch * seq_len
    assert all(a <= b for a, b in zip(cu, cu[1:]))
    bounds = set(cu)
    for b, length in enumerate(lengths):
      start, real_end, end = b * seq_len, b * seq_len + int(length), (b + 1) * seq_len
      # the sequence's start, its real prefix's end and its end are boundaries ...
      assert {start, real_end, end} <= bounds
      # ... and nothing cuts the real prefix: it is one segment (or none, if empty)
      assert not [c for c in bounds if start < c < real_end]
      # the padded tail is cut into segments of at most `block` tokens
      tail = sorted(c for c in bounds if real_end <= c <= end)
      assert all(0 < b2 - b1 <= block for b1, b2 in zip(tail, tail[1:]))


def test_padding_segments_refuse_bad_arguments():
  with pytest.raises(ValueError, match="batch, seq_len"):
    padding_segments(torch.ones(4))
  with pytest.raises(ValueError, match="block"):
    padding_segments(torch.ones(1, 4), 0)


def _hf_masked_attention(q, k, v, mask, causal):
  """Hugging Face's SDPA semantics: ``(B, H, S, D)``, a key mask (and causal)."""
  heads, kv_heads = q.shape[1], k.shape[1]
  k = k.repeat_interleave(heads // kv_heads, dim=1)
  v = v.repeat_interleave(heads // kv_heads, dim=1)
  seq_len = q.shape[2]
  allowed = mask.bool()[:, None, None, :].expand(-1, 1, seq_len, -1)
  if causal:
    allowed = allowed & torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
  allowed = allowed | ~allowed.any(-1, keepdim=True)  # rows without keys: anything finite
  return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


class _Layer(torch.nn.Module):
  def __init__(self, causal):
    super().__init__()
    self.is_causal = causal


@pytest.mark.parametrize("causal, heads, kv_heads", [(False, 4, 4), (True, 6, 2), (True, 3, 3)])
@pytest.mark.parametrize("block", [8, 5, 64])
def test_reference_path_matches_masked_attention_on_real_rows(causal, heads, kv_heads, block):
  torch.manual_seed(0)
  lengths, seq_len, dim = [13, 32, 1, 9], 32, 8
  if causal:
    lengths.append(0)  # LLaMA may have a sequence without real tokens; BERT has [CLS] at least
  mask = _mask(lengths, seq_len)
  batch = len(lengths)
  q = torch.randn(batch, heads, seq_len, dim, dtype=torch.float64, requires_grad=True)
  k = torch.randn(batch, kv_heads, seq_len, dim, dtype=torch.float64, requires_grad=True)
  v = torch.randn(batch, kv_heads, seq_len, dim, dtype=torch.float64, requires_grad=True)
  weight = torch.randn(batch, seq_len, heads, dim, dtype=torch.float64) * mask[:, :, None, None]

  out, none = segment_attention(_Layer(causal), q, k, v, None,
                                segments=padding_segments(mask, block))
  assert none is None and out.shape == (batch, seq_len, heads, dim)
  want = _hf_masked_attention(q, k, v, mask, causal).transpose(1, 2)
  real = mask.bool()
  torch.testing.assert_close(out[real], want[real], rtol=1e-10, atol=1e-10)
  # a loss of the real rows only: every gradient (of padded rows too) equals the masked model's
  grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
  want_grads = torch.autograd.grad((want * weight).sum(), (q, k, v))
  for got, expected in zip(grads, want_grads):
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
  assert grads[1].transpose(1, 2)[~real].abs().max() == 0  # padded keys get exactly no gradient


def test_segment_attention_refuses_what_it_cannot_do():
  q = torch.randn(1, 2, 8, 4)
  segments = padding_segments(torch.ones(1, 8), 4)
  with pytest.raises(ValueError, match="no `segments`"):
    segment_attention(_Layer(False), q, q, q, None)
  with pytest.raises(ValueError, match="dropout"):
    segment_attention(_Layer(False), q, q, q, None, dropout=0.1, segments=segments)
  with pytest.raises(ValueError, match="attention over 16"):
    segment_attention(_Layer(False), torch.randn(1, 2, 16, 4), torch.randn(1, 2, 16, 4),
                      torch.randn(1, 2, 16, 4), None, segments=segments)
  tokens = torch.randn(8, 2, 4)
  with pytest.raises(ValueError, match="CUDA"):
    flash_segment_attention(tokens, tokens, tokens, segments, causal=False)
  with pytest.raises(ValueError, match="impl"):
    varlen_segment_attention(tokens, tokens, tokens, segments, causal=False, impl="sdpa")


def test_flash_path_calls_the_aten_ops_as_their_schemas_say():
  """On meta tensors the aten flash ops run their shape functions: the forward and backward
  calls' argument order, and GQA's key/value heads, type-check without a GPU."""
  from benchmarks.torch_attention import _FlashVarlen

  batch, seq_len, heads, kv_heads, dim = 2, 256, 6, 2, 64
  q, k, v = (torch.empty(batch * seq_len, h, dim, device="meta", dtype=torch.bfloat16,
                         requires_grad=True) for h in (heads, kv_heads, kv_heads))
  segments = padding_segments(torch.ones(batch, seq_len, dtype=torch.long, device="meta"))
  out = _FlashVarlen.apply(q, k, v, segments.cu_seqlens, seq_len, True, None)
  assert out.shape == q.shape and out.dtype == q.dtype
  out.backward(torch.empty_like(out))
  assert (q.grad.shape, k.grad.shape, v.grad.shape) == (q.shape, k.shape, v.shape)


def _tiny_models(name, block):
  """The benchmark's tiny torch model in float32 (padding-aware attention, tail blocks of
  ``block``) and a copy of its Hugging Face model with SDPA, called with the mask."""
  pytest.importorskip("transformers")
  from benchmarks import bert, llama

  module = {"bert": bert, "llama": llama}[name]
  torch.manual_seed(0)
  wrapped = module.build(True).torch_model("cpu").float()
  assert isinstance(wrapped, RightPaddedModel)
  assert wrapped.model.config._attn_implementation == ATTN_IMPLEMENTATION
  wrapped.block = block
  reference = copy.deepcopy(wrapped.model)
  reference.set_attn_implementation("sdpa")
  return module, wrapped, reference


@pytest.mark.parametrize("name, lengths, seq_len, vocab", [
  ("bert", [10, 64, 1, 33], 64, 1500),  # BERT's row 0 ([CLS]) is real: L >= 1
  ("llama", [40, 128, 1, 0], 128, 512),
])
@pytest.mark.parametrize("block", [16, 128])
def test_tiny_models_have_the_masked_models_loss_and_gradients(name, lengths, seq_len, vocab,
                                                                block):
  module, wrapped, reference = _tiny_models(name, block)
  batch = {k: torch.from_numpy(v).long() for k, v in module.make_batch(
    np.array(lengths), seq_len, np.random.default_rng(0), vocab).items()}
  assert batch["attention_mask"].float().mean() < 1  # the batch does pad
  loss = wrapped(**batch).loss
  masked_loss = reference(**batch).loss
  torch.testing.assert_close(loss, masked_loss, rtol=1e-6, atol=0)
  names = [n for n, _ in wrapped.model.named_parameters()]
  grads = torch.autograd.grad(loss, list(wrapped.model.parameters()))
  masked_grads = torch.autograd.grad(masked_loss, list(reference.parameters()))
  for param, got, want in zip(names, grads, masked_grads):
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-10 + 1e-5 * float(want.abs().max()),
                               msg=lambda m, p=param: f"{p}: {m}")


def test_right_padded_model_needs_the_attention_implementation():
  transformers = pytest.importorskip("transformers")
  config = transformers.BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                   intermediate_size=16, vocab_size=30, attn_implementation="sdpa")
  with pytest.raises(ValueError, match=ATTN_IMPLEMENTATION):
    RightPaddedModel(transformers.BertForSequenceClassification(config))


# ----------------------------------------------------------------------------- CUDA

def _random_case(batch, seq_len, heads, kv_heads, dim, lengths, dtype=torch.bfloat16):
  torch.manual_seed(1)
  shape = (batch * seq_len, heads, dim)
  q = torch.randn(shape, device="cuda", dtype=dtype)
  k = torch.randn(batch * seq_len, kv_heads, dim, device="cuda", dtype=dtype)
  v = torch.randn(batch * seq_len, kv_heads, dim, device="cuda", dtype=dtype)
  grad = torch.randn(shape, device="cuda", dtype=dtype)
  return q, k, v, grad, _mask(lengths, seq_len).cuda()


def _flash_and_reference(q, k, v, grad, segments, causal):
  results = []
  for impl, cast in (("flash", lambda x: x), ("reference", lambda x: x.float())):
    inputs = [cast(x).detach().requires_grad_() for x in (q, k, v)]
    out = varlen_segment_attention(*inputs, segments, causal=causal, impl=impl)
    out.backward(cast(grad))
    results.append([out.float(), *(x.grad.float() for x in inputs)])
  return results


@pytest.mark.gpu
@pytest.mark.parametrize("causal, heads, kv_heads, dim, seq_len, lengths", [
  (False, 12, 12, 64, 512, [512, 17, 1, 200, 128, 300]),  # BERT-base's attention
  (True, 24, 8, 128, 1024, [1024, 100, 0, 700]),  # LLaMA-3.2-3B's (GQA), a shorter context
])
def test_flash_path_matches_the_reference_on_cuda(causal, heads, kv_heads, dim, seq_len, lengths):
  q, k, v, grad, mask = _random_case(len(lengths), seq_len, heads, kv_heads, dim, lengths)
  segments = padding_segments(mask)
  flash, reference = _flash_and_reference(q, k, v, grad, segments, causal)
  for name, got, want in zip(("out", "dq", "dk", "dv"), flash, reference):
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()),
                               msg=lambda m, n=name: f"{n}: {m}")
  # the zero output gradient of padded rows stays exactly zero through the flash backward
  grad = grad * mask.reshape(-1)[:, None, None]
  flash, _ = _flash_and_reference(q, k, v, grad, segments, causal)
  padded = ~mask.reshape(-1).bool()
  assert all(float(g[padded].abs().max()) == 0 for g in flash[1:])


@pytest.mark.gpu
def test_flash_path_replays_in_a_cuda_graph_with_new_lengths():
  seq_len, heads, dim = 256, 4, 64
  q, k, v, grad, mask = _random_case(3, seq_len, heads, heads, dim, [256, 30, 129])
  static_mask = mask.clone()
  inputs = [x.detach().clone().requires_grad_() for x in (q, k, v)]

  def step():
    for x in inputs:
      x.grad = None
    out = varlen_segment_attention(*inputs, padding_segments(static_mask), causal=True)
    out.backward(grad)
    return out

  stream = torch.cuda.Stream()
  stream.wait_stream(torch.cuda.current_stream())
  with torch.cuda.stream(stream):
    step()
  torch.cuda.current_stream().wait_stream(stream)
  graph = torch.cuda.CUDAGraph()
  for x in inputs:
    x.grad = None
  with torch.cuda.graph(graph):
    out = varlen_segment_attention(*inputs, padding_segments(static_mask), causal=True)
    out.backward(grad)
  for lengths in ([5, 256, 0], [128, 1, 255]):
    static_mask.copy_(_mask(lengths, seq_len))
    graph.replay()
    want, *want_grads = _flash_and_reference(q, k, v, grad, padding_segments(static_mask),
                                             True)[0]
    torch.testing.assert_close(out.float(), want, rtol=0, atol=0)  # the forward is deterministic
    for x, g in zip(inputs, want_grads):  # the backward's dq accumulates in any order
      torch.testing.assert_close(x.grad.float(), g, rtol=1e-2, atol=1e-2 * float(g.abs().max()))


@pytest.mark.gpu
@pytest.mark.parametrize("name, lengths, seq_len, vocab", [
  ("bert", [10, 64, 1, 33], 64, 1500), ("llama", [40, 128, 1, 0], 128, 512)])
def test_tiny_models_on_cuda_keep_padded_rows_gradient_zero(name, lengths, seq_len, vocab):
  """The bfloat16 tiny models on the flash path: the loss is the reference path's, and every
  linear layer's output gradient is exactly zero on padded rows (what SEBP relies on)."""
  pytest.importorskip("transformers")
  from benchmarks import bert, llama

  module = {"bert": bert, "llama": llama}[name]
  torch.manual_seed(0)
  wrapped = module.build(True).torch_model("cuda")
  wrapped.block = 16
  batch = {k: torch.from_numpy(v).long().cuda() for k, v in module.make_batch(
    np.array(lengths), seq_len, np.random.default_rng(0), vocab).items()}
  padded = ~batch["attention_mask"].bool()
  output_grads = []
  for layer in wrapped.model.modules():
    if isinstance(layer, torch.nn.Linear) and layer.out_features != vocab:
      layer.register_full_backward_hook(lambda m, gi, go: output_grads.append(go[0]))
  loss = wrapped(**batch).loss
  loss.backward()
  assert output_grads
  for dy in output_grads:
    if dy.shape[:2] == padded.shape:  # token rows (not the pooler's / classifier's)
      assert float(dy[padded].abs().max()) == 0
  cpu = module.build(True).torch_model("cpu")
  cpu.load_state_dict({k: v.cpu() for k, v in wrapped.state_dict().items()})
  cpu.block = 16
  cpu_loss = cpu.float()(**{k: v.cpu() for k, v in batch.items()}).loss
  torch.testing.assert_close(loss.float().cpu(), cpu_loss, rtol=5e-2, atol=5e-2)
