"""JAX against PyTorch, from one layer to a training run: the comparisons behind the parity tests.

Every function here runs the same numbers through ``sebp_jax`` and ``sebp_torch_ref`` (or Hugging
Face torch) and returns :class:`Comparison` records: the value under test (JAX), the reference
(torch), and the tolerance. The tests assert them (``Comparison.check``); ``python -m
parity_tests.report`` tabulates them. Three levels:

* :func:`layer_comparisons`: one linear layer on identical numpy inputs: ``y``, ``dX``, ``dW``,
  ``db`` and the kept rows, for a JAX backend against a torch backend, tolerances keyed by dtype.
* :func:`model_comparisons`: a tiny Hugging Face BERT classifier or (tied) LLaMA against its flax
  import (``sebp_jax.models.from_hf``), SEBP on in both: the loss, every parameter gradient and
  the rows each layer keeps.
* :func:`training_comparisons`: 20 AdamW steps on real text (Rotten Tomatoes, PIQA), per-step
  losses of JAX and torch, each dense and with the exact SEBP policy.

Policies are given as ``(threshold, max_rows)`` (:data:`POLICIES` names them): the two packages
have separate ``RowPolicy`` classes. The non-exact policies are chosen so that no kept/dropped
decision hinges on rounding (every row score far from the threshold, a clear norm gap at the
``max_rows`` cut), which is checked on both frameworks' own gradients, so that "the same rows are
dropped" is a fair demand.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import pathlib
import re
from typing import Any, Callable, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import torch
import torch.nn.functional as F
from flax import traverse_util

import sebp_jax
import sebp_torch_ref
from parity_tests import reference
from parity_tests.tolerances import Tolerance, assert_close, relative_error, tolerance
from sebp_jax.models import causal_lm_loss, convert_state_dict, from_hf

__all__ = [
  "Comparison", "POLICIES", "JAX_IMPLS", "TORCH_IMPLS", "GPU_IMPLS", "supports",
  "layer_comparisons", "MODEL_ARCHS", "MODEL_POLICIES", "MODEL_RTOL", "model_comparisons",
  "TRAINING_STEPS", "TRAINING_RTOL", "ADAMW", "TRAINING_DATA_FILE", "tokenize_training_text",
  "export_training_data", "read_training_data", "training_comparisons", "jax_train_step",
]

# ---------------------------------------------------------------------------------------------
# The comparison record


@dataclasses.dataclass(frozen=True, eq=False)
class Comparison:
  """One value under test (from JAX) against its reference (from torch).

  Attributes:
    group: the setting, e.g. ``"layer bfloat16 threshold"``.
    quantity: what is compared, e.g. ``"dW"`` or ``"parameter gradients"``; the report has a row
      per group and quantity, with the worst of its comparisons.
    detail: which one, e.g. ``"jax xla vs torch torch"`` or a parameter path.
    actual, expected: same-shape arrays (compared in float64).
    tolerance: elementwise ``|actual - expected| <= atol + rtol * |expected|``.
    dtype: the dtype the tolerance is for (that of the value under test), for messages.
    scale: if given, ``tolerance.atol`` is relative to it (usually ``max |expected|``): a bound
      on the worst error against the reference's scale, for gradients whose entries span many
      magnitudes.
  """

  group: str
  quantity: str
  detail: str
  actual: np.ndarray
  expected: np.ndarray
  tolerance: Tolerance
  dtype: str = "float32"
  scale: float | None = None

  @property
  def _atol(self) -> float:
    return self.tolerance.atol * (1.0 if self.scale is None else self.scale)

  def check(self) -> None:
    """Raise ``AssertionError`` (from :func:`assert_close`) if the values disagree."""
    assert_close(self.actual, self.expected, self.dtype,
                 what=f"{self.group}: {self.quantity} ({self.detail})",
                 rtol=self.tolerance.rtol, atol=self._atol)

  @property
  def passed(self) -> bool:
    try:
      self.check()
    except AssertionError:
      return False
    return True

  @property
  def error(self) -> float:
    """The worst error relative to the reference's scale: ``max |actual - expected|`` over
    ``scale`` if given, else over ``max |expected|`` (:func:`relative_error`)."""
    error = relative_error(self.actual, self.expected)
    if self.scale is None:
      return error
    return error * float(np.max(np.abs(self.expected))) / self.scale

  @property
  def tolerance_text(self) -> str:
    rtol, atol = self.tolerance.rtol, self.tolerance.atol
    if rtol == 0 and atol == 0:
      return "exact"
    if self.scale is not None:
      return f"{atol:g} · max\\|ref\\|" + (f" + {rtol:g} · \\|ref\\|" if rtol else "")
    if atol == 0:
      return f"rel {rtol:g}"
    return f"rtol {rtol:g}, atol {atol:g}"


def _kept_rows(group: str, detail: str, actual: np.ndarray, expected: np.ndarray) -> Comparison:
  """Equality of two row masks (compared as float32 0/1 arrays)."""
  as_float = lambda a: np.asarray(a, np.float32)
  return Comparison(group, "kept rows", detail, as_float(actual), as_float(expected),
                    Tolerance(0.0, 0.0))


# ---------------------------------------------------------------------------------------------
# Policies and backends

# (threshold, max_rows): the same numbers build each package's RowPolicy.
PolicyFields = tuple[float, "int | None"]
# The layer policies, by name.
POLICIES: dict[str, PolicyFields] = {
  "exact": (0.0, None),
  "threshold": (1e-3, None),
  "max_rows": (0.0, 9),
  "both": (1e-3, 5),
}
EXACT: PolicyFields = POLICIES["exact"]

# Backends that run on CPU; GPU_IMPLS join them on a GPU (tests mark those cases `gpu`).
# The Triton interpreter is covered by test_torch_sebp_linear.py (it must start its own process).
JAX_IMPLS = ("xla", "dense", "interpret")
TORCH_IMPLS = ("torch", "dense")
GPU_IMPLS = frozenset({"pallas", "triton"})


def supports(impl: str, policy: str) -> bool:
  """Whether backend ``impl`` (of either package) implements the named policy: "dense" is the
  plain backward, exact only."""
  return impl != "dense" or POLICIES[policy] == EXACT


def _describe(fields: PolicyFields) -> str:
  """``"exact"``, ``"threshold 0.001"``, ``"max_rows 9"``, ``"threshold 0.001, max_rows 5"``."""
  threshold, max_rows = fields
  parts = ([f"threshold {threshold:g}"] if threshold else []) + (
    [f"max_rows {max_rows}"] if max_rows is not None else [])
  return ", ".join(parts) or "exact"


def _jax_policy(fields: PolicyFields) -> sebp_jax.RowPolicy:
  return sebp_jax.RowPolicy(*fields)


def _torch_policy(fields: PolicyFields) -> sebp_torch_ref.RowPolicy:
  return sebp_torch_ref.RowPolicy(*fields)


def _torch_device(torch_impl: str) -> str:
  return "cuda" if torch_impl == "triton" else "cpu"


# ---------------------------------------------------------------------------------------------
# One layer

# 3 sequences of 13 tokens: 39 rows, K = 45 and N = 29; none a multiple of any block size.
LAYER_LEAD, LAYER_IN, LAYER_OUT = (3, 13), 45, 29
# Quiet rows (padding that is not exactly zero) have max |dy| about 1e-5, far below the
# threshold 1e-3; loud rows have L2 norms spread over [0.5, 2] in 5 % steps or more, so the
# max_rows cut never hinges on rounding, in bfloat16 either.
_QUIET_SCALE = 1e-5


@dataclasses.dataclass(frozen=True)
class LayerCase:
  """``x (*LAYER_LEAD, K)``, ``kernel (K, N)`` (flax layout), ``bias (N,)``, ``dy (*LAYER_LEAD,
  N)``: float32 numpy arrays whose values are exact in ``dtype``, so both frameworks start from
  the same numbers."""

  dtype: str
  x: np.ndarray
  kernel: np.ndarray
  bias: np.ndarray
  dy: np.ndarray


@functools.cache
def layer_case(dtype: str, seed: int) -> LayerCase:
  """Random layer inputs and a right-padded output gradient with loud, quiet and zero rows."""
  rng = np.random.default_rng(seed)
  sequences, tokens = LAYER_LEAD
  lengths = np.array([tokens, rng.integers(5, 10), rng.integers(1, 5)])
  real = np.arange(tokens)[None] < lengths[:, None]
  quiet = real & (rng.random(LAYER_LEAD) < 0.3)
  quiet[0, 0] = True  # at least one quiet row
  loud = real & ~quiet
  dy = rng.standard_normal((*LAYER_LEAD, LAYER_OUT))
  dy /= np.linalg.norm(dy, axis=-1, keepdims=True)
  scale = np.zeros(LAYER_LEAD)
  scale[loud] = rng.permutation(np.linspace(0.5, 2.0, loud.sum()))
  scale[quiet] = _QUIET_SCALE * rng.permutation(np.linspace(0.5, 2.0, quiet.sum()))
  dy *= scale[..., None]
  to_dtype = lambda a: np.asarray(a, np.float32).astype(_NUMPY_DTYPES[dtype]).astype(np.float32)
  case = LayerCase(
    dtype, to_dtype(rng.standard_normal((*LAYER_LEAD, LAYER_IN))),
    to_dtype(rng.standard_normal((LAYER_IN, LAYER_OUT)) / np.sqrt(LAYER_IN)),
    to_dtype(rng.standard_normal(LAYER_OUT)), to_dtype(dy))
  for name, fields in POLICIES.items():  # every non-exact policy must drop a non-zero row
    kept = reference.keep_mask(case.dy, *fields)
    nonzero = np.any(case.dy != 0, axis=-1).reshape(-1)
    assert fields == EXACT or (nonzero & ~kept).any(), f"seed {seed}: {name} drops nothing"
  return case


_NUMPY_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


@dataclasses.dataclass(frozen=True)
class LayerResult:
  """Forward output and gradients as float32 numpy; ``dkernel`` in flax layout ``(K, N)``."""

  y: np.ndarray
  dx: np.ndarray
  dkernel: np.ndarray
  dbias: np.ndarray

  @property
  def kept(self) -> np.ndarray:
    """``(M,)`` bool: the rows the backward kept, read off ``dX`` (zero exactly on dropped rows)."""
    return np.any(self.dx.reshape(-1, self.dx.shape[-1]) != 0, axis=1)


@functools.partial(jax.jit, static_argnames=("policy", "impl"))
def _jax_vjp(x, kernel, bias, dy, *, policy, impl):
  def layer(x, kernel, bias):
    return sebp_jax.sebp_matmul(x, kernel, bias, policy=policy, impl=impl,
                                precision=jax.lax.Precision.HIGHEST)

  y, vjp = jax.vjp(layer, x, kernel, bias)
  return (y, *vjp(dy))


@functools.cache
def jax_layer(dtype: str, seed: int, policy: str, impl: str) -> LayerResult:
  """``sebp_jax.sebp_matmul`` forward and backward on :func:`layer_case`."""
  case = layer_case(dtype, seed)
  arrays = (jnp.asarray(a, dtype) for a in (case.x, case.kernel, case.bias, case.dy))
  y, dx, dkernel, dbias = _jax_vjp(*arrays, policy=_jax_policy(POLICIES[policy]), impl=impl)
  as_numpy = lambda a: np.asarray(a.astype(jnp.float32))
  return LayerResult(as_numpy(y), as_numpy(dx), as_numpy(dkernel), as_numpy(dbias))


@functools.cache
def torch_layer(dtype: str, seed: int, policy: str, impl: str) -> LayerResult:
  """``sebp_torch_ref.sebp_linear`` forward and backward on :func:`layer_case` (torch layout)."""
  case = layer_case(dtype, seed)
  device, torch_dtype = _torch_device(impl), getattr(torch, dtype)
  tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device, torch_dtype)
  x, weight, bias = (tensor(a).requires_grad_() for a in (case.x, case.kernel.T, case.bias))
  y = sebp_torch_ref.sebp_linear(x, weight, bias, policy=_torch_policy(POLICIES[policy]),
                                 impl=impl)
  y.backward(tensor(case.dy))
  as_numpy = lambda t: t.detach().float().cpu().numpy()
  return LayerResult(as_numpy(y), as_numpy(x.grad), as_numpy(weight.grad).T, as_numpy(bias.grad))


def layer_comparisons(
  dtype: str, policy: str, jax_impl: str, torch_impl: str, seed: int = 0
) -> list[Comparison]:
  """One layer through ``sebp_matmul(impl=jax_impl)`` and ``sebp_linear(impl=torch_impl)``.

  Args:
    dtype: ``"float32"`` or ``"bfloat16"`` (inputs, parameters and gradients).
    policy: a key of :data:`POLICIES` that both backends implement (:func:`supports`).
    jax_impl, torch_impl: the backends.
    seed: draws the inputs (:func:`layer_case`).

  Returns:
    ``y``, ``dX``, ``dW`` (compared in flax layout), ``db`` within :func:`tolerance` of
    ``dtype``, and the kept rows (exactly equal, and equal to the contract's reading of ``dy``).
  """
  for impl in (jax_impl, torch_impl):
    if not supports(impl, policy):
      raise ValueError(f"layer_comparisons: impl {impl!r} does not implement policy {policy!r}.")
  got = jax_layer(dtype, seed, policy, jax_impl)
  want = torch_layer(dtype, seed, policy, torch_impl)
  group = f"layer {dtype}, {_describe(POLICIES[policy])}"
  pair = f"jax {jax_impl} vs torch {torch_impl}"
  tol = tolerance(dtype)
  fields = {"y": "y", "dX": "dx", "dW": "dkernel", "db": "dbias"}
  out = [Comparison(group, quantity, pair, getattr(got, field), getattr(want, field), tol, dtype)
         for quantity, field in fields.items()]
  contract = reference.keep_mask(layer_case(dtype, seed).dy, *POLICIES[policy])
  out.append(_kept_rows(group, pair, got.kept, want.kept))
  out.append(_kept_rows(group, f"torch {torch_impl} vs the contract", want.kept, contract))
  return out


# ---------------------------------------------------------------------------------------------
# Models: tiny Hugging Face models and their flax imports

MODEL_ARCHS = ("bert", "llama")
MODEL_POLICIES = ("exact", "threshold", "max_rows")
MODEL_RTOL = 1e-4  # the loss, and every gradient against the largest entry of its parameter

_VOCAB = 101
# One sequence of each batch is weighted 1e-7 in the loss: every row of its gradients is that
# much smaller than any other sequence's (sequences do not mix), which opens a gap of orders of
# magnitude between row scores where the threshold sits. Padding gives exactly zero rows.
_LENGTHS, _TOKENS = (16, 9, 4, 11), 16
_SEQUENCE_WEIGHTS = (1.0, 1.0, 1.0, 1e-7)
# Per architecture: the non-exact policies (threshold in the gap; max_rows cutting among the
# loud rows of the layers that see every token).
# The threshold sits 10x above the loudest rounding-noise row seen (5.6e-8: a causal sequence's
# first-token query rows, zero in exact arithmetic, under torch on an H200) and 10x below the
# quietest loud row; the frameworks differ by rounding only (~1e-6 relative), far inside 10x.
_MODEL_POLICIES: dict[str, dict[str, PolicyFields]] = {
  "bert": {"exact": EXACT, "threshold": (2e-6, None), "max_rows": (0.0, 20)},
  "llama": {"exact": EXACT, "threshold": (2e-6, None), "max_rows": (0.0, 25)},
}
_SEPARATION = 10.0  # every row score at least this factor away from the threshold
_NORM_GAP = 1e-2  # relative gap between the last kept and the first dropped L2 norm
# Some gradients are zero in exact arithmetic but rounding noise in practice: the key bias
# (softmax ignores a per-query constant), the query rows of a causal sequence's first token
# (which attends to itself only). A parameter gradient below _ZERO_GRADIENT of the model's
# largest (the key biases: 1e-9) is compared against the model's scale. A row below _ZERO_ROW of
# its layer's largest score in either framework (seen: exactly 0 in JAX, 1e-7 in torch; the
# quiet sequence sits at 1e-7 in both) is left out of the kept-rows comparison under a zero
# threshold: either framework may keep it, to no effect.
_ZERO_GRADIENT = 1e-6
_ZERO_ROW = 1e-10


def _hf_model(arch: str) -> torch.nn.Module:
  import transformers

  torch.manual_seed(0)
  if arch == "bert":
    # head_dim 9, FFN 37: odd sizes. A large init range makes attention sharp (not uniform).
    config = transformers.BertConfig(
      vocab_size=_VOCAB, hidden_size=36, num_hidden_layers=2, num_attention_heads=4,
      intermediate_size=37, max_position_embeddings=32, initializer_range=0.2, num_labels=3,
      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(config)
  config = transformers.LlamaConfig(
    vocab_size=_VOCAB, hidden_size=48, intermediate_size=44, num_hidden_layers=2,
    num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=32,
    initializer_range=0.2, tie_word_embeddings=True)
  return transformers.LlamaForCausalLM(config)


def _model_batch(arch: str) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(1)
  ids = rng.integers(1, _VOCAB, (len(_LENGTHS), _TOKENS)).astype(np.int32)
  mask = (np.arange(_TOKENS)[None] < np.asarray(_LENGTHS)[:, None]).astype(np.int32)
  labels = (rng.integers(0, 3, len(_LENGTHS)) if arch == "bert"
            else np.where(mask == 1, ids, -100)).astype(np.int32)
  return dict(input_ids=ids, attention_mask=mask, labels=labels,
              weights=np.asarray(_SEQUENCE_WEIGHTS, np.float32))


def _jax_weighted_loss(arch: str, logits: jax.Array, batch: dict[str, Any]) -> jax.Array:
  """Per-sequence weighted loss: classification CE (BERT), next-token CE (LLaMA)."""
  weights = jnp.asarray(batch["weights"])
  if arch == "bert":
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
    return jnp.mean(weights * ce)
  targets = jnp.asarray(batch["labels"])[:, 1:]
  valid = targets != -100
  ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], jnp.where(valid, targets, 0))
  return jnp.sum(jnp.where(valid, ce, 0.0) * weights[:, None]) / jnp.sum(valid)


def _torch_weighted_loss(arch: str, logits: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
  weights = torch.from_numpy(batch["weights"]).to(logits.device)
  labels = torch.from_numpy(batch["labels"]).long().to(logits.device)
  if arch == "bert":
    return torch.mean(weights * F.cross_entropy(logits, labels, reduction="none"))
  targets = labels[:, 1:]
  ce = F.cross_entropy(logits[:, :-1].transpose(1, 2), targets, reduction="none",
                       ignore_index=-100)
  return torch.sum(ce * weights[:, None]) / torch.sum(targets != -100)


@contextlib.contextmanager
def _perturb_linear_outputs() -> Iterator[None]:
  """Adds a zero ``perturbations`` variable to the output of every ``nn.Dense`` (named
  ``"__call__"``) and ``nn.Embed.attend`` (named ``"attend"``): its gradient is the layer's dY.

  Must be entered before ``swap_dense`` so that it wraps the swapped call (flax runs the
  interceptor entered first outermost).
  """

  def interceptor(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    module, method = context.module, context.method_name
    if ((type(module) is nn.Dense and method == "__call__")
        or (isinstance(module, nn.Embed) and method == "attend")):
      out = module.perturb(method, out)
    return out

  with nn.intercept_methods(interceptor):
    yield


def _jax_layer_path(perturbation_path: tuple[str, ...]) -> str:
  """``("bert", ..., "query", "__call__")`` -> ``"bert/.../query"``; attend keeps its name."""
  path = perturbation_path[:-1] if perturbation_path[-1] == "__call__" else perturbation_path
  return "/".join(path)


def _torch_layer_path(name: str, tied: bool) -> str:
  """``"bert.encoder.layer.0.attention.self.query"`` -> the flax path of the same layer."""
  if tied and name == "lm_head":
    return "model/embed_tokens/attend"  # the tied head is flax's Embed.attend
  return re.sub(r"\.(\d+)(?=\.|$)", r"_\1", name).replace(".", "/")


@dataclasses.dataclass(frozen=True)
class ModelRun:
  """Loss, parameter gradients (flax paths and layout) and each linear layer's ``dY (M, N)``."""

  loss: float
  grads: dict[str, np.ndarray]
  output_grads: dict[str, np.ndarray]


def _jax_model_run(arch: str, policy: PolicyFields, impl: str) -> ModelRun:
  module, params = from_hf(_hf_model(arch))
  batch = _model_batch(arch)
  inputs = (jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"]))

  def loss_fn(params, perturbations):
    logits = module.apply({**params, "perturbations": perturbations}, *inputs)
    return _jax_weighted_loss(arch, logits, batch)

  # float32 matmuls in full float32 on every device (GPUs default to TF32 otherwise).
  with jax.default_matmul_precision("highest"), _perturb_linear_outputs():
    shapes = jax.eval_shape(module.init, jax.random.key(0), *inputs)["perturbations"]
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    swapped: set[str] = set()

    def where(path: tuple[str, ...]) -> bool:  # swap every layer; record which were reached
      swapped.add("/".join(path))
      return True

    with sebp_jax.swap_dense(_jax_policy(policy), where=where, impl=impl):
      loss, (grads, dys) = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))(params, zeros)
  flat_grads = traverse_util.flatten_dict(grads["params"])
  output_grads = {_jax_layer_path(k): np.asarray(v).reshape(-1, v.shape[-1])
                  for k, v in traverse_util.flatten_dict(dys).items()}
  assert swapped == output_grads.keys(), f"swap_dense missed {output_grads.keys() - swapped}"
  return ModelRun(float(loss), {"/".join(k): np.asarray(v) for k, v in flat_grads.items()},
                  output_grads)


