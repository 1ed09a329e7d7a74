"""Flax BERT and LLaMA models with Hugging Face weight import.

``nn.Dense`` is used for every linear layer, so :func:`sebp_jax.swap_dense` reaches them all.
``module.apply(params, input_ids, attention_mask)`` returns HF's first output.
"""

from sebp_jax.models.bert import BertConfig, BertForSequenceClassification, BertModel
from sebp_jax.models.embedding import Embed
from sebp_jax.models.hf_import import (SUPPORTED_ARCHITECTURES, build_module, convert_state_dict,
                                       from_hf, from_pretrained)
from sebp_jax.models.llama import (LlamaConfig, LlamaForCausalLM, LlamaModel, RopeScaling,
                                   causal_lm_loss, stack_layers, unstack_layers)
from sebp_jax.models.rms_norm import RMSNorm

__all__ = [
  "BertConfig", "BertModel", "BertForSequenceClassification",
  "LlamaConfig", "RopeScaling", "LlamaModel", "LlamaForCausalLM", "causal_lm_loss",
  "stack_layers", "unstack_layers",
  "Embed", "RMSNorm",
  "SUPPORTED_ARCHITECTURES", "build_module", "convert_state_dict", "from_hf", "from_pretrained",
]
