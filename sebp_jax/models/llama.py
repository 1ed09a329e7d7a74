"""LLaMA decoder (``LlamaForCausalLM``) in flax.linen, and the causal-LM loss.

RMSNorm, rotary position embeddings (plain or with Llama-3's ``llama3`` frequency scaling),
grouped-query attention, SwiGLU MLP, tied or untied output embeddings. The module tree mirrors
Hugging Face's ``transformers.LlamaForCausalLM`` name for name::

  model.layers.5.self_attn.k_proj.weight -> model/layers_5/self_attn/k_proj/kernel  (.T)

Every linear layer is a plain ``nn.Dense``, so :func:`sebp_jax.swap_dense` reaches them. With
tied embeddings the output projection is the embedding matrix itself
(``model/embed_tokens``, through ``nn.Embed.attend``), not a Dense. ``projections="einsum"`` builds
the same model from Gemma-style ``nn.Einsum`` layers instead: per-head kernels
``(hidden, heads, head_dim)`` for ``q/k/v_proj`` and ``(heads, head_dim, hidden)`` for ``o_proj``
(the Dense kernels reshaped, same values), ``...D,DF->...F`` for the MLP.

``scan_layers=True`` runs the decoder layers as one ``nn.scan`` over stacked parameters
(``model/layers/self_attn/k_proj/kernel`` of shape ``(num_hidden_layers, ...)``): one layer's
program in a loop, which is what lets XLA:GPU's collective pipeliner fetch layer ``i + 1``'s
FSDP-sharded weights while layer ``i`` computes (``--xla_gpu_enable_pipelined_all_gather``,
``..._reduce_scatter``: flags for while loops, idle in the unrolled model).
:func:`stack_layers` / :func:`unstack_layers` convert parameters between the two layouts (HF
weights import into the unrolled one).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from sebp_jax.linen import dense_siblings
from sebp_jax.models.attention import ATTENTION_IMPLS, attend
from sebp_jax.models.cross_entropy import token_cross_entropy
from sebp_jax.models.embedding import Embed
from sebp_jax.models.inputs import token_inputs
from sebp_jax.models.rms_norm import RMSNorm

__all__ = ["PROJECTIONS", "RopeScaling", "LlamaConfig", "LlamaModel", "LlamaForCausalLM",
           "causal_lm_loss", "rope_inverse_frequencies", "stack_layers", "unstack_layers",
           "IGNORE_INDEX"]

IGNORE_INDEX = -100  # HF's label for positions without loss
PROJECTIONS = ("dense", "einsum")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3's ``llama3`` RoPE scaling (HF ``rope_scaling`` with ``rope_type="llama3"``)."""

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int

  def __post_init__(self):
    if not self.high_freq_factor > self.low_freq_factor > 0 or not self.factor > 0:
      raise ValueError(
        "llama3 rope scaling needs factor > 0 and high_freq_factor > low_freq_factor > 0, got "
        f"{self}.")

  @classmethod
  def from_hf_dict(cls, rope: Mapping[str, Any] | None) -> RopeScaling | None:
    """Reads HF's ``rope_scaling`` (transformers 4) or ``rope_parameters`` (5) dict."""
    if rope is None:
      return None
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
      return None
    if rope_type != "llama3":
      raise ValueError(
        f"Unsupported rope type {rope_type!r}: supported are 'default' and 'llama3'.")
    return cls(**{f.name: rope[f.name] for f in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """LLaMA hyper-parameters, named as in HF ``config.json`` (defaults are HF's).

  ``attention_impl`` is this project's own: ``"auto"``, ``"xla"`` or ``"cudnn"`` (see
  :mod:`sebp_jax.models.attention`); so is ``projections``: ``"dense"`` (``nn.Dense`` layers, HF's
  layout) or ``"einsum"`` (Gemma-style ``nn.Einsum`` layers, per-head attention kernels); and
  ``scan_layers``: the decoder layers as one ``nn.scan`` over stacked parameters (the module
  docstring says why).
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int | None = None  # None: multi-head attention (as many as query heads)
  head_dim: int | None = None  # None: hidden_size // num_attention_heads
  hidden_act: str = "silu"
  max_position_embeddings: int = 2048
  initializer_range: float = 0.02
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  tie_word_embeddings: bool = False
  attention_bias: bool = False
  mlp_bias: bool = False
  attention_dropout: float = 0.0
  attention_impl: str = "auto"
  projections: str = "dense"
  scan_layers: bool = False

  def __post_init__(self):
    if self.num_key_value_heads is None:
      object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
    if self.head_dim is None:
      if self.hidden_size % self.num_attention_heads:
        raise ValueError(
          f"`hidden_size` ({self.hidden_size}) must be a multiple of `num_attention_heads` "
          f"({self.num_attention_heads}) unless `head_dim` is given.")
      object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(
        f"`num_attention_heads` ({self.num_attention_heads}) must be a multiple of "
        f"`num_key_value_heads` ({self.num_key_value_heads}).")
    if self.head_dim % 2:
      raise ValueError(f"`head_dim` must be even for rotary embeddings, got {self.head_dim}.")
    if self.hidden_act != "silu":
      raise ValueError(f"`hidden_act` must be 'silu' (SwiGLU), got {self.hidden_act!r}.")
    if self.projections not in PROJECTIONS:
      raise ValueError(
        f"`projections` must be one of {PROJECTIONS}, got {self.projections!r}.")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(
        f"`attention_impl` must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}.")

  @classmethod
  def from_hf_dict(cls, config: Mapping[str, Any], **overrides: Any) -> LlamaConfig:
    """Reads an HF ``config.json`` dict (transformers 4 or 5 layout); ``overrides`` win."""
    names = {f.name for f in dataclasses.fields(cls)} - {"rope_scaling", "rope_theta"}
    values = {name: config[name] for name in names if name in config}
    # transformers 5 moved rope_theta and the scaling into `rope_parameters`.
    rope = config.get("rope_parameters") or config.get("rope_scaling")
    theta = config.get("rope_theta", (rope or {}).get("rope_theta"))
    if theta is not None:
      values["rope_theta"] = theta
    values["rope_scaling"] = RopeScaling.from_hf_dict(rope)
    return cls(**{**values, **overrides})

  @classmethod
  def llama_3_2_3b(cls, **overrides: Any) -> LlamaConfig:
    """The exact configuration of Llama-3.2-3B, with ``overrides``."""
    values = dict(
      vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
      num_attention_heads=24, num_key_value_heads=8, head_dim=128,
      max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
      rope_scaling=RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=8192),
      tie_word_embeddings=True)
    return cls(**{**values, **overrides})


def rope_inverse_frequencies(config: LlamaConfig) -> np.ndarray:
  """RoPE inverse frequencies ``(head_dim // 2,)`` float32, computed in float32 as HF does."""
  dim = config.head_dim
  inv_freq = 1.0 / (np.float32(config.rope_theta)
                    ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
  scaling = config.rope_scaling
  if scaling is None:
    return inv_freq.astype(np.float32)
  # llama3: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between.
  old_len = scaling.original_max_position_embeddings
  low_freq_wavelen = old_len / scaling.low_freq_factor
  high_freq_wavelen = old_len / scaling.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
  smooth = ((old_len / wavelen - scaling.low_freq_factor)
            / (scaling.high_freq_factor - scaling.low_freq_factor))
  smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
  medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def _rotate_half(x):
  half = x.shape[-1] // 2
  return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


class _LlamaModule(nn.Module):
  """Shared attributes: the config, the computation dtype and the parameter dtype."""

  config: LlamaConfig
  dtype: Any = None  # None: computation follows the parameters' (and inputs') dtype
  param_dtype: Any = jnp.float32

  def dense(self, features: int, name: str | None = None, use_bias: bool = False) -> nn.Dense:
    return nn.Dense(
      features, use_bias=use_bias, dtype=self.dtype, param_dtype=self.param_dtype, name=name,
      kernel_init=nn.initializers.normal(self.config.initializer_range))

  def einsum(self, equation: str, shape: tuple[int, ...], name: str | None,
             use_bias: bool = False) -> nn.Einsum:
    return nn.Einsum(
      shape, equation, use_bias=use_bias, dtype=self.dtype, param_dtype=self.param_dtype,
      name=name, kernel_init=nn.initializers.normal(self.config.initializer_range))

  def projection(self, heads: int, name: str, use_bias: bool):
    """``x (..., hidden) -> (..., heads, head_dim)``: a Dense and a reshape, or an einsum."""
    cfg = self.config
    if cfg.projections == "einsum":
      return self.einsum("...D,DNH->...NH", (cfg.hidden_size, heads, cfg.head_dim), name,
                         use_bias)
    dense = self.dense(heads * cfg.head_dim, name, use_bias)
    return lambda x: dense(x).reshape(*x.shape[:-1], heads, cfg.head_dim)

  def linear(self, features: int, in_features: int, name: str | None, use_bias: bool = False):
    """``x (..., in_features) -> (..., features)``: a Dense or its einsum."""
    if self.config.projections == "einsum":
      return self.einsum("...D,DF->...F", (in_features, features), name, use_bias)
    return self.dense(features, name, use_bias)

  def rms_norm(self, name: str | None = None) -> RMSNorm:
    return RMSNorm(self.config.rms_norm_eps, self.dtype, self.param_dtype, name=name)


class LlamaAttention(_LlamaModule):

  @nn.compact
  def __call__(self, x, cos, sin, attention_mask, deterministic: bool, right_padded: bool):
    cfg = self.config
    lead = x.shape[:-1]
    bias = cfg.attention_bias
    heads = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_key_value_heads)
    names = ("q_proj", "k_proj", "v_proj")
    if cfg.projections == "einsum":
      q, k, v = (self.projection(n, name, bias)(x) for n, name in zip(heads, names))
    else:  # one SEBP backward for the three under swap_dense (dense_siblings)
      q, k, v = (y.reshape(*lead, n, cfg.head_dim) for y, n in zip(dense_siblings(
        [self.dense(n * cfg.head_dim, name, bias) for n, name in zip(heads, names)], x), heads))
    # cos/sin: (B, T, head_dim) -> broadcast over heads.
    cos, sin = cos[:, :, None, :].astype(q.dtype), sin[:, :, None, :].astype(q.dtype)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    rate = cfg.attention_dropout
    rng = None if deterministic or rate == 0.0 else self.make_rng("dropout")
    out = attend(
      q, k, v, attention_mask, causal=True, impl=cfg.attention_impl, right_padded=right_padded,
      dropout_rate=rate, deterministic=deterministic, dropout_rng=rng)
    if cfg.projections == "einsum":
      shape = (cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size)
      return self.einsum("...NH,NHD->...D", shape, "o_proj", bias)(out)
    return self.dense(cfg.hidden_size, "o_proj", bias)(out.reshape(*lead, -1))


class LlamaMLP(_LlamaModule):
  """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    hidden, inner, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
    gate, up = (self.linear(inner, hidden, name, bias) for name in ("gate_proj", "up_proj"))
    gate, up = (gate(x), up(x)) if cfg.projections == "einsum" else dense_siblings([gate, up], x)
    return self.linear(hidden, inner, "down_proj", bias)(nn.silu(gate) * up)


class LlamaDecoderLayer(_LlamaModule):

  @nn.compact
  def __call__(self, x, cos, sin, attention_mask, deterministic: bool, right_padded: bool):
    kw = dict(config=self.config, dtype=self.dtype, param_dtype=self.param_dtype)
    h = self.rms_norm("input_layernorm")(x)
    x = x + LlamaAttention(**kw, name="self_attn")(
      h, cos, sin, attention_mask, deterministic, right_padded)
    h = self.rms_norm("post_attention_layernorm")(x)
    return x + LlamaMLP(**kw, name="mlp")(h)


class _ScannedDecoderLayer(LlamaDecoderLayer):
  """:class:`LlamaDecoderLayer` as ``nn.scan``'s body: ``(carry, out) = (x, None)``."""

  def __call__(self, x, cos, sin, attention_mask, deterministic: bool, right_padded: bool):
    return super().__call__(x, cos, sin, attention_mask, deterministic, right_padded), None


class LlamaModel(_LlamaModule):
  """HF ``LlamaModel``: embeddings, decoder layers, final norm. Returns ``(B, T, hidden)``."""

  def setup(self):
    cfg = self.config
    kw = dict(config=cfg, dtype=self.dtype, param_dtype=self.param_dtype)
    self.embed_tokens = Embed(
      cfg.vocab_size, cfg.hidden_size, dtype=self.dtype, param_dtype=self.param_dtype,
      embedding_init=nn.initializers.normal(cfg.initializer_range))
    if cfg.scan_layers:
      # One decoder layer's program in a loop over stacked parameters (see `LlamaConfig`).
      self.layers = nn.scan(
        _ScannedDecoderLayer, variable_axes={"params": 0},
        split_rngs={"params": True, "dropout": True}, in_axes=nn.broadcast,
        length=cfg.num_hidden_layers)(**kw)
    else:
      self.layers = [LlamaDecoderLayer(**kw) for _ in range(cfg.num_hidden_layers)]
    self.norm = self.rms_norm()

  def __call__(self, input_ids, attention_mask=None, position_ids=None, *,
               deterministic: bool = True, right_padded: bool = False):
    input_ids, attention_mask, position_ids = token_inputs(input_ids, attention_mask,
                                                          position_ids)
    freqs = position_ids.astype(jnp.float32)[..., None] * rope_inverse_frequencies(self.config)
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x = self.embed_tokens(input_ids)
    if self.config.scan_layers:
      x, _ = self.layers(x, cos, sin, attention_mask, deterministic, right_padded)
    else:
      for layer in self.layers:
        x = layer(x, cos, sin, attention_mask, deterministic, right_padded)
    return self.norm(x)


class LlamaForCausalLM(_LlamaModule):
  """HF ``LlamaForCausalLM``: :class:`LlamaModel` and the output projection to the vocabulary.

  Attributes:
    config: :class:`LlamaConfig`.
    dtype: computation dtype (``None``: that of the parameters).
    param_dtype: parameter dtype at ``init``.
  """

  def setup(self):
    self.model = LlamaModel(self.config, self.dtype, self.param_dtype)
    if not self.config.tie_word_embeddings:
      self.lm_head = self.linear(self.config.vocab_size, self.config.hidden_size, None)

  def __call__(
    self,
    input_ids: jax.Array,
    attention_mask: jax.Array | None = None,
    position_ids: jax.Array | None = None,
    *,
    deterministic: bool = True,
    right_padded: bool = False,
  ) -> jax.Array:
    """Next-token logits.

    Args:
      input_ids: ``(B, T)`` token ids.
      attention_mask: ``(B, T)``, 1 on real tokens and 0 on padding (either side); ``None``: no
        padding. Attention is causal in any case.
      position_ids: ``(B, T)``; ``None``: ``0 .. T-1`` in every row (HF's default, whatever the
        padding side).
      deterministic: disables attention dropout (only used when ``attention_dropout > 0``).
      right_padded: promise that every ``attention_mask`` row is ones then zeros, which lets
        ``attention_impl="auto"`` use cuDNN with sequence lengths on GPU. Unchecked.

    Returns:
      ``(B, T, vocab_size)`` logits.
    """
    hidden = self.model(input_ids, attention_mask, position_ids, deterministic=deterministic,
                        right_padded=right_padded)
    if self.config.tie_word_embeddings:
      return self.model.embed_tokens.attend(hidden)
    return self.lm_head(hidden)


def _with_model(params: Mapping[str, Any], edit) -> dict:
  """``params`` (``{"params": {"model": ...}}`` or ``{"model": ...}``) with its ``model`` tree
  replaced by ``edit(model)``."""
  if "params" in params and "model" not in params:
    return {**params, "params": _with_model(params["params"], edit)}
  if "model" not in params:
    raise ValueError("`params` has no 'model' entry (a LlamaForCausalLM's parameters).")
  return {**params, "model": edit(dict(params["model"]))}


def stack_layers(params: Mapping[str, Any], num_layers: int) -> dict:
  """``params`` of the unrolled model (``.../model/layers_0 ... layers_{L-1}``, as
  :func:`sebp_jax.models.from_hf` imports them) in the ``scan_layers=True`` layout: one
  ``.../model/layers`` tree whose leaves stack the layers' along a new leading axis.

  Raises:
    ValueError: ``params`` has no ``model`` tree with exactly ``layers_0 .. layers_{L-1}``.
  """
  names = [f"layers_{i}" for i in range(num_layers)]

  def edit(model):
    found = sorted(name for name in model if name.startswith("layers_"))
    if found != sorted(names):
      raise ValueError(f"stack_layers: `num_layers` is {num_layers}, but the parameters hold "
                       f"{len(found)} 'layers_<i>' entries.")
    stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *[model.pop(n) for n in names])
    return {**model, "layers": stacked}

  return _with_model(params, edit)


def unstack_layers(params: Mapping[str, Any]) -> dict:
  """The inverse of :func:`stack_layers`: ``.../model/layers`` split into ``layers_<i>``."""

  def edit(model):
    stacked = model.pop("layers")
    count = jax.tree.leaves(stacked)[0].shape[0]
    return {**model, **{f"layers_{i}": jax.tree.map(lambda leaf, i=i: leaf[i], stacked)
                        for i in range(count)}}

  return _with_model(params, edit)


def causal_lm_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy, as HF's causal-LM loss computes it.

  Position ``t`` predicts ``labels[:, t + 1]``; labels equal to :data:`IGNORE_INDEX` (-100:
  padding, prompt) are ignored, and the mean runs over the remaining tokens, in float32.

  Args:
    logits: ``(B, T, V)``.
    labels: ``(B, T)`` integer token ids or ``-100``; usually the input ids with padding set to
      ``-100``.

  Returns:
    A float32 scalar. With no valid label at all it is 0 (HF returns NaN there).
  """
  if logits.ndim != 3 or labels.shape != logits.shape[:2]:
    raise ValueError(
      f"`logits` must be (B, T, V) and `labels` (B, T); got {logits.shape} and {labels.shape}.")
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise TypeError(f"`labels` must be integer token ids, got {labels.dtype}.")
  batch, length, vocab = logits.shape
  # Every position gets a target, the last one none (weight 0), so the logits are not sliced:
  # their gradient comes back whole, not padded back to the full length by a copy.
  targets = jnp.concatenate(
    [labels[:, 1:], jnp.full((batch, 1), IGNORE_INDEX, labels.dtype)], axis=1).reshape(-1)
  valid = targets != IGNORE_INDEX
  total = token_cross_entropy(logits.reshape(batch * length, vocab), jnp.where(valid, targets, 0),
                              valid.astype(jnp.float32))
  return total / jnp.maximum(jnp.sum(valid), 1)