def _torch_model_run(arch: str, policy: PolicyFields, impl: str) -> ModelRun:
  hf = _hf_model(arch)
  module, _ = from_hf(hf)  # for the name and layout mapping of the gradients
  device = _torch_device(impl)
  model = hf.to(device)
  linears = sum(type(m) is torch.nn.Linear for m in model.modules())
  swapped = sebp_torch_ref.apply_sebp(model, _torch_policy(policy), impl=impl)
  assert swapped == linears, f"apply_sebp swapped {swapped} of {linears} linear layers"
  tied = getattr(model.config, "tie_word_embeddings", False)
  output_grads: dict[str, np.ndarray] = {}

  def capture(name: str) -> Callable:
    def save(grad: torch.Tensor) -> None:
      output_grads[_torch_layer_path(name, tied)] = (
        grad.detach().reshape(-1, grad.shape[-1]).float().cpu().numpy())

    def hook(_module, _inputs, output: torch.Tensor) -> None:  # None: the output is unchanged
      output.register_hook(save)

    return hook

  for name, layer in model.named_modules():
    if isinstance(layer, torch.nn.Linear):  # SEBPLinear included
      layer.register_forward_hook(capture(name))
  batch = _model_batch(arch)
  ids, mask = (torch.from_numpy(batch[k]).long().to(device)
               for k in ("input_ids", "attention_mask"))
  loss = _torch_weighted_loss(arch, model(input_ids=ids, attention_mask=mask).logits, batch)
  loss.backward()
  grads = {name: p.grad.cpu().numpy() for name, p in model.named_parameters()}
  flat = traverse_util.flatten_dict(convert_state_dict(module, grads)["params"])
  return ModelRun(loss.item(), {"/".join(k): np.asarray(v) for k, v in flat.items()}, output_grads)


