"""The flax BERT and LLaMA models against Hugging Face torch, on tiny random configs.

Weights come from HF models built here (no downloads) and move over through
``sebp_jax.models.hf_import``; outputs are compared on real-token positions only (HF leaves the
values at padded positions unspecified), with left and right padding. Weights are drawn with a
large ``initializer_range`` so attention is sharp: with HF's 0.02 every attention row is nearly
uniform, and masks and rotary angles would hardly show in the outputs.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from parity_tests.tolerances import assert_close
from sebp_jax.models import attention
from sebp_jax.models import bert as bert_module
from sebp_jax.models.bert import BertConfig, BertForSequenceClassification, BertModel
from sebp_jax.models.hf_import import build_module, from_hf, from_pretrained
from sebp_jax.models.llama import (LlamaConfig, LlamaForCausalLM, RopeScaling, causal_lm_loss,
                                   rope_inverse_frequencies, stack_layers, unstack_layers)

transformers = pytest.importorskip("transformers")

VOCAB = 101
OUTPUT_RTOL = 1e-4  # the bound: |diff| <= 1e-4 * max |reference| on real tokens
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16)


def hf_bert_config(**overrides):
  # head_dim 9 and FFN 37: odd sizes on purpose.
  return transformers.BertConfig(**{
    **dict(vocab_size=VOCAB, hidden_size=36, num_hidden_layers=2, num_attention_heads=4,
           intermediate_size=37, max_position_embeddings=40, initializer_range=0.3,
           num_labels=3, layer_norm_eps=1e-7), **overrides})


def hf_llama_config(**overrides):
  return transformers.LlamaConfig(**{
    **dict(vocab_size=VOCAB, hidden_size=60, intermediate_size=44, num_hidden_layers=2,
           num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
           initializer_range=0.3, rms_norm_eps=1e-5, rope_theta=1000.0), **overrides})


def padded_batch(seed: int, lengths=(13, 6, 1, 9), length: int = 13, left: bool = False):
  """Random ids ``(B, T)`` and a mask of the given real lengths, padded on one side."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(1, VOCAB, (len(lengths), length))
  positions = np.arange(length)[None]
  real = np.asarray(lengths)[:, None]
  mask = (positions >= length - real) if left else (positions < real)
  return ids.astype(np.int32), mask.astype(np.int32)


def torch_forward(model, ids, mask):
  with torch.no_grad():
    return model(input_ids=torch.from_numpy(ids).long(),
                 attention_mask=torch.from_numpy(mask).long())[0].float().numpy()


def assert_matches_hf(out, ref, mask, what):
  """``out`` within ``OUTPUT_RTOL`` of the reference's scale, on real tokens of 3-D outputs."""
  out = np.asarray(out, np.float32)
  if ref.ndim == 3:
    out, ref = out[mask == 1], ref[mask == 1]
  assert_close(out, ref, rtol=0.0, atol=OUTPUT_RTOL * np.abs(ref).max(), what=what)


