"""Hugging Face checkpoints -> this package's flax modules and parameters.

:func:`from_pretrained` reads a local checkpoint folder (``config.json`` with ``model.safetensors``,
sharded safetensors or ``pytorch_model.bin``) or a GGUF file (dequantised by transformers);
:func:`from_hf` converts a live ``transformers`` torch model. Both return ``(module, params)``
such that ``module.apply(params, input_ids, attention_mask)`` is HF's first output:
``last_hidden_state`` for ``BertModel``, the logits for the heads.

State-dict keys map onto parameter paths by rule, not by table (the modules mirror HF's names):
``layer.3`` -> ``layer_3``, and ``weight`` -> the flax leaf at that path (``kernel``, stored
transposed, ``embedding`` or ``scale``). Every parameter must be filled and every tensor used, so
a mismatch between checkpoint and config fails loudly instead of leaving random weights.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from sebp_jax.models.bert import BertConfig, BertForSequenceClassification, BertModel
from sebp_jax.models.llama import LlamaConfig, LlamaForCausalLM, stack_layers

__all__ = ["SUPPORTED_ARCHITECTURES", "build_module", "convert_state_dict", "from_hf",
           "from_pretrained"]

# HF architecture name -> (config class, module class).
_ARCHITECTURES = {
  "BertModel": (BertConfig, BertModel),
  "BertForSequenceClassification": (BertConfig, BertForSequenceClassification),
  "LlamaForCausalLM": (LlamaConfig, LlamaForCausalLM),
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_ARCHITECTURES)

# Non-parameter buffers some checkpoints carry.
_BUFFERS = re.compile(r"(^|\.)(position_ids|token_type_ids|rotary_emb\.inv_freq|masked_bias)$")
_INDEXED = re.compile(r"\.(layer|layers)\.(\d+)\.")
# A torch `weight` lands on whichever of these leaves the flax module has at that path.
_WEIGHT_LEAVES = ("kernel", "embedding", "scale")

Params = dict[str, Any]


def build_module(
  config: Mapping[str, Any],
  architecture: str | None = None,
  *,
  dtype: Any = None,
  param_dtype: Any = jnp.float32,
  **config_overrides: Any,
) -> nn.Module:
  """The flax module for an HF ``config.json`` dict.

  Args:
    config: the ``config.json`` contents.
    architecture: one of :data:`SUPPORTED_ARCHITECTURES`; ``None`` reads ``architectures[0]``.
    dtype: computation dtype (``None``: that of the parameters).
    param_dtype: parameter dtype.
    **config_overrides: config fields to replace, e.g. ``attention_impl="xla"``.
  """
  if architecture is None:
    names = config.get("architectures") or []
    if not names:
      raise ValueError(
        "The config has no `architectures` entry; pass `architecture=` (one of "
        f"{SUPPORTED_ARCHITECTURES}).")
    architecture = names[0]
  if architecture not in _ARCHITECTURES:
    raise ValueError(
      f"Unsupported architecture {architecture!r}; supported: {SUPPORTED_ARCHITECTURES}.")
  config_cls, module_cls = _ARCHITECTURES[architecture]
  return module_cls(config_cls.from_hf_dict(config, **config_overrides), dtype=dtype,
                    param_dtype=param_dtype)


def _flax_path(key: str) -> tuple[str, ...]:
  # "encoder.layer.3.attention..." -> ("encoder", "layer_3", "attention", ...)
  return tuple(_INDEXED.sub(r".\1_\2.", "." + key + ".").strip(".").split("."))


def convert_state_dict(
  module: nn.Module, state_dict: Mapping[str, np.ndarray]
) -> Params:
  """Places torch-layout tensors into ``module``'s parameter tree.

  Args:
    module: a module from :func:`build_module` (its ``param_dtype`` sets the parameters' dtype).
    state_dict: HF parameter name -> array in torch layout (``Linear.weight`` is ``(out, in)``).

  Returns:
    ``{"params": ...}`` for ``module.apply`` (a LLaMA with ``scan_layers`` gets its layers
    stacked, :func:`sebp_jax.models.llama.stack_layers`).

  Raises:
    ValueError: a tensor maps to no parameter or has the wrong shape, or a parameter is missing.
  """
  config = module.config
  if getattr(config, "scan_layers", False):
    unrolled = module.clone(config=dataclasses.replace(config, scan_layers=False))
    return stack_layers(convert_state_dict(unrolled, state_dict), config.num_hidden_layers)
  ids = jnp.zeros((1, 1), jnp.int32)
  shapes = jax.eval_shape(lambda: module.init(jax.random.key(0), ids))["params"]
  targets = traverse_util.flatten_dict(shapes)
  tied = getattr(module.config, "tie_word_embeddings", False)
  out: dict[tuple[str, ...], jax.Array] = {}
  unexpected = []
  for key, value in state_dict.items():
    if _BUFFERS.search(key) or (tied and key == "lm_head.weight"):
      continue  # buffers; the tied head is the embedding itself
    *scope, leaf = _flax_path(key)
    candidates = _WEIGHT_LEAVES if leaf == "weight" else (leaf,)
    path = next((tuple(scope) + (c,) for c in candidates if tuple(scope) + (c,) in targets), None)
    if path is None:
      unexpected.append(key)
      continue
    value = np.asarray(value)
    if path[-1] == "kernel":
      value = value.T
    target = targets[path]
    if value.shape != target.shape:
      raise ValueError(
        f"Checkpoint tensor {key!r} has shape {value.shape} (flax layout) but parameter "
        f"{'/'.join(path)} expects {target.shape}: the config does not match the weights.")
    out[path] = jnp.asarray(value, dtype=target.dtype)
  missing = sorted("/".join(p) for p in targets if p not in out)
  if unexpected or missing:
    raise ValueError(
      f"Checkpoint and {type(module).__name__} disagree. Unused checkpoint tensors: "
      f"{unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}; parameters without a tensor: "
      f"{missing[:8]}{' ...' if len(missing) > 8 else ''}.")
  return {"params": traverse_util.unflatten_dict(out)}


def _match_checkpoint(
  module: nn.Module, state_dict: Mapping[str, np.ndarray]
) -> tuple[nn.Module, Mapping[str, np.ndarray]]:
  """Fits a bare ``BertModel`` to what the checkpoint holds, as HF's loader does.

  A ``BertFor*`` checkpoint read as ``BertModel`` keeps its ``bert.*`` tensors (the head is not
  part of the encoder), and a checkpoint without pooler gives a model without pooler.
  """
  if not isinstance(module, BertModel):
    return module, state_dict
  if any(k.startswith("bert.") for k in state_dict):
    state_dict = {k[len("bert."):]: v for k, v in state_dict.items() if k.startswith("bert.")}
  if not any(k.startswith("pooler.") for k in state_dict):
    module = module.clone(add_pooling_layer=False)
  return module, state_dict


def _torch_state_dict_to_numpy(state_dict) -> dict[str, np.ndarray]:
  import torch  # only needed for torch inputs

  # numpy has no bfloat16 that torch converts to: go through float32 (exact).
  return {k: (v.detach().cpu().float() if v.dtype == torch.bfloat16 else v.detach().cpu()).numpy()
          for k, v in state_dict.items()}


def from_hf(
  torch_model: Any, *, dtype: Any = None, param_dtype: Any = jnp.float32, **config_overrides: Any
) -> tuple[nn.Module, Params]:
  """Converts a ``transformers`` torch model (``BertModel``, ``BertForSequenceClassification``,
  ``LlamaForCausalLM``) into ``(module, params)``.

  Args:
    torch_model: the HF model instance.
    dtype: computation dtype of the flax module (``None``: that of the parameters).
    param_dtype: parameter dtype, e.g. ``jnp.bfloat16`` for large models.
    **config_overrides: config fields to replace, e.g. ``attention_impl="xla"``.
  """
  if not hasattr(torch_model, "config") or not hasattr(torch_model, "state_dict"):
    raise TypeError(
      f"`torch_model` must be a transformers model, got {type(torch_model).__name__}.")
  module = build_module(torch_model.config.to_dict(), type(torch_model).__name__, dtype=dtype,
                        param_dtype=param_dtype, **config_overrides)
  module, state_dict = _match_checkpoint(
    module, _torch_state_dict_to_numpy(torch_model.state_dict()))
  return module, convert_state_dict(module, state_dict)


def _read_weights(folder: Path) -> dict[str, np.ndarray]:
  """The tensors of a checkpoint folder, from (sharded) safetensors or a PyTorch bin."""
  for index_name, loader in (("model.safetensors.index.json", _load_safetensors),
                             ("pytorch_model.bin.index.json", _load_torch_bin)):
    if (folder / index_name).is_file():
      shards = sorted(set(json.loads((folder / index_name).read_text())["weight_map"].values()))
      return {k: v for shard in shards for k, v in loader(folder / shard).items()}
  if (folder / "model.safetensors").is_file():
    return _load_safetensors(folder / "model.safetensors")
  if (folder / "pytorch_model.bin").is_file():
    return _load_torch_bin(folder / "pytorch_model.bin")
  raise FileNotFoundError(
    f"No weights in {folder}: expected model.safetensors, model.safetensors.index.json, "
    "pytorch_model.bin or pytorch_model.bin.index.json (or pass a .gguf file).")


def _load_safetensors(path: Path) -> dict[str, np.ndarray]:
  from safetensors.numpy import load_file

  return load_file(str(path))


def _load_torch_bin(path: Path) -> dict[str, np.ndarray]:
  import torch

  return _torch_state_dict_to_numpy(torch.load(path, map_location="cpu", weights_only=True))


def from_pretrained(
  path: str | os.PathLike,
  *,
  dtype: Any = None,
  param_dtype: Any = jnp.float32,
  gguf_file: str | None = None,
  architecture: str | None = None,
  **config_overrides: Any,
) -> tuple[nn.Module, Params]:
  """Loads a local HF checkpoint into ``(module, params)``. Nothing is downloaded.

  Args:
    path: a checkpoint folder (``config.json`` + weights), or a ``.gguf`` file.
    dtype: computation dtype of the flax module (``None``: that of the parameters).
    param_dtype: parameter dtype, e.g. ``jnp.bfloat16`` for large models.
    gguf_file: name of a GGUF file inside the folder ``path``; GGUF weights are dequantised by
      ``transformers`` (which needs ``gguf`` and ``accelerate``) and converted by :func:`from_hf`.
    architecture: overrides ``config.json``'s ``architectures[0]``, e.g. ``"BertModel"`` for the
      encoder of a ``BertForMaskedLM`` or ``BertForSequenceClassification`` checkpoint (its
      ``bert.*`` tensors are used, the head is left out). Ignored for GGUF.
    **config_overrides: config fields to replace, e.g. ``attention_impl="xla"``.
  """
  path = Path(path)
  if path.suffix == ".gguf":
    path, gguf_file = path.parent, path.name
  if not path.exists():
    raise FileNotFoundError(f"`path` does not exist: {path}")
  if gguf_file is not None:
    if not (path / gguf_file).is_file():
      raise FileNotFoundError(f"GGUF file not found: {path / gguf_file}")
    from transformers import AutoModelForCausalLM

    torch_model = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf_file)
    return from_hf(torch_model, dtype=dtype, param_dtype=param_dtype, **config_overrides)
  if not (path / "config.json").is_file():
    raise FileNotFoundError(
      f"No config.json in {path}; a GGUF checkpoint needs `gguf_file=` or a path to the file.")
  config = json.loads((path / "config.json").read_text())
  module = build_module(config, architecture, dtype=dtype, param_dtype=param_dtype,
                        **config_overrides)
  module, state_dict = _match_checkpoint(module, _read_weights(path))
  return module, convert_state_dict(module, state_dict)