def _assert_robust_selection(output_grads: dict[str, np.ndarray], fields: PolicyFields,
                             what: str) -> None:
  """The policy's decision on every row is far from a tie, and it drops some non-zero rows.

  Raises ``AssertionError`` naming the layer otherwise: the test setup would then compare
  frameworks on rounding noise, or not test the policy at all.
  """
  threshold, max_rows = fields
  dropped = 0
  for path, dy in output_grads.items():
    rows = dy.astype(np.float64)
    scores = np.abs(rows).max(axis=1)
    if threshold > 0:
      near = (scores > threshold / _SEPARATION) & (scores < threshold * _SEPARATION)
      assert not near.any(), (
        f"{what}: {path} has a row score {scores[near][0]:.3g} within {_SEPARATION:g}x of the "
        f"threshold {threshold:g}; choose another")
    active = scores > threshold
    if max_rows is not None and active.sum() > max_rows:
      norms = np.sort(np.linalg.norm(rows[active], axis=1))[::-1]
      gap = (norms[max_rows - 1] - norms[max_rows]) / norms[max_rows - 1]
      assert gap >= _NORM_GAP, (
        f"{what}: {path}: L2 norms at the max_rows={max_rows} cut differ by {gap:.2g} only "
        f"(< {_NORM_GAP:g}); choose another max_rows")
    keep = reference.keep_mask(dy, threshold, max_rows)
    dropped += int(np.sum((scores > 0) & ~keep))
  assert fields == EXACT or dropped > 0, f"{what}: the policy drops no non-zero row"