@pytest.mark.parametrize("left", [False, True], ids=["right_pad", "left_pad"])
@pytest.mark.parametrize("model_cls", ["BertModel", "BertForSequenceClassification"])
def test_bert_matches_hf(model_cls, left):
  torch.manual_seed(0)
  hf = getattr(transformers, model_cls)(hf_bert_config()).eval()
  module, params = from_hf(hf)
  ids, mask = padded_batch(1, left=left)
  assert_matches_hf(module.apply(params, ids, mask), torch_forward(hf, ids, mask), mask,
                    f"{model_cls} output")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bert_gelu_matches_torch_gelu_and_its_gradient(dtype):
  """BERT's "gelu" (the erf form in float32) against HF's own ``torch.nn.functional.gelu`` and its
  autograd at odd values (±0, tiny, large of both signs, NaN), and at ±inf against the ``erfc``
  form it replaced (``nn.gelu(approximate=False)``), where torch's CPU kernel gives NaN for +inf."""
  rng = np.random.default_rng(0)
  special = [0.0, -0.0, 1e-30, -1e-30, 5.5, -5.5, 40.0, -40.0, 1e30, -1e30, np.nan]
  x32 = np.concatenate([special, 3 * rng.standard_normal(500), [np.inf, -np.inf]])
  x32 = x32.astype(np.float32)
  dy32 = rng.standard_normal(x32.shape).astype(np.float32)
  x, dy = jnp.asarray(x32, dtype), jnp.asarray(dy32, dtype)
  y, dx = _value_and_vjp(bert_module._ACTIVATIONS["gelu"], x, dy)
  assert y.dtype == dx.dtype == jnp.dtype(dtype)
  tx = torch.tensor(np.asarray(x, np.float32)).to(getattr(torch, dtype)).requires_grad_()
  ty = torch.nn.functional.gelu(tx)
  ty.backward(torch.tensor(np.asarray(dy, np.float32)).to(getattr(torch, dtype)))
  finite_or_nan = ~np.isinf(x32)
  assert_close(y[finite_or_nan], ty.detach().float().numpy()[finite_or_nan], dtype,
               what=f"gelu({dtype})")
  assert_close(dx[finite_or_nan], tx.grad.float().numpy()[finite_or_nan], dtype,
               what=f"d gelu({dtype})")
  y_erfc, dx_erfc = _value_and_vjp(lambda v: jax.nn.gelu(v, approximate=False), x, dy)
  assert_close(y[~finite_or_nan], y_erfc[~finite_or_nan], dtype, what=f"gelu({dtype}) at ±inf")
  assert_close(dx[~finite_or_nan], dx_erfc[~finite_or_nan], dtype, what=f"d gelu({dtype}) at ±inf")


def _value_and_vjp(f, x, dy):
  y, vjp = jax.vjp(f, x)
  return y, vjp(dy)[0]


def test_bert_token_types_and_no_mask():
  torch.manual_seed(1)
  hf = transformers.BertModel(hf_bert_config()).eval()
  module, params = from_hf(hf)
  ids, _ = padded_batch(2)
  types = (np.arange(ids.shape[1])[None] >= 5).astype(np.int32).repeat(len(ids), 0)
  with torch.no_grad():
    ref = hf(input_ids=torch.from_numpy(ids).long(),
             token_type_ids=torch.from_numpy(types).long())[0].numpy()
  out = module.apply(params, ids, None, types)
  assert_matches_hf(out, ref, np.ones_like(ids), "BertModel with token types")


