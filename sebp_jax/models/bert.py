"""BERT encoder (``BertModel``) and its sequence-classification head, in flax.linen.

The module tree mirrors Hugging Face's ``transformers.BertModel`` name for name, so a state-dict
key maps to a parameter path by swapping ``layer.3`` for ``layer_3`` and ``weight`` for the flax
leaf name (``kernel``, ``embedding``, ``scale``)::

  encoder.layer.3.intermediate.dense.weight -> encoder/layer_3/intermediate/dense/kernel  (.T)

Every linear layer is a plain ``nn.Dense``, so :func:`sebp_jax.swap_dense` reaches all of them;
its ``where`` predicate sees these same paths.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from sebp_jax.linen import dense_siblings
from sebp_jax.models.attention import ATTENTION_IMPLS, attend
from sebp_jax.models.embedding import Embed
from sebp_jax.models.inputs import token_inputs

__all__ = ["BertConfig", "BertModel", "BertForSequenceClassification"]


def _gelu_erf(x: jax.Array) -> jax.Array:
  """The exact GELU as HF's torch ``gelu`` computes it: ``0.5 x (1 + erf(x / √2))`` in float32.

  ``nn.gelu(x, approximate=False)`` is the same function written with ``erfc``, which XLA:GPU
  expands to an ``exp`` and two divides per element; in BERT-base's FFN that made it the step's
  largest fusion (1.94 ms of an H100 step, ``benchmarks/NOTES.md`` "v15"), where ``erf`` is one
  clamped polynomial. Half-precision inputs are computed in float32 and rounded once, as torch
  does (its ``opmath``), so the output matches HF's to one rounding.

  >>> _gelu_erf(jnp.array([-10.0, 0.0, 10.0]))
  Array([-0.,  0., 10.], dtype=float32)
  >>> _gelu_erf(jnp.ones((2, 3), jnp.bfloat16)).dtype
  dtype(bfloat16)
  """
  compute = jnp.promote_types(x.dtype, jnp.float32)
  xc = x.astype(compute)
  return (0.5 * xc * (1 + jax.lax.erf(xc * np.sqrt(0.5).astype(compute)))).astype(x.dtype)


_ACTIVATIONS = {
  "gelu": _gelu_erf,  # HF's "gelu" is the exact erf form
  "gelu_new": lambda x: nn.gelu(x, approximate=True),
  "gelu_pytorch_tanh": lambda x: nn.gelu(x, approximate=True),
  "relu": nn.relu,
}


@dataclasses.dataclass(frozen=True)
class BertConfig:
  """BERT hyper-parameters, named as in HF ``config.json``. Defaults are bert-base-uncased.

  ``attention_impl`` is this project's own: ``"auto"``, ``"xla"`` or ``"cudnn"`` (see
  :mod:`sebp_jax.models.attention`).
  """

  vocab_size: int = 30522
  hidden_size: int = 768
  num_hidden_layers: int = 12
  num_attention_heads: int = 12
  intermediate_size: int = 3072
  hidden_act: str = "gelu"
  hidden_dropout_prob: float = 0.1
  attention_probs_dropout_prob: float = 0.1
  max_position_embeddings: int = 512
  type_vocab_size: int = 2
  initializer_range: float = 0.02
  layer_norm_eps: float = 1e-12
  pad_token_id: int = 0
  num_labels: int = 2
  classifier_dropout: float | None = None
  attention_impl: str = "auto"

  def __post_init__(self):
    if self.hidden_size % self.num_attention_heads:
      raise ValueError(
        f"`hidden_size` ({self.hidden_size}) must be a multiple of `num_attention_heads` "
        f"({self.num_attention_heads}).")
    if self.hidden_act not in _ACTIVATIONS:
      raise ValueError(
        f"`hidden_act` must be one of {sorted(_ACTIVATIONS)}, got {self.hidden_act!r}.")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(
        f"`attention_impl` must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}.")

  @classmethod
  def from_hf_dict(cls, config: Mapping[str, Any], **overrides: Any) -> BertConfig:
    """Reads an HF ``config.json`` dict; unknown keys are ignored, ``overrides`` win."""
    if config.get("position_embedding_type", "absolute") != "absolute":
      raise ValueError(
        "Only absolute position embeddings are supported, got "
        f"position_embedding_type={config['position_embedding_type']!r}.")
    values = {f.name: config[f.name] for f in dataclasses.fields(cls) if f.name in config}
    if "num_labels" not in config and "id2label" in config:
      values["num_labels"] = len(config["id2label"])
    return cls(**{**values, **overrides})

  @classmethod
  def bert_base(cls, **overrides: Any) -> BertConfig:
    """The exact configuration of ``bert-base-uncased`` (the defaults), with ``overrides``."""
    return cls(**overrides)

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_attention_heads


class _BertModule(nn.Module):
  """Shared attributes: the config, the computation dtype and the parameter dtype."""

  config: BertConfig
  dtype: Any = None  # None: computation follows the parameters' (and inputs') dtype
  param_dtype: Any = jnp.float32

  def dense(self, features: int, name: str) -> nn.Dense:
    return nn.Dense(
      features, dtype=self.dtype, param_dtype=self.param_dtype, name=name,
      kernel_init=nn.initializers.normal(self.config.initializer_range))

  def layer_norm(self, name: str) -> nn.LayerNorm:
    return nn.LayerNorm(
      epsilon=self.config.layer_norm_eps, dtype=self.dtype, param_dtype=self.param_dtype,
      name=name)

  def embed(self, num: int, name: str) -> Embed:
    return Embed(
      num, self.config.hidden_size, dtype=self.dtype, param_dtype=self.param_dtype, name=name,
      embedding_init=nn.initializers.normal(self.config.initializer_range))


class BertEmbeddings(_BertModule):

  @nn.compact
  def __call__(self, input_ids, token_type_ids, position_ids, deterministic: bool):
    cfg = self.config
    x = (self.embed(cfg.vocab_size, "word_embeddings")(input_ids)
         + self.embed(cfg.type_vocab_size, "token_type_embeddings")(token_type_ids)
         + self.embed(cfg.max_position_embeddings, "position_embeddings")(position_ids))
    x = self.layer_norm("LayerNorm")(x)
    return nn.Dropout(cfg.hidden_dropout_prob)(x, deterministic=deterministic)


class BertSelfAttention(_BertModule):

  @nn.compact
  def __call__(self, x, attention_mask, deterministic: bool, right_padded: bool):
    cfg = self.config
    heads = (cfg.num_attention_heads, cfg.head_dim)
    # One SEBP backward for the three under swap_dense (dense_siblings); plain calls otherwise.
    q, k, v = (y.reshape(*x.shape[:-1], *heads) for y in dense_siblings(
      [self.dense(cfg.hidden_size, name) for name in ("query", "key", "value")], x))
    rate = cfg.attention_probs_dropout_prob
    rng = None if deterministic or rate == 0.0 else self.make_rng("dropout")
    out = attend(
      q, k, v, attention_mask, causal=False, impl=cfg.attention_impl, right_padded=right_padded,
      dropout_rate=rate, deterministic=deterministic, dropout_rng=rng)
    return out.reshape(x.shape[:-1] + (cfg.hidden_size,))


class BertAddNorm(_BertModule):
  """HF's ``BertSelfOutput``/``BertOutput``: dense, dropout, residual add, LayerNorm."""

  @nn.compact
  def __call__(self, x, residual, deterministic: bool):
    x = self.dense(self.config.hidden_size, "dense")(x)
    x = nn.Dropout(self.config.hidden_dropout_prob)(x, deterministic=deterministic)
    return self.layer_norm("LayerNorm")(x + residual)