@functools.cache
def _model_runs(arch: str, policy: PolicyFields, jax_impl: str,
                torch_impl: str) -> tuple[ModelRun, ModelRun]:
  return _jax_model_run(arch, policy, jax_impl), _torch_model_run(arch, policy, torch_impl)


def model_comparisons(
  arch: str, policy: str, jax_impl: str = "xla", torch_impl: str = "torch"
) -> list[Comparison]:
  """The flax model under ``swap_dense`` against HF torch under ``apply_sebp``, same weights.

  A padded batch (4 sequences, 16 tokens) with one sequence weighted 1e-7 in the loss; the
  non-exact policies drop its rows (threshold), or cut the loud rows by norm (max_rows).

  Args:
    arch: ``"bert"`` (``BertForSequenceClassification``) or ``"llama"`` (``LlamaForCausalLM``
      with tied embeddings: the output projection is ``Embed.attend`` in flax, ``lm_head`` in
      torch).
    policy: one of :data:`MODEL_POLICIES`.
    jax_impl, torch_impl: the SEBP backends.

  Returns:
    The loss (rel :data:`MODEL_RTOL`), every parameter gradient (within ``MODEL_RTOL`` of the
    parameter's largest reference entry) and, per linear layer, the rows kept under the policy.

  Raises:
    AssertionError: if the policy's decisions are not clear-cut in both frameworks' gradients.
  """
  if arch not in MODEL_ARCHS or policy not in MODEL_POLICIES:
    raise ValueError(f"model_comparisons: arch must be in {MODEL_ARCHS} and policy in "
                     f"{MODEL_POLICIES}, got {arch!r}, {policy!r}.")
  fields = _MODEL_POLICIES[arch][policy]
  got, want = _model_runs(arch, fields, jax_impl, torch_impl)
  for run, framework in ((got, "jax"), (want, "torch")):
    _assert_robust_selection(run.output_grads, fields, f"{arch} {policy} ({framework})")
  group = f"model {arch}, {_describe(fields)}"
  pair = f"jax {jax_impl} vs torch {torch_impl}"
  out = [Comparison(group, "loss", pair, np.float64(got.loss), np.float64(want.loss),
                    Tolerance(rtol=MODEL_RTOL, atol=0.0))]
  assert got.grads.keys() == want.grads.keys(), sorted(got.grads.keys() ^ want.grads.keys())
  model_scale = max(float(np.abs(g).max()) for g in want.grads.values())
  for path, expected in sorted(want.grads.items()):
    scale = float(np.abs(expected).max())
    assert scale > 0, f"{group}: {path} has no gradient; the test would be vacuous"
    if scale < _ZERO_GRADIENT * model_scale:
      scale = model_scale
    out.append(Comparison(group, "parameter gradients", f"{path}: {pair}", got.grads[path],
                          expected, Tolerance(rtol=0.0, atol=MODEL_RTOL), scale=scale))
  assert got.output_grads.keys() == want.output_grads.keys(), (
    sorted(got.output_grads.keys() ^ want.output_grads.keys()))
  for path in sorted(want.output_grads):
    out.append(_kept_rows(group, f"{path}: {pair}",
                          *_decided_kept_rows(got.output_grads[path], want.output_grads[path],
                                              fields)))
  return out