@pytest.mark.parametrize("left", [False, True], ids=["right_pad", "left_pad"])
@pytest.mark.parametrize("rope", [None, LLAMA3], ids=["rope_default", "rope_llama3"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama_matches_hf(tied, rope, left):
  torch.manual_seed(2)
  # 40 positions reach past original_max_position_embeddings=16: all three llama3 bands act.
  hf = transformers.LlamaForCausalLM(
    hf_llama_config(tie_word_embeddings=tied, rope_scaling=rope)).eval()
  module, params = from_hf(hf)
  assert ("lm_head" in params["params"]) == (not tied)
  ids, mask = padded_batch(3, lengths=(40, 17, 3), length=40, left=left)
  out = jax.jit(module.apply)(params, ids, mask)
  assert_matches_hf(out, torch_forward(hf, ids, mask), mask, "LlamaForCausalLM logits")


def test_llama_multi_head_attention_with_bias():
  torch.manual_seed(3)
  hf = transformers.LlamaForCausalLM(
    hf_llama_config(num_key_value_heads=6, attention_bias=True, mlp_bias=True)).eval()
  module, params = from_hf(hf)
  ids, mask = padded_batch(4)
  assert_matches_hf(module.apply(params, ids, mask), torch_forward(hf, ids, mask), mask,
                    "LlamaForCausalLM logits (MHA, biases)")


def test_llama_scanned_layers_match_hf_and_stacked_parameters():
  """``scan_layers=True`` with HF weights stacked: HF's logits; the same gradients as the
  unrolled model's, stacked; a row plan inside the scan gives them too."""
  from sebp_jax import RowPolicy, row_plan, swap_dense

  torch.manual_seed(5)
  hf = transformers.LlamaForCausalLM(hf_llama_config(tie_word_embeddings=True)).eval()
  module, params = from_hf(hf)
  layers = module.config.num_hidden_layers
  scanned, stacked = from_hf(hf, scan_layers=True)  # imported, then stacked
  assert scanned.config.scan_layers
  assert stacked["params"]["model"]["layers"]["mlp"]["up_proj"]["kernel"].shape[0] == layers
  jax.tree.map(np.testing.assert_array_equal, stacked, stack_layers(params, layers))
  jax.tree.map(np.testing.assert_array_equal, unstack_layers(stacked), params)
  ids, mask = padded_batch(5, lengths=(11, 4, 2), length=16)
  assert_matches_hf(jax.jit(scanned.apply)(stacked, ids, mask), torch_forward(hf, ids, mask),
                    mask, "LlamaForCausalLM logits, scanned layers")

  labels = jnp.where(mask == 1, ids, -100)
  loss = lambda m: lambda p: causal_lm_loss(m.apply(p, ids, mask), labels)  # noqa: E731
  want = stack_layers(jax.jit(jax.grad(loss(module)))(params), layers)

  def planned(p):
    with swap_dense(RowPolicy(), crossover=1.0, rows=row_plan(mask, check=True)):
      return loss(scanned)(p)

  for got in (jax.jit(jax.grad(loss(scanned)))(stacked), jax.jit(jax.grad(planned))(stacked)):
    jax.tree.map(lambda g, w: assert_close(g, w, jnp.float32, what="scanned gradient"), got, want)


def test_stack_layers_rejects_a_wrong_layer_count():
  params = {"params": {"model": {f"layers_{i}": {"w": jnp.ones(2)} for i in range(3)}}}
  with pytest.raises(ValueError, match="`num_layers` is 4, but the parameters hold 3"):
    stack_layers(params, 4)
  with pytest.raises(ValueError, match="no 'model' entry"):
    stack_layers({"params": {"encoder": {}}}, 3)


def test_rope_scaling_changes_the_output():
  """The llama3 comparison above has teeth: the scaling visibly changes the logits."""
  torch.manual_seed(4)
  hf = transformers.LlamaForCausalLM(hf_llama_config(rope_scaling=LLAMA3)).eval()
  module, params = from_hf(hf)
  plain = LlamaForCausalLM(dataclasses.replace(module.config, rope_scaling=None))
  ids, mask = padded_batch(5, lengths=(40,), length=40)
  diff = np.abs(np.asarray(module.apply(params, ids, mask) - plain.apply(params, ids, mask)))
  assert diff.max() > 100 * OUTPUT_RTOL * np.abs(np.asarray(module.apply(params, ids))).max()


@pytest.mark.parametrize("rope", [None, LLAMA3,
                                  dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                       high_freq_factor=4.0,
                                       original_max_position_embeddings=8192)])
def test_rope_inverse_frequencies_match_hf(rope):
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

  hf_config = hf_llama_config(rope_scaling=rope, head_dim=128, rope_theta=500000.0)
  config = LlamaConfig.from_hf_dict(hf_config.to_dict())
  if rope is None:
    expected = 1.0 / (500000.0 ** (torch.arange(0, 128, 2).float() / 128))
  else:
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
  np.testing.assert_allclose(rope_inverse_frequencies(config), expected.numpy(), rtol=1e-6)


def test_causal_lm_loss_matches_torch_cross_entropy():
  rng = np.random.default_rng(6)
  logits = rng.normal(size=(3, 11, 17)).astype(np.float32) * 3
  labels = rng.integers(0, 17, (3, 11))
  labels[0, 7:] = -100
  labels[1, :4] = -100
  labels[2, ::3] = -100
  expected = torch.nn.functional.cross_entropy(
    torch.from_numpy(logits[:, :-1]).reshape(-1, 17), torch.from_numpy(labels[:, 1:]).reshape(-1),
    ignore_index=-100)
  got = causal_lm_loss(jnp.asarray(logits), jnp.asarray(labels))
  assert got.dtype == jnp.float32
  assert_close(got, expected, what="causal_lm_loss")
  # Changing a logit whose label is ignored changes nothing.
  logits[1, 2] += 100.0
  assert_close(causal_lm_loss(jnp.asarray(logits), jnp.asarray(labels)), expected,
               what="loss with an ignored position perturbed")


def test_causal_lm_loss_matches_hf_loss():
  torch.manual_seed(7)
  hf = transformers.LlamaForCausalLM(hf_llama_config()).eval()
  module, params = from_hf(hf)
  ids, mask = padded_batch(8)
  labels = np.where(mask == 1, ids, -100)
  with torch.no_grad():
    expected = hf(input_ids=torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask),
                  labels=torch.from_numpy(labels).long()).loss
  got = causal_lm_loss(module.apply(params, ids, mask), jnp.asarray(labels))
  assert_close(got, expected, rtol=1e-5, what="loss of LlamaForCausalLM")