class BertAttention(_BertModule):

  @nn.compact
  def __call__(self, x, attention_mask, deterministic: bool, right_padded: bool):
    kw = dict(config=self.config, dtype=self.dtype, param_dtype=self.param_dtype)
    h = BertSelfAttention(**kw, name="self")(x, attention_mask, deterministic, right_padded)
    return BertAddNorm(**kw, name="output")(h, x, deterministic)


class BertIntermediate(_BertModule):

  @nn.compact
  def __call__(self, x):
    x = self.dense(self.config.intermediate_size, "dense")(x)
    return _ACTIVATIONS[self.config.hidden_act](x)


class BertLayer(_BertModule):

  @nn.compact
  def __call__(self, x, attention_mask, deterministic: bool, right_padded: bool):
    kw = dict(config=self.config, dtype=self.dtype, param_dtype=self.param_dtype)
    x = BertAttention(**kw, name="attention")(x, attention_mask, deterministic, right_padded)
    h = BertIntermediate(**kw, name="intermediate")(x)
    return BertAddNorm(**kw, name="output")(h, x, deterministic)


class BertEncoder(_BertModule):

  @nn.compact
  def __call__(self, x, attention_mask, deterministic: bool, right_padded: bool):
    kw = dict(config=self.config, dtype=self.dtype, param_dtype=self.param_dtype)
    for i in range(self.config.num_hidden_layers):
      x = BertLayer(**kw, name=f"layer_{i}")(x, attention_mask, deterministic, right_padded)
    return x