def _decided_kept_rows(dy_a: np.ndarray, dy_b: np.ndarray,
                       fields: PolicyFields) -> tuple[np.ndarray, np.ndarray]:
  """The rows of one layer each framework keeps, on the rows whose fate does not hinge on
  rounding: under a zero threshold, rows that are noise-level (below ``_ZERO_ROW`` of the
  layer's largest score) in one framework and not exactly zero in both are left out."""
  keep_a, keep_b = (reference.keep_mask(dy, *fields) for dy in (dy_a, dy_b))
  decided = np.ones(len(keep_a), bool)
  if fields[0] == 0:
    scores_a, scores_b = (np.abs(dy.astype(np.float64)).max(axis=1) for dy in (dy_a, dy_b))
    noise = _ZERO_ROW * max(scores_a.max(), scores_b.max())
    both_zero = (scores_a == 0) & (scores_b == 0)
    decided = both_zero | ((scores_a > noise) & (scores_b > noise))
  return keep_a[decided], keep_b[decided]


# ---------------------------------------------------------------------------------------------
# Training: 20 AdamW steps on real text

TRAINING_STEPS, TRAINING_BATCH, TRAINING_LENGTH = 20, 8, 128
# torch.optim.AdamW and optax.adamw compute the same update with these values: eps added to
# sqrt(v_hat) (eps_root = 0), decoupled decay lr * wd * p on every parameter (no mask).
ADAMW = dict(learning_rate=1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)
# Per-step loss, relative. Float32 summation order differs between frameworks (and between the
# dense and SEBP backward); over 20 steps the drift measured on CPU is below 1e-6.
TRAINING_RTOL = 1e-5
TRAINING_TASKS = {"bert": "rotten_tomatoes", "llama": "piqa"}