def test_causal_lm_loss_rejects_bad_input():
  with pytest.raises(ValueError, match="labels"):
    causal_lm_loss(jnp.zeros((2, 5, 7)), jnp.zeros((2, 4), jnp.int32))
  with pytest.raises(TypeError, match="labels"):
    causal_lm_loss(jnp.zeros((2, 5, 7)), jnp.zeros((2, 5)))


def test_dropout_is_active_only_when_not_deterministic():
  config = BertConfig.from_hf_dict(hf_bert_config().to_dict())
  model = BertForSequenceClassification(config)
  ids, mask = padded_batch(9)
  params = model.init(jax.random.key(0), ids, mask)
  apply = jax.jit(model.apply, static_argnames="deterministic")
  det = apply(params, ids, mask)
  assert_close(apply(params, ids, mask), det, what="deterministic forward")
  a = apply(params, ids, mask, deterministic=False, rngs={"dropout": jax.random.key(1)})
  b = apply(params, ids, mask, deterministic=False, rngs={"dropout": jax.random.key(2)})
  assert not np.allclose(a, det) and not np.allclose(a, b)
  with pytest.raises(Exception, match="dropout"):  # training without a dropout stream
    model.apply(params, ids, mask, deterministic=False)


def test_bf16_params():
  torch.manual_seed(10)
  hf = transformers.LlamaForCausalLM(hf_llama_config(initializer_range=0.05)).eval()
  module, params = from_hf(hf, param_dtype=jnp.bfloat16)
  assert {p.dtype for p in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
  ids, mask = padded_batch(11)
  out = module.apply(params, ids, mask)
  assert out.dtype == jnp.bfloat16
  ref = torch_forward(hf.to(torch.bfloat16), ids, mask)
  sel = mask == 1
  assert_close(np.asarray(out, np.float32)[sel], ref[sel], rtol=0.0,
               atol=0.05 * np.abs(ref).max(), what="bf16 logits")


def test_exact_named_configs():
  assert BertConfig.bert_base() == BertConfig.from_hf_dict(transformers.BertConfig().to_dict())
  llama = LlamaConfig.llama_3_2_3b()
  assert (llama.hidden_size, llama.num_hidden_layers, llama.num_attention_heads,
          llama.num_key_value_heads, llama.intermediate_size, llama.vocab_size, llama.head_dim,
          llama.rope_theta, llama.rms_norm_eps, llama.tie_word_embeddings,
          llama.max_position_embeddings) == (3072, 28, 24, 8, 8192, 128256, 128, 500000.0, 1e-5,
                                             True, 131072)
  assert llama.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)
  # Its config.json as shipped (transformers 4 layout) reads to the same config.
  shipped = dict(
    architectures=["LlamaForCausalLM"], hidden_size=3072, intermediate_size=8192,
    num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, head_dim=128,
    vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling=dict(factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0,
                      original_max_position_embeddings=8192, rope_type="llama3"),
    tie_word_embeddings=True, hidden_act="silu", attention_bias=False, mlp_bias=False)
  assert LlamaConfig.from_hf_dict(shipped) == llama
  shapes = jax.eval_shape(lambda: LlamaForCausalLM(LlamaConfig.llama_3_2_3b()).init(
    jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))
  assert sum(np.prod(x.shape) for x in jax.tree.leaves(shapes)) == 3_212_749_824


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_from_pretrained_folder(tmp_path, fmt):
  torch.manual_seed(12)
  hf = transformers.BertForSequenceClassification(hf_bert_config()).eval()
  hf.save_pretrained(tmp_path)
  if fmt == "bin":
    (tmp_path / "model.safetensors").unlink()
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
  module, params = from_pretrained(tmp_path)
  assert isinstance(module, BertForSequenceClassification)
  ids, mask = padded_batch(13)
  assert_matches_hf(module.apply(params, ids, mask), torch_forward(hf, ids, mask), mask,
                    f"logits from {fmt}")
  # The encoder of a classification checkpoint, read as a bare BertModel.
  encoder, encoder_params = from_pretrained(tmp_path, architecture="BertModel")
  assert isinstance(encoder, BertModel)
  assert_matches_hf(encoder.apply(encoder_params, ids, mask),
                    torch_forward(hf.bert, ids, mask), mask, "BertModel from a head checkpoint")