class BertPooler(_BertModule):

  @nn.compact
  def __call__(self, hidden):
    return jnp.tanh(self.dense(self.config.hidden_size, "dense")(hidden[:, 0]))


class BertModel(_BertModule):
  """HF ``BertModel``: embeddings, encoder and (optionally) the ``[CLS]`` pooler.

  Attributes:
    config: :class:`BertConfig`.
    dtype: computation dtype (``None``: that of the parameters).
    param_dtype: parameter dtype at ``init``.
    add_pooling_layer: create the pooler, as HF's argument of the same name.
  """

  add_pooling_layer: bool = True

  @nn.compact
  def __call__(
    self,
    input_ids: jax.Array,
    attention_mask: jax.Array | None = None,
    token_type_ids: jax.Array | None = None,
    position_ids: jax.Array | None = None,
    *,
    deterministic: bool = True,
    right_padded: bool = False,
    output_pooled: bool = False,
  ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Encodes a batch.

    Args:
      input_ids: ``(B, T)`` token ids.
      attention_mask: ``(B, T)``, 1 on real tokens and 0 on padding; ``None``: no padding.
      token_type_ids: ``(B, T)`` segment ids; ``None``: all zeros.
      position_ids: ``(B, T)``; ``None``: ``0 .. T-1`` in every row (HF's default, whatever the
        padding side).
      deterministic: disables dropout (inference); training needs a ``"dropout"`` PRNG stream.
      right_padded: promise that every ``attention_mask`` row is ones then zeros, which lets
        ``attention_impl="auto"`` use cuDNN with sequence lengths on GPU. Unchecked.
      output_pooled: also return the pooler output.

    Returns:
      ``last_hidden_state`` ``(B, T, hidden_size)``, and with ``output_pooled`` the pooled
      ``(B, hidden_size)`` as a second element.
    """
    input_ids, attention_mask, position_ids = token_inputs(input_ids, attention_mask,
                                                          position_ids)
    if token_type_ids is None:
      token_type_ids = jnp.zeros_like(input_ids)
    kw = dict(config=self.config, dtype=self.dtype, param_dtype=self.param_dtype)
    x = BertEmbeddings(**kw, name="embeddings")(
      input_ids, token_type_ids, position_ids, deterministic)
    hidden = BertEncoder(**kw, name="encoder")(x, attention_mask, deterministic, right_padded)
    if not self.add_pooling_layer:
      if output_pooled:
        raise ValueError("`output_pooled=True` needs a model built with add_pooling_layer=True.")
      return hidden
    # Always run the pooler so that `init` creates its parameters; unused, XLA drops it.
    pooled = BertPooler(**kw, name="pooler")(hidden)
    return (hidden, pooled) if output_pooled else hidden


class BertForSequenceClassification(_BertModule):
  """HF ``BertForSequenceClassification``: the pooled ``[CLS]`` state, dropout, a linear layer.

  ``__call__`` takes :meth:`BertModel.__call__`'s arguments (without ``output_pooled``) and
  returns the logits ``(B, num_labels)``.
  """

  @nn.compact
  def __call__(
    self,
    input_ids: jax.Array,
    attention_mask: jax.Array | None = None,
    token_type_ids: jax.Array | None = None,
    position_ids: jax.Array | None = None,
    *,
    deterministic: bool = True,
    right_padded: bool = False,
  ) -> jax.Array:
    cfg = self.config
    _, pooled = BertModel(cfg, self.dtype, self.param_dtype, name="bert")(
      input_ids, attention_mask, token_type_ids, position_ids, deterministic=deterministic,
      right_padded=right_padded, output_pooled=True)
    rate = cfg.hidden_dropout_prob if cfg.classifier_dropout is None else cfg.classifier_dropout
    pooled = nn.Dropout(rate)(pooled, deterministic=deterministic)
    return self.dense(cfg.num_labels, "classifier")(pooled)