# The training batches, tokenized once from the bundled text (:func:`export_training_data`): the
# GPU machine has neither `datasets` nor the data packages, and the file is what makes the
# training level run there. test_training_parity checks it against the bundled text.
TRAINING_DATA_FILE = pathlib.Path(__file__).resolve().parent / "data" / "training_batches.npz"


def tokenize_training_text(arch: str) -> dict[str, np.ndarray]:
  """``input_ids``, ``attention_mask``, ``labels`` ``(TRAINING_STEPS * TRAINING_BATCH,
  TRAINING_LENGTH)`` (``labels`` ``(rows,)`` for BERT) and ``vocab_size``, from the bundled text.

  Tokenized by the bundled MiniLM WordPiece tokenizer (it loads in a second; SmolLM2's GGUF
  tokenizer takes ten), padded to ``TRAINING_LENGTH``, and the token ids renumbered to the ones
  that occur (padding stays 0): a vocabulary of about 2k instead of 30k keeps the embedding, the
  LM head and the optimizer small on CPU without changing the text. Needs ``datasets`` and the
  data packages (``make install``).
  """
  from sebp_jax import data

  rows = TRAINING_STEPS * TRAINING_BATCH
  train = data.split(data.load_task(TRAINING_TASKS[arch]), seed=0)["train"].select(range(rows))
  tokens = data.tokenize(train, data.bundled_tokenizer("minilm"), TRAINING_LENGTH,
                         causal_lm=arch == "llama")[:]
  used, ids = np.unique(tokens["input_ids"], return_inverse=True)
  assert used[0] == 0, "the padding id 0 must stay 0"
  ids = ids.reshape(tokens["input_ids"].shape).astype(np.int32)
  if arch == "llama":
    labels = np.where(tokens["attention_mask"] == 1, ids, tokens["labels"])
  else:
    labels = np.asarray(tokens["label"])
  return dict(input_ids=ids, attention_mask=tokens["attention_mask"].astype(np.int32),
              labels=labels.astype(np.int32), vocab_size=np.int32(len(used)))