def test_from_pretrained_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    from_pretrained(tmp_path / "nowhere")
  with pytest.raises(FileNotFoundError, match="config.json"):
    from_pretrained(tmp_path)
  config = hf_bert_config(architectures=["BertForMaskedLM"])
  (tmp_path / "config.json").write_text(config.to_json_string())
  with pytest.raises(ValueError, match="Unsupported architecture 'BertForMaskedLM'"):
    from_pretrained(tmp_path)
  with pytest.raises(FileNotFoundError, match="model.safetensors"):
    from_pretrained(tmp_path, architecture="BertModel")
  with pytest.raises(FileNotFoundError, match="GGUF"):
    from_pretrained(tmp_path / "missing.gguf")
  with pytest.raises(ValueError, match="architectures"):
    build_module({"hidden_size": 8})


def test_mismatched_checkpoint_fails_loudly(tmp_path):
  hf = transformers.BertModel(hf_bert_config()).eval()
  hf.save_pretrained(tmp_path)
  config = json.loads((tmp_path / "config.json").read_text())
  (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 38}))
  with pytest.raises(ValueError, match="intermediate.dense.*expects"):
    from_pretrained(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
  with pytest.raises(ValueError, match="encoder/layer_2"):
    from_pretrained(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
  with pytest.raises(ValueError, match="encoder.layer.1"):
    from_pretrained(tmp_path)


def test_config_validation():
  with pytest.raises(ValueError, match="num_key_value_heads"):
    LlamaConfig.from_hf_dict(hf_llama_config(num_key_value_heads=4).to_dict())
  with pytest.raises(ValueError, match="rope type 'yarn'"):
    LlamaConfig.from_hf_dict(hf_llama_config(
      rope_scaling=dict(rope_type="yarn", factor=2.0)).to_dict())
  with pytest.raises(ValueError, match="attention_impl"):
    BertConfig(attention_impl="flash")
  with pytest.raises(ValueError, match="position_embedding_type"):
    BertConfig.from_hf_dict({"position_embedding_type": "relative_key"})
  with pytest.raises(ValueError, match="hidden_act"):
    BertConfig(hidden_act="swish")


def test_attention_impl_resolution():
  kw = dict(head_dim=64, right_padded=True, uses_dropout=False)
  # Off GPU, or in float32, or with left padding, "auto" takes the masked XLA path.
  assert attention.resolve_attention_impl("auto", dtype=jnp.float32, **kw) == "xla"
  assert attention.resolve_attention_impl(
    "auto", dtype=jnp.bfloat16, **{**kw, "right_padded": False}) == "xla"
  assert attention.resolve_attention_impl(
    "auto", dtype=jnp.bfloat16, **kw) == ("cudnn" if jax.default_backend() == "gpu" else "xla")
  assert attention.resolve_attention_impl(
    "auto", dtype=jnp.bfloat16, **{**kw, "uses_dropout": True}) == "softmax"
  with pytest.raises(ValueError, match="bfloat16 or float16"):
    attention.resolve_attention_impl("cudnn", dtype=jnp.float32, **kw)
  with pytest.raises(ValueError, match="right_padded"):
    attention.resolve_attention_impl(
      "cudnn", dtype=jnp.bfloat16, **{**kw, "right_padded": False})
  with pytest.raises(ValueError, match="multiple of 8"):
    attention.resolve_attention_impl("cudnn", dtype=jnp.bfloat16, **{**kw, "head_dim": 36})
  with pytest.raises(ValueError, match="dropout"):
    attention.resolve_attention_impl("cudnn", dtype=jnp.bfloat16,
                                     **{**kw, "uses_dropout": True})


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_cudnn_attention_matches_xla(arch):
  """On GPU, bf16: the cuDNN path (sequence lengths) is as close to a float32 reference as the
  masked XLA path in bf16 is, on real tokens. A cuDNN path that mishandled padding would be off
  by O(1)."""
  if arch == "bert":
    config = BertConfig.from_hf_dict(
      hf_bert_config(hidden_size=128, num_attention_heads=2).to_dict())
    model_cls = BertModel
  else:
    config = LlamaConfig.from_hf_dict(
      hf_llama_config(hidden_size=192, initializer_range=0.1).to_dict())
    model_cls = LlamaForCausalLM
  xla_config = dataclasses.replace(config, attention_impl="xla")
  ids, mask = padded_batch(14, lengths=(32, 7, 1, 20), length=32)
  params = model_cls(config, param_dtype=jnp.bfloat16).init(jax.random.key(0), ids, mask)
  params32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
  sel = mask == 1
  with jax.default_matmul_precision("highest"):  # no TF32 in the reference
    ref = np.asarray(model_cls(xla_config).apply(params32, ids, mask))[sel]
  head_dim = config.hidden_size // config.num_attention_heads
  assert attention.resolve_attention_impl(
    "auto", dtype=jnp.bfloat16, head_dim=head_dim, right_padded=True, uses_dropout=False) == "cudnn"

  def rel_rms(model):
    out = np.asarray(model.apply(params, ids, mask, right_padded=True), np.float32)[sel]
    return float(np.sqrt(np.mean((out - ref) ** 2) / np.mean(ref ** 2)))

  cudnn_err, xla_err = rel_rms(model_cls(config)), rel_rms(model_cls(xla_config))
  assert xla_err < 0.1, (cudnn_err, xla_err)
  assert cudnn_err <= 1.5 * xla_err + 1e-3, (cudnn_err, xla_err)


@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_input_ids_must_be_batch_by_length(arch):
  hf = (transformers.BertModel(hf_bert_config()) if arch == "bert"
        else transformers.LlamaForCausalLM(hf_llama_config()))
  module, params = from_hf(hf)
  with pytest.raises(ValueError, match="`input_ids`"):
    module.apply(params, jnp.ones((7,), jnp.int32))