def export_training_data(path: pathlib.Path = TRAINING_DATA_FILE) -> None:
  """Writes :data:`TRAINING_DATA_FILE` (both architectures) from the bundled text."""
  path.parent.mkdir(parents=True, exist_ok=True)
  np.savez_compressed(path, **{f"{arch}/{key}": value
                               for arch in TRAINING_TASKS
                               for key, value in tokenize_training_text(arch).items()})


def read_training_data(arch: str, path: pathlib.Path = TRAINING_DATA_FILE) -> dict[str, np.ndarray]:
  """What :func:`tokenize_training_text` gives for ``arch``, read from ``path``."""
  with np.load(path) as stored:
    return {key.split("/", 1)[1]: stored[key] for key in stored.files
            if key.startswith(f"{arch}/")}


@functools.cache
def _training_data(arch: str) -> tuple[int, tuple[dict[str, np.ndarray], ...]]:
  """``(vocab_size, batches)``: ``TRAINING_STEPS`` batches of real text in a fixed order."""
  text = read_training_data(arch)
  batches = tuple({key: text[key][i:i + TRAINING_BATCH]
                   for key in ("input_ids", "attention_mask", "labels")}
                  for i in range(0, TRAINING_STEPS * TRAINING_BATCH, TRAINING_BATCH))
  return int(text["vocab_size"]), batches


def _training_batches(arch: str) -> tuple[dict[str, np.ndarray], ...]:
  return _training_data(arch)[1]


def _hf_training_model(arch: str) -> torch.nn.Module:
  """A small random model (2 layers, hidden 64) over the training text's tokens, no dropout."""
  import transformers

  torch.manual_seed(0)
  vocab = _training_data(arch)[0]
  if arch == "bert":
    return transformers.BertForSequenceClassification(transformers.BertConfig(
      vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
      intermediate_size=128, max_position_embeddings=TRAINING_LENGTH, num_labels=2,
      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
  return transformers.LlamaForCausalLM(transformers.LlamaConfig(
    vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=TRAINING_LENGTH,
    tie_word_embeddings=True, pad_token_id=0))


def jax_train_step(
  loss_fn: Callable[[Any, dict[str, jax.Array]], jax.Array],
  optimizer: optax.GradientTransformation,
  policy: sebp_jax.RowPolicy | None,
  impl: str = "auto",
) -> Callable[[Any, Any, dict[str, jax.Array]], tuple[Any, Any, jax.Array]]:
  """A jitted ``step(params, opt_state, batch) -> (params, opt_state, loss)``.

  Args:
    loss_fn: ``loss_fn(params, batch)``, a scalar.
    optimizer: the optax transformation.
    policy: the SEBP policy of every ``nn.Dense`` (and ``Embed.attend``); ``None``: dense.
    impl: the SEBP backend.
  """

  def step(params, opt_state, batch):
    # swap_dense acts at trace time, so it belongs inside the traced function.
    swap = (contextlib.nullcontext() if policy is None
            else sebp_jax.swap_dense(policy, impl=impl))
    with swap:
      loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(step)


def _jax_training_loss_fn(arch: str, module: nn.Module) -> Callable:
  def loss_fn(params, batch):
    logits = module.apply(params, batch["input_ids"], batch["attention_mask"])
    if arch == "llama":
      return causal_lm_loss(logits, batch["labels"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

  return loss_fn


@functools.cache
def jax_training_losses(arch: str, policy: PolicyFields | None, impl: str = "xla") -> np.ndarray:
  """``(TRAINING_STEPS,)`` float64 losses of optax AdamW on the flax import of the HF model."""
  module, params = from_hf(_hf_training_model(arch))
  optimizer = optax.adamw(**ADAMW)
  step = jax_train_step(_jax_training_loss_fn(arch, module), optimizer,
                        None if policy is None else _jax_policy(policy), impl)
  opt_state, losses = optimizer.init(params), []
  with jax.default_matmul_precision("highest"):
    for batch in _training_batches(arch):
      params, opt_state, loss = step(params, opt_state, batch)
      losses.append(float(loss))
  return np.asarray(losses)


@functools.cache
def torch_training_losses(arch: str, policy: PolicyFields | None,
                          impl: str = "torch") -> np.ndarray:
  """``(TRAINING_STEPS,)`` float64 losses of ``torch.optim.AdamW`` on the HF model, whose own
  loss (``labels=``) is the objective."""
  device = _torch_device(impl)
  model = _hf_training_model(arch).to(device)
  if policy is not None:
    sebp_torch_ref.apply_sebp(model, _torch_policy(policy), impl=impl)
  optimizer = torch.optim.AdamW(
    model.parameters(), lr=ADAMW["learning_rate"], betas=(ADAMW["b1"], ADAMW["b2"]),
    eps=ADAMW["eps"], weight_decay=ADAMW["weight_decay"])
  losses = []
  for batch in _training_batches(arch):
    inputs = {k: torch.from_numpy(v).long().to(device) for k, v in batch.items()}
    loss = model(**inputs).loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
  return np.asarray(losses)


@functools.cache
def _torch_untrained_losses(arch: str) -> np.ndarray:
  """``(TRAINING_STEPS,)`` losses of the initial model on the training batches: what the losses
  would be if the optimizer did nothing."""
  model = _hf_training_model(arch)
  with torch.no_grad():
    return np.asarray([
      model(**{k: torch.from_numpy(v).long() for k, v in batch.items()}).loss.item()
      for batch in _training_batches(arch)])


def training_comparisons(
  arch: str, policy: str = "exact", jax_impl: str = "xla", torch_impl: str = "torch"
) -> list[Comparison]:
  """Per-step losses of 20 AdamW steps: JAX vs torch, dense and SEBP, and SEBP vs dense.

  Args:
    arch: ``"bert"`` (a 2-layer classifier on Rotten Tomatoes) or ``"llama"`` (a 2-layer causal
      LM with tied embeddings on PIQA).
    policy: the SEBP policy of both frameworks (the exact one: the four runs must agree).
    jax_impl, torch_impl: the SEBP backends.

  Returns:
    jax-dense vs torch-dense, jax-SEBP vs torch-SEBP, jax-SEBP vs jax-dense, torch-SEBP vs
    torch-dense, each within :data:`TRAINING_RTOL` at every step.
  """
  if arch not in TRAINING_TASKS:
    raise ValueError(
      f"training_comparisons: arch must be in {tuple(TRAINING_TASKS)}, got {arch!r}.")
  fields = POLICIES[policy]
  jax_dense = jax_training_losses(arch, None)
  jax_sebp = jax_training_losses(arch, fields, jax_impl)
  torch_dense = torch_training_losses(arch, None, torch_impl)
  torch_sebp = torch_training_losses(arch, fields, torch_impl)
  # The comparison would be vacuous if the updates did not move the losses well past the tolerance.
  moved = relative_error(torch_dense, _torch_untrained_losses(arch))
  assert moved > 100 * TRAINING_RTOL, f"{arch}: training moved the losses by {moved:.2g} only"
  group = f"training {arch} on {TRAINING_TASKS[arch]}, SEBP {_describe(fields)}"
  tol = Tolerance(rtol=TRAINING_RTOL, atol=0.0)
  cases = [("jax-dense vs torch-dense", jax_dense, torch_dense),
           (f"jax-SEBP ({jax_impl}) vs torch-SEBP ({torch_impl})", jax_sebp, torch_sebp),
           ("jax-SEBP vs jax-dense", jax_sebp, jax_dense),
           ("torch-SEBP vs torch-dense", torch_sebp, torch_dense)]
  return [Comparison(group, "per-step loss", name, a, b, tol) for name, a, b in cases]


if __name__ == "__main__":  # python -m parity_tests.comparisons: remake the training data file
  export_training_data()
  print(f"wrote {TRAINING_DATA_FILE}")
