"""Fine-tuning with the SEBP backward against the dense baseline: what ``sebp finetune`` and
``sebp analyze`` run, importable without the command line.

:func:`finetune` trains one model on one task with optax AdamW: the SEBP variant (every
``nn.Dense`` swapped by :func:`sebp_jax.swap_dense`), and with ``compare=True`` the dense baseline
from the same initialisation, data order and dropout masks. It then times forward and backward of
both on the same batches, measures the gradient row sparsity (:mod:`sebp_jax.analysis`) and writes
a run folder::

  config.json        the configuration (``resume`` reads it back)
  metrics.jsonl      one record per training step, evaluation and summary
  report.md          summary, sparsity table and figures
  loss_curves.png    training loss, dense vs SEBP
  row_sparsity.png   output-gradient heatmaps (the paper's Figure 2)
  grad_histogram.png |dY| histogram with the calibrated eps (the paper's Figure 3)
  checkpoints/<variant>/  parameters and optimizer state (orbax)

Every training step has the same shapes (batches padded to ``max_length``), so the jitted step is
traced once whatever the padding: the summary reports the trace count.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import resource
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util
from jax.sharding import NamedSharding, PartitionSpec as P

from sebp_jax import analysis, data
from sebp_jax.batch_crossover import above_crossover
from sebp_jax.linen import swap_dense
from sebp_jax.matmul import IMPLS, resolve_impl
from sebp_jax.models import (BertConfig, BertForSequenceClassification, LlamaConfig,
                             LlamaForCausalLM, causal_lm_loss, from_pretrained)
from sebp_jax.plan import row_plan
from sebp_jax.policy import RowPolicy
from sebp_jax.sharding import fsdp_spec, sharded_rows

__all__ = ["UsageError", "ModelSpec", "MODELS", "TASKS", "DTYPES", "FinetuneConfig",
           "AnalyzeConfig", "parse_policy", "finetune", "analyze",
           "load_run_config"]

Params = dict[str, Any]
Batch = dict[str, np.ndarray]

# Truncating more than this fraction of the training examples is an error, not a warning.
MAX_TRUNCATED_FRACTION = 0.05
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
VARIANTS = ("sebp", "dense")  # training order; "dense" only with `compare`
# Options a resumed run may change: they do not define the training.
_MEASUREMENT_FIELDS = frozenset({"steps", "eval_examples", "timing_batches", "analysis_batches"})


class UsageError(ValueError):
  """Input the user can fix; the message (one line) says how."""


# ------------------------------------------------------------------------------------------------
# Models


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """A model the command line can fine-tune.

  Attributes:
    kind: ``"classifier"`` (sequence classification head, cross-entropy on the label) or
      ``"causal_lm"`` (next-token loss on the text, padding labelled ``-100``).
    load: ``(model_path or None, num_labels, dtype) -> (module, params)``; ``num_labels`` is
      ignored by causal LMs.
    tokenizer: ``model_path or None -> tokenizer`` (a ``transformers`` tokenizer with a pad token).
    weights: how the weights are obtained, for the report.
  """

  kind: str
  load: Callable[[Path | None, int, Any], tuple[nn.Module, Params]]
  tokenizer: Callable[[Path | None], Any]
  weights: str


def _graft(params: Params, subtree: str, pretrained: Params) -> Params:
  """``params`` with the leaves under ``subtree`` replaced by those ``pretrained`` holds."""
  flat = traverse_util.flatten_dict(params["params"])
  for path, value in traverse_util.flatten_dict(pretrained["params"]).items():
    flat[(subtree, *path)] = value
  return {"params": traverse_util.unflatten_dict(flat)}


def _bert_classifier(default_checkpoint: Callable[[], Path] | None, random_config: BertConfig):
  """Loader of a BERT classifier: a pretrained encoder (``--model-path`` or the default
  checkpoint) under a new classification head, or ``random_config`` with random weights."""

  def load(model_path: Path | None, num_labels: int, dtype: Any):
    checkpoint = model_path or (default_checkpoint() if default_checkpoint else None)
    ids = jnp.zeros((1, 2), jnp.int32)
    if checkpoint is None:
      module = BertForSequenceClassification(
        dataclasses.replace(random_config, num_labels=num_labels), dtype=dtype, param_dtype=dtype)
      return module, jax.jit(module.init)(jax.random.key(0), ids)
    encoder, encoder_params = from_pretrained(checkpoint, architecture="BertModel", dtype=dtype,
                                              param_dtype=dtype)
    module = BertForSequenceClassification(
      dataclasses.replace(encoder.config, num_labels=num_labels), dtype=dtype, param_dtype=dtype)
    # The head (and a pooler the checkpoint lacks) starts from the module's own init.
    params = jax.jit(module.init)(jax.random.key(0), ids)
    return module, _graft(params, "bert", encoder_params)

  return load


def _llama(default_checkpoint: Callable[[], Path] | None, random_config: LlamaConfig | None):
  def load(model_path: Path | None, num_labels: int, dtype: Any):
    checkpoint = model_path or (default_checkpoint() if default_checkpoint else None)
    if checkpoint is not None:
      return from_pretrained(checkpoint, dtype=dtype, param_dtype=dtype)
    module = LlamaForCausalLM(random_config, dtype=dtype, param_dtype=dtype)
    return module, jax.jit(module.init)(jax.random.key(0), jnp.zeros((1, 2), jnp.int32))

  return load


def _tokenizer(bundled: str, *, needs_own: bool):
  """Tokenizer of ``--model-path`` when it holds one, else the bundled checkpoint's. A model
  with random weights only needs ids below its vocabulary size, so any tokenizer of a smaller
  vocabulary serves (``needs_own=False``)."""

  def load(model_path: Path | None):
    from transformers import AutoTokenizer

    if model_path is not None:
      if model_path.suffix == ".gguf":
        tokenizer = AutoTokenizer.from_pretrained(model_path.parent, gguf_file=model_path.name)
      elif any((model_path / f).is_file() for f in ("tokenizer.json", "vocab.txt",
                                                    "tokenizer.model")):
        tokenizer = AutoTokenizer.from_pretrained(model_path)
      elif needs_own:
        raise UsageError(
          f"--model-path {model_path} has no tokenizer (tokenizer.json, vocab.txt or "
          "tokenizer.model): copy the checkpoint's tokenizer files into it.")
      else:
        tokenizer = data.bundled_tokenizer(bundled)
    else:
      tokenizer = data.bundled_tokenizer(bundled)
    if tokenizer.pad_token is None:  # LLaMA tokenizers have none; the label mask hides it
      tokenizer.pad_token = tokenizer.eos_token
    return tokenizer

  return load


MODELS: dict[str, ModelSpec] = {
  "minilm": ModelSpec(
    "classifier", _bert_classifier(lambda: data.bundled_checkpoint_path("minilm"), BertConfig()),
    _tokenizer("minilm", needs_own=False), "all-MiniLM-L6-v2 (bundled, pretrained)"),
  "bert-base": ModelSpec(
    "classifier", _bert_classifier(None, BertConfig.bert_base()),
    _tokenizer("minilm", needs_own=True), "bert-base config, random weights"),
  "smollm2": ModelSpec(
    "causal_lm", _llama(lambda: data.bundled_checkpoint_path("smollm2"), None),
    _tokenizer("smollm2", needs_own=True), "SmolLM2-135M-Instruct (bundled GGUF, pretrained)"),
  "llama-3.2-3b": ModelSpec(
    "causal_lm", _llama(None, LlamaConfig.llama_3_2_3b()),
    _tokenizer("smollm2", needs_own=True), "Llama-3.2-3B config, random weights"),
}

# Command-line task name -> sebp_jax.data task name.
TASKS: dict[str, str] = {name.replace("_", "-"): name for name in data.TASKS}


# ------------------------------------------------------------------------------------------------
# Configuration


def parse_policy(text: str) -> RowPolicy:
  """``"exact"``, ``"threshold=EPS"``, ``"max-rows=K"`` or both joined by a comma."""
  if text == "exact":
    return RowPolicy()
  fields: dict[str, Any] = {}
  try:
    for item in text.split(","):
      key, sep, value = item.partition("=")
      field = {"threshold": "threshold", "max-rows": "max_rows"}.get(key)
      if field is None or not sep or field in fields:
        raise ValueError(f"unexpected {item!r}")
      fields[field] = float(value) if field == "threshold" else int(value)
    return RowPolicy(**fields)
  except (TypeError, ValueError) as e:
    raise UsageError(
      f"--policy {text!r} is not exact, threshold=EPS (EPS >= 0), max-rows=K (K >= 1) or "
      f"threshold=EPS,max-rows=K ({e})") from None


@dataclasses.dataclass(frozen=True)
class _DataConfig:
  model: str
  task: str
  model_path: str | None = None
  max_length: int = 64
  batch_size: int = 16
  dtype: str = "float32"
  seed: int = 0

  def __post_init__(self):
    if self.model not in MODELS:
      raise UsageError(f"unknown --model {self.model!r}; choose one of {', '.join(MODELS)}")
    if self.task not in TASKS:
      raise UsageError(f"unknown --task {self.task!r}; choose one of {', '.join(TASKS)}")
    for flag, value, low in (("--max-length", self.max_length, 2),
                             ("--batch-size", self.batch_size, 1)):
      if value < low:
        raise UsageError(f"{flag} must be at least {low}, got {value}")
    if self.dtype not in DTYPES:
      raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")


@dataclasses.dataclass(frozen=True)
class FinetuneConfig(_DataConfig):
  """What :func:`finetune` runs. Field names follow the command-line flags.

  Attributes:
    model: a key of :data:`MODELS`.
    task: a key of :data:`TASKS`.
    model_path: weights (a checkpoint folder or ``.gguf`` file) instead of the model's default.
    max_length: every sequence is padded (or truncated) to this many tokens.
    batch_size: sequences per step.
    steps: optimizer steps per variant (with ``resume``: in total).
    learning_rate: AdamW learning rate, reached by a linear warm-up.
    warmup_steps: steps of the warm-up.
    weight_decay: AdamW weight decay.
    policy: the SEBP row policy, as ``--policy`` text.
    impl: the SEBP backend (``"auto"``: Pallas on GPU, XLA elsewhere).
    compare: also train the dense baseline.
    devices: local devices to train on, data parallel over a mesh axis ``"data"`` (the batch
      split evenly); ``None``: every local device.
    fsdp: also shard parameters and optimizer state over the devices (each array along its
      largest dim that divides evenly), gathered for use and reduce-scattered back by XLA.
    eval_examples: size of the fixed held-out subset (rounded down to whole batches).
    timing_batches: batches timed for the forward/backward times (after one warm-up); 0: none.
    analysis_batches: batches whose output gradients are analysed; 0: none.
    dtype: parameter and computation dtype.
    seed: initialisation of new heads, data order and dropout.
  """

  steps: int = 60
  learning_rate: float = 1e-4
  warmup_steps: int = 10
  weight_decay: float = 0.01
  policy: str = "exact"
  impl: str = "auto"
  compare: bool = False
  devices: int | None = None
  fsdp: bool = False
  eval_examples: int = 512
  timing_batches: int = 3
  analysis_batches: int = 2

  def __post_init__(self):
    super().__post_init__()
    parse_policy(self.policy)
    if self.impl not in IMPLS:
      raise UsageError(f"--impl must be one of {', '.join(IMPLS)}, got {self.impl!r}")
    for flag, value, low in (("--steps", self.steps, 1), ("--eval-examples", self.eval_examples, 1),
                             ("--timing-batches", self.timing_batches, 0),
                             ("--analysis-batches", self.analysis_batches, 0),
                             ("--warmup-steps", self.warmup_steps, 0),
                             ("--devices", 1 if self.devices is None else self.devices, 1)):
      if value < low:
        raise UsageError(f"{flag} must be at least {low}, got {value}")
    if not self.learning_rate > 0:
      raise UsageError(f"--learning-rate must be positive, got {self.learning_rate}")


@dataclasses.dataclass(frozen=True)
class AnalyzeConfig(_DataConfig):
  """What :func:`analyze` runs: :class:`FinetuneConfig`'s data fields, and ``batches``, the
  number of training batches whose output gradients are measured."""

  batches: int = 4

  def __post_init__(self):
    super().__post_init__()
    if self.batches < 1:
      raise UsageError(f"--batches must be at least 1, got {self.batches}")


# ------------------------------------------------------------------------------------------------
# Data and losses


@dataclasses.dataclass
class _Setup:
  """A loaded model and its tokenized data."""

  spec: ModelSpec
  module: nn.Module
  params: Params
  train: Batch  # (n, T) arrays and (n,) labels or (n, T) LM labels
  validation: Batch
  length_stats: dict[str, float]
  truncated: int
  loss: Callable[[Params, Batch, jax.Array | None], jax.Array]  # rng None: no dropout

  def batch(self, step: int, batch_size: int, seed: int) -> Batch:
    """Training batch ``step`` of a fixed order: a new permutation each epoch, no partial
    batches. A function of ``step`` alone, so dense, SEBP and resumed runs see the same data."""
    n = len(self.train["labels"])
    per_epoch = n // batch_size
    epoch, index = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(n)
    rows = order[index * batch_size:(index + 1) * batch_size]
    return {k: v[rows] for k, v in self.train.items()}


def _texts(task: str, kind: str, dataset):
  """The text and labels each model kind trains on: classifiers read the text (the prompt and
  its options for a multiple-choice task) and predict the label; causal LMs read the whole
  example (a classification example followed by its label's name)."""
  multiple_choice = "prompt" in dataset.column_names
  if kind == "classifier":
    return dataset["prompt" if multiple_choice else "text"]
  if multiple_choice:
    return dataset["text"]
  names = data.LABEL_NAMES[task]
  return [f"{text}\nLabel: {names[label]}" for text, label in zip(dataset["text"],
                                                                 dataset["label"])]


def _classifier_loss(module: nn.Module):
  def loss(params: Params, batch: Batch, rng: jax.Array | None) -> jax.Array:
    logits = module.apply(params, batch["input_ids"], batch["attention_mask"],
                          deterministic=rng is None, right_padded=True,
                          rngs=None if rng is None else {"dropout": rng})
    return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), batch["labels"]).mean()

  return loss


def _causal_lm_loss(module: nn.Module):
  def loss(params: Params, batch: Batch, rng: jax.Array | None) -> jax.Array:
    logits = module.apply(params, batch["input_ids"], batch["attention_mask"],
                          deterministic=rng is None, right_padded=True,
                          rngs=None if rng is None else {"dropout": rng})
    return causal_lm_loss(logits, batch["labels"])

  return loss


def _prepare(config: _DataConfig, *, log: Callable[[str], None]) -> _Setup:
  import datasets

  datasets.disable_progress_bars()
  spec = MODELS[config.model]
  model_path = None if config.model_path is None else Path(config.model_path)
  if model_path is not None and not model_path.exists():
    raise UsageError(f"--model-path {model_path} does not exist")
  task = TASKS[config.task]
  dataset = data.load_task(task)
  parts = data.split(dataset, seed=config.seed)
  tokenizer = spec.tokenizer(model_path)
  causal = spec.kind == "causal_lm"
  arrays = {}
  for name, part in parts.items():
    part = datasets.Dataset.from_dict({"text": _texts(task, spec.kind, part),
                                       "label": part["label"]})
    tokenized = data.tokenize(part, tokenizer, config.max_length, causal_lm=causal)[:]
    arrays[name] = {
      "input_ids": tokenized["input_ids"], "attention_mask": tokenized["attention_mask"],
      "labels": tokenized["labels"] if causal else tokenized["label"].astype(np.int32),
      "length": tokenized["length"]}
  lengths = arrays["train"].pop("length")
  arrays["validation"].pop("length")
  truncated = int(np.sum(lengths > config.max_length))
  stats = data.token_length_stats(lengths, config.max_length)
  if truncated > MAX_TRUNCATED_FRACTION * len(lengths):
    needed = int(np.ceil(np.percentile(lengths, 99)))
    raise UsageError(
      f"--max-length {config.max_length} truncates {truncated} of {len(lengths)} training "
      f"examples ({truncated / len(lengths):.0%}); pass --max-length {needed} or more "
      f"(the 99th percentile of the token lengths)")
  if len(lengths) < config.batch_size:
    raise UsageError(f"--batch-size {config.batch_size} exceeds the {len(lengths)} training "
                     f"examples of {config.task}; pass a smaller --batch-size")
  num_labels = int(max(dataset["label"])) + 1
  log(f"loading {config.model} ({spec.weights})")
  try:
    module, params = spec.load(model_path, num_labels, DTYPES[config.dtype])
  except (OSError, ValueError) as e:  # unreadable or mismatched checkpoint files
    raise UsageError(
      f"cannot load the {config.model} weights"
      f"{'' if model_path is None else f' from {model_path}'}: {_first_line(e)}; pass a "
      f"valid checkpoint folder or .gguf file with --model-path") from None
  vocab = module.config.vocab_size
  if len(tokenizer) > vocab:
    raise UsageError(f"the tokenizer has {len(tokenizer)} tokens but {config.model} only "
                     f"{vocab}: give --model-path a checkpoint with its own tokenizer")
  loss = (_causal_lm_loss if causal else _classifier_loss)(module)
  return _Setup(spec, module, params, arrays["train"], arrays["validation"], stats, truncated,
                loss)


def _first_line(error: BaseException) -> str:
  text = str(error).strip().splitlines()
  return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


# ------------------------------------------------------------------------------------------------
# Training


def _optimizer(config: FinetuneConfig) -> optax.GradientTransformation:
  # Independent of `steps`, so that a resumed run continues exactly as an uninterrupted one.
  schedule = (optax.linear_schedule(0.0, config.learning_rate, config.warmup_steps)
              if config.warmup_steps else optax.constant_schedule(config.learning_rate))
  return optax.adamw(schedule, weight_decay=config.weight_decay)


@dataclasses.dataclass(frozen=True)
class _Placement:
  """Where a run's arrays live: a 1-D mesh ``"data"`` over the devices; batches split along it,
  parameters and optimizer state replicated (data parallel) or sharded too (``fsdp``)."""

  mesh: jax.sharding.Mesh
  fsdp: bool

  @classmethod
  def of(cls, config: "FinetuneConfig") -> "_Placement":
    available = jax.local_device_count()
    count = available if config.devices is None else config.devices
    if count > available:
      raise UsageError(f"--devices {count} exceeds the {available} local devices; pass "
                       f"--devices {available} or fewer")
    if config.batch_size % count:
      raise UsageError(f"--batch-size {config.batch_size} does not split evenly over {count} "
                       f"devices; pass a multiple of {count}")
    return cls(jax.make_mesh((count,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                             devices=jax.local_devices()[:count]), config.fsdp)

  @property
  def devices(self) -> int:
    return self.mesh.size

  def describe(self) -> str:
    how = "FSDP (parameters and optimizer state sharded)" if self.fsdp else "data parallel"
    return f"mesh data={self.devices}, {how}"

  def _state_sharding(self, leaf) -> NamedSharding:
    if not self.fsdp:
      return NamedSharding(self.mesh, P())
    return NamedSharding(self.mesh, fsdp_spec(jnp.shape(leaf), "data", self.devices))

  def state(self, tree):
    """``tree`` (parameters, optimizer state) placed on the mesh."""
    return jax.tree.map(lambda leaf: jax.device_put(leaf, self._state_sharding(leaf)), tree)

  def batch(self, batch: Batch):
    """``batch`` split along its first dim over the devices."""
    return jax.device_put(batch, NamedSharding(self.mesh, P("data")))

  def rows(self) -> contextlib.AbstractContextManager:
    """The SEBP layers' row sharding: the batch dim over ``"data"`` (on one device, none)."""
    if self.devices == 1:
      return contextlib.nullcontext()
    return sharded_rows("data", mesh=self.mesh)


def _grad_fn(loss, policy: RowPolicy | None, impl: str, placement: _Placement):
  """``value_and_grad(loss)``, with every Dense swapped to SEBP unless ``policy`` is None; each
  device runs the SEBP backward of its own rows.

  With the exact policy the program has no conditional (``crossover=1.0``: :class:`_Steps`
  decides dense or SEBP per batch on the host) and the layers share the batch's attention mask
  as their row plan (no layer reads its ``dy`` to find the real tokens; with the rows sharded,
  each device plans its own). Other policies decide per layer."""
  exact = policy == RowPolicy()

  def value_and_grad(params, batch, rng):
    if policy is None:
      return jax.value_and_grad(loss)(params, batch, rng)
    plan = row_plan(batch["attention_mask"]) if exact else None
    # Both apply to what is traced inside.
    with swap_dense(policy, impl=impl, crossover=1.0 if exact else None, rows=plan), \
        placement.rows():
      return jax.value_and_grad(loss)(params, batch, rng)

  return value_and_grad


class _Steps:
  """A variant's jitted functions of ``(params or state, batch, rng)``, and which one a batch
  runs: for SEBP with the exact policy through the Pallas kernels, the dense one where the
  batch's real-token fraction is past the crossover (:func:`sebp_jax.above_crossover`, on the
  host batch), else the SEBP one; otherwise the only one (the XLA backend switches to its dense
  branch by itself, per layer). ``make(policy)`` jits the function for ``policy``; each is made
  (and traced) on first use."""

  def __init__(self, make: Callable[[RowPolicy | None], Callable], policy: RowPolicy | None,
               impl: str):
    self._make, self._policy, self._jitted = make, policy, {}
    self._host_crossover = policy == RowPolicy() and impl != "xla"

  def for_batch(self, batch: Batch) -> Callable:
    policy = self._policy
    if self._host_crossover and above_crossover(np.mean(batch["attention_mask"] != 0)):
      policy = None
    if policy not in self._jitted:
      self._jitted[policy] = self._make(policy)
    return self._jitted[policy]


def _make_train_step(loss, optimizer, policy: RowPolicy | None, impl: str,
                     placement: _Placement, traces: list[None]):
  """The jitted step ``(state, batch, rng) -> (state, loss)`` (``state`` donated); each of its
  traces appends to ``traces``."""
  value_and_grad = _grad_fn(loss, policy, impl, placement)

  def step(state, batch, rng):
    traces.append(None)  # runs at trace time only
    value, grads = value_and_grad(state["params"], batch, rng)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    return {"step": state["step"] + 1, "params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state}, value

  return jax.jit(step, donate_argnums=0)


@contextlib.contextmanager
def _out_of_memory_is_usage_error(config: _DataConfig) -> Iterator[None]:
  """Turns XLA's out-of-memory error (at compile or run time) into a :class:`UsageError`."""
  try:
    yield
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
      raise
    raise UsageError(
      f"a batch of {config.batch_size} x {config.max_length} tokens of {config.model} does not "
      f"fit in {jax.devices()[0].platform.upper()} memory; lower --batch-size or --max-length"
    ) from None


def _peak_memory() -> tuple[str, int]:
  """``(what, bytes)``: the device's peak allocation on GPU, else the process's peak RSS."""
  stats = jax.devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    return "device peak", int(stats["peak_bytes_in_use"])
  return "host peak RSS", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _checkpointer():
  import orbax.checkpoint as ocp

  return ocp.StandardCheckpointer()


def _restore(path: Path, like: dict) -> dict:
  try:
    return _checkpointer().restore(path.resolve(), jax.eval_shape(lambda: like))
  except Exception as e:  # orbax raises whatever its readers do on damaged files
    raise UsageError(
      f"the checkpoint {path} cannot be read ({_first_line(e)}); delete it to retrain that "
      f"variant, or start a new run without --resume") from None


def _save(path: Path, state: dict) -> None:
  checkpointer = _checkpointer()
  checkpointer.save(path.resolve(), state, force=True)
  checkpointer.wait_until_finished()


def _dropout_key(seed: int, step: int) -> jax.Array:
  return jax.random.fold_in(jax.random.key(seed), step)


def _train(config, setup, variant, run_dir, metrics, log, placement) -> dict[str, Any]:
  """Trains ``variant`` up to ``config.steps`` (from its checkpoint when resuming)."""
  from tqdm.auto import tqdm

  policy = parse_policy(config.policy) if variant == "sebp" else None
  optimizer = _optimizer(config)
  traces: list[None] = []
  impl = resolve_impl(config.impl)
  steps = _Steps(lambda chosen: _make_train_step(setup.loss, optimizer, chosen, impl, placement,
                                                 traces), policy, impl)
  state = {"step": jnp.int32(0), "params": setup.params,
           "opt_state": optimizer.init(setup.params)}
  checkpoint = run_dir / "checkpoints" / variant
  if checkpoint.exists():
    state = _restore(checkpoint, state)
    log(f"{variant}: resumed at step {int(state['step'])} from {checkpoint}")
  state = placement.state(jax.tree.map(jnp.array, state))  # own copies: the step donates them
  start = int(state["step"])
  times = []
  bar = tqdm(total=config.steps, initial=start, desc=f"{variant:>5}", unit="step",
             dynamic_ncols=True, disable=None)
  with bar:
    for step in range(start, config.steps):
      batch = setup.batch(step, config.batch_size, config.seed)
      began = time.perf_counter()
      state, loss = steps.for_batch(batch)(state, placement.batch(batch),
                                           _dropout_key(config.seed, step))
      loss = float(loss)  # synchronises: the step time is the device time
      times.append(time.perf_counter() - began)
      metrics.write({"variant": variant, "step": step + 1, "loss": loss,
                     "step_time_s": times[-1]})
      bar.set_postfix(loss=f"{loss:.4f}", step_ms=f"{times[-1] * 1e3:.0f}")
      bar.update()
  if times:
    _save(checkpoint, state)
  # The first step of a session includes compilation; the rest are steady state.
  steady = times[1:] or times
  return {"params": state["params"], "traces": len(traces), "steps_run": len(times),
          "step_ms": statistics.median(steady) * 1e3 if steady else None,
          "memory": _peak_memory()}


def _evaluate(config: _DataConfig, setup: _Setup, params: Params,
              eval_examples: int) -> dict[str, float]:
  """Held-out accuracy (classifiers) or mean token loss (causal LMs) on a fixed subset."""
  n = min(eval_examples, len(setup.validation["labels"]))
  batches = max(1, n // config.batch_size)
  if setup.spec.kind == "classifier":
    @jax.jit
    def metric(params, batch):
      logits = setup.module.apply(params, batch["input_ids"], batch["attention_mask"],
                                  right_padded=True)
      return jnp.mean(jnp.argmax(logits, -1) == batch["labels"])
    name = "accuracy"
  else:
    metric = jax.jit(lambda params, batch: setup.loss(params, batch, None))
    name = "loss"
  values = []
  for i in range(batches):
    rows = slice(i * config.batch_size, (i + 1) * config.batch_size)
    values.append(float(metric(params, {k: v[rows] for k, v in setup.validation.items()})))
  return {name: float(np.mean(values)), "examples": batches * config.batch_size}


def _time_ms(pick: Callable[[Batch], Callable], params, host_batches, placement: _Placement,
             rngs) -> float:
  """Median wall time of ``fn(params, batch, rng)`` over the batches, ``fn = pick(batch)`` (e.g.
  :meth:`_Steps.for_batch`), after one warm-up call of each function used."""
  fns = [pick(batch) for batch in host_batches]
  batches = [placement.batch(batch) for batch in host_batches]
  warmed = set()
  for fn, batch in zip(fns, batches):
    if fn not in warmed:
      jax.block_until_ready(fn(params, batch, rngs[0]))
      warmed.add(fn)
  samples = []
  for fn, batch, rng in zip(fns, batches, rngs):
    began = time.perf_counter()
    jax.block_until_ready(fn(params, batch, rng))
    samples.append(time.perf_counter() - began)
  return statistics.median(samples) * 1e3


def _timings(config: FinetuneConfig, setup: _Setup, params: Params,
             placement: _Placement) -> dict[str, dict]:
  """Forward and forward+backward times of the dense and the SEBP loss on the same batches and
  parameters; backward = the difference."""
  host_batches = [setup.batch(i, config.batch_size, config.seed)
                  for i in range(config.timing_batches)]
  rngs = [_dropout_key(config.seed, i) for i in range(config.timing_batches)]
  forward_fn = jax.jit(setup.loss)
  forward = _time_ms(lambda _: forward_fn, params, host_batches, placement, rngs)
  impl = resolve_impl(config.impl)
  out = {}
  for variant, policy in (("dense", None), ("sebp", parse_policy(config.policy))):
    steps = _Steps(lambda chosen: jax.jit(_grad_fn(setup.loss, chosen, impl, placement)), policy,
                   impl)
    both = _time_ms(steps.for_batch, params, host_batches, placement, rngs)
    out[variant] = {"forward_ms": forward, "backward_ms": max(both - forward, 0.0)}
  return out


# ------------------------------------------------------------------------------------------------
# Run folder


class _Metrics:
  """Appends JSON lines to ``metrics.jsonl``."""

  def __init__(self, path: Path):
    self.path = path

  def write(self, record: dict) -> None:
    with self.path.open("a") as f:
      f.write(json.dumps(record) + "\n")

  def read(self) -> Iterator[dict]:
    if self.path.exists():
      with self.path.open() as f:
        yield from (json.loads(line) for line in f if line.strip())


def _plot_losses(metrics: _Metrics, path: Path) -> Path:
  plt = analysis._pyplot()
  curves: dict[str, dict[int, float]] = {}
  for record in metrics.read():
    if "loss" in record and "step" in record:
      curves.setdefault(record["variant"], {})[record["step"]] = record["loss"]
  fig, ax = plt.subplots(figsize=(7, 4))
  for variant, curve in curves.items():
    steps = np.array(sorted(curve))
    losses = np.array([curve[s] for s in steps])
    line, = ax.plot(steps, losses, alpha=0.3, lw=0.8)
    window = max(1, len(losses) // 20)  # a moving average shows the trend under the noise
    if len(losses) >= window:
      smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
      ax.plot(steps[window - 1:], smooth, color=line.get_color(),
              label=f"{'SEBP' if variant == 'sebp' else 'dense'}")
  ax.set(xlabel="step", ylabel="training loss", title="Training loss: dense vs SEBP")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)
  return path


def _fmt_bytes(n: int) -> str:
  return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _summary_lines(config: FinetuneConfig, summary: dict) -> list[str]:
  """The summary table: one column per variant (dense timed even when not trained)."""
  runs, timing = summary["runs"], summary["timing"]
  variants = ("dense", "sebp")
  metric = next(iter(runs["sebp"]["eval"]))

  def run_cells(key: str, fmt: Callable[[Any], str]) -> tuple[str, ...]:
    return tuple(fmt(runs[v][key]) if runs.get(v, {}).get(key) is not None else "-"
                 for v in variants)

  table = [
    ("", "dense", "SEBP"),
    (f"held-out {metric}", *run_cells("eval", lambda e: f"{e[metric]:.4f}")),
    *((label, *(f"{timing[v][key]:.1f}" if timing else "-" for v in variants))
      for label, key in (("forward (ms)", "forward_ms"), ("backward (ms)", "backward_ms"))),
    ("train step (ms)", *run_cells("step_ms", lambda t: f"{t:.1f}")),
    ("compile count (step traces)", *run_cells("traces", str)),
    (summary["memory_kind"], *run_cells("memory", _fmt_bytes)),
  ]
  width = max(len(row[0]) for row in table)
  lines = [f"{row[0]:<{width}}  " + "  ".join(f"{c:>9}" for c in row[1:]) for row in table]
  if timing:
    lines.append(f"backward speedup of SEBP over dense: {summary['backward_speedup']:.2f}x "
                 f"(policy {config.policy}, impl {summary['impl']}, {summary['device']})")
  lines.append(f"devices: {summary['mesh']}")
  return lines


def _report(config: FinetuneConfig, run_dir: Path, summary: dict,
            figures: dict[str, Path]) -> Path:
  stats = summary["length_stats"]
  lines = [
    f"# SEBP fine-tuning: {config.model} on {config.task}", "",
    f"{summary['weights']}; {config.steps} AdamW steps of {config.batch_size} sequences padded "
    f"to {config.max_length} tokens (median length {stats['median']:.0f}, "
    f"{stats['real_token_fraction']:.0%} real tokens; {summary['truncated']} training examples "
    f"truncated); dtype {config.dtype}; device {summary['device']}; {summary['mesh']}; "
    f"XLA_FLAGS `{summary['xla_flags'] or '(none)'}`.", "",
    "```", *_summary_lines(config, summary), "```", "",
    "Forward and backward are medians over the same batches and parameters for both variants "
    "(backward = value_and_grad - forward); the train step time is the median over the training "
    "steps after the first. Peak memory is cumulative over the process (the SEBP variant trains "
    "first).", "",
  ]
  if summary["row_sparsity"] is not None:
    eps = summary["suggested_eps"]
    lines += [
      f"## Output-gradient row sparsity ({config.analysis_batches} batches, exact zeros)", "",
      "Fraction of the rows of each linear layer's output gradient that are entirely zero "
      "(the rows SEBP skips), per layer type over the layers of that type.", "",
      analysis.format_sparsity_table(summary["row_sparsity"]), "",
      f"Suggested eps (knee of the smoothed CDF of the row scores max|dY|, paper §3.1): "
      f"`{eps:.3g}`" + (" (no noise mode: the exact policy is right)" if eps == 0 else ""), ""]
  lines += [f"![{name}]({path.name})" for name, path in figures.items()]
  path = run_dir / "report.md"
  path.write_text("\n".join(lines) + "\n")
  return path


def _gradient_analysis(setup: _Setup, params: Params, batch_size: int, seed: int, batches: int,
                       out: Path | None) -> tuple[analysis.GradientStats, list[dict], float,
                                                   dict[str, Path]]:
  """Output-gradient statistics of ``batches`` training batches (no dropout), the sparsity
  table, the suggested eps and (with ``out``) the two figures."""
  stats = analysis.gradient_statistics(
    lambda p, b: setup.loss(p, b, None),
    ((params, setup.batch(i, batch_size, seed)) for i in range(batches)))
  eps = stats.suggested_threshold()
  figures = {}
  if out is not None:
    length = setup.train["input_ids"].shape[1]
    figures["gradient row sparsity"] = analysis.plot_row_sparsity_heatmap(
      stats, out / "row_sparsity.png", sequence_length=length)
    figures["gradient histogram"] = analysis.plot_gradient_histogram(
      stats, eps, out / "grad_histogram.png")
  return stats, analysis.sparsity_table(stats, 0.0), eps, figures


def load_run_config(run_dir: str | Path) -> FinetuneConfig:
  """The configuration a run folder was trained with (its ``config.json``)."""
  path = Path(run_dir) / "config.json"
  if not path.is_file():
    raise UsageError(f"--resume needs a run folder with config.json; {run_dir} has none")
  try:
    return FinetuneConfig(**json.loads(path.read_text()))
  except (ValueError, TypeError) as e:
    raise UsageError(f"{path} is unreadable ({_first_line(e)}); start a new run without "
                     "--resume") from None


def _default_run_dir(config: _DataConfig) -> Path:
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  return Path("runs") / f"{config.model}-{config.task}-{stamp}"


def finetune(
  config: FinetuneConfig,
  out: str | Path | None = None,
  *,
  resume: bool = False,
  log: Callable[[str], None] = print,
) -> dict[str, Any]:
  """Fine-tunes ``config.model`` on ``config.task`` and writes the run folder.

  Args:
    config: the run's configuration.
    out: the run folder; ``None``: ``runs/<model>-<task>-<timestamp>``.
    resume: continue the run in ``out`` (its ``config.json`` must match ``config`` except for
      ``steps``), each variant from its checkpoint.
    log: where progress messages go.

  Returns:
    The summary (also the last record of ``metrics.jsonl``), with ``run_dir`` and ``report``.

  Raises:
    UsageError: bad input (unknown names, truncation, a batch that does not fit in memory, an
      unreadable checkpoint), with a one-line message saying what to do.
  """
  run_dir = Path(out) if out is not None else _default_run_dir(config)
  config_path = run_dir / "config.json"
  if resume:
    saved = load_run_config(run_dir)
    changed = [f.name for f in dataclasses.fields(config) if f.name not in _MEASUREMENT_FIELDS
               and getattr(saved, f.name) != getattr(config, f.name)]
    if changed:
      raise UsageError(f"--resume continues {run_dir} as configured there; these options "
                       f"differ: {', '.join(changed)} (only --steps may change)")
  elif config_path.exists():
    raise UsageError(f"{run_dir} already holds a run; pass --resume to continue it or choose "
                     "another --out")
  placement = _Placement.of(config)
  setup = _prepare(config, log=log)
  run_dir.mkdir(parents=True, exist_ok=True)
  config_path.write_text(json.dumps(dataclasses.asdict(config), indent=2) + "\n")
  metrics = _Metrics(run_dir / "metrics.jsonl")
  impl = resolve_impl(config.impl)
  device = jax.devices()[0]
  stats = setup.length_stats
  log(f"training on {placement.describe()}")
  log(f"{config.task}: {len(setup.train['labels'])} training examples, median "
      f"{stats['median']:.0f} tokens, {stats['real_token_fraction']:.0%} of each padded batch "
      f"real, {setup.truncated} truncated to --max-length {config.max_length}")

  runs = {}
  with _out_of_memory_is_usage_error(config):
    for variant in VARIANTS:
      if variant == "dense" and not config.compare:
        continue
      run = _train(config, setup, variant, run_dir, metrics, log, placement)
      log(f"{variant}: evaluating on the held-out subset")
      run["eval"] = _evaluate(config, setup, run["params"], config.eval_examples)
      metrics.write({"variant": variant, "step": config.steps, "eval": run["eval"]})
      runs[variant] = run
    params = runs["sebp"]["params"]
    timing = table_rows = eps = None
    figures = {"loss curves": _plot_losses(metrics, run_dir / "loss_curves.png")}
    if config.timing_batches:
      log(f"timing forward and backward, dense and SEBP, on {config.timing_batches} batches")
      timing = _timings(config, setup, params, placement)
    if config.analysis_batches:
      log(f"measuring the output-gradient row sparsity on {config.analysis_batches} batches")
      _, table_rows, eps, more_figures = _gradient_analysis(
        setup, params, config.batch_size, config.seed, config.analysis_batches, run_dir)
      figures.update(more_figures)
  memory_kind = next(iter(runs.values()))["memory"][0]
  summary = {
    "summary": True, "model": config.model, "task": config.task, "weights": setup.spec.weights,
    "device": f"{device.platform}:{getattr(device, 'device_kind', device)}", "impl": impl,
    "mesh": placement.describe(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "length_stats": stats, "truncated": setup.truncated, "timing": timing,
    "backward_speedup": None if timing is None else
      timing["dense"]["backward_ms"] / max(timing["sebp"]["backward_ms"], 1e-9),
    "memory_kind": memory_kind, "suggested_eps": eps, "row_sparsity": table_rows,
    "runs": {v: {"eval": r["eval"], "step_ms": r["step_ms"], "traces": r["traces"],
                 "steps_run": r["steps_run"], "memory": r["memory"][1]}
             for v, r in runs.items()},
  }
  report = _report(config, run_dir, summary, figures)
  metrics.write(summary)
  summary.update(run_dir=str(run_dir), report=str(report),
                 summary_text="\n".join(_summary_lines(config, summary)))
  return summary


def analyze(
  config: AnalyzeConfig, out: str | Path | None = None, *, log: Callable[[str], None] = print
) -> dict[str, Any]:
  """Output-gradient row sparsity of every linear layer of the (untrained) model on the first
  ``config.batches`` training batches, and the suggested eps.

  Args:
    config: model, task and batch shape.
    out: a folder for the two figures; ``None``: none are drawn.
    log: where progress messages go.

  Returns:
    ``table`` (rows of :func:`sebp_jax.analysis.sparsity_table`), ``table_text`` (markdown),
    ``suggested_eps``, ``stats`` (:class:`sebp_jax.analysis.GradientStats`), ``figures``.
  """
  setup = _prepare(config, log=log)
  if out is not None:
    Path(out).mkdir(parents=True, exist_ok=True)
  with _out_of_memory_is_usage_error(config):
    stats, rows, eps, figures = _gradient_analysis(
      setup, setup.params, config.batch_size, config.seed, config.batches,
      None if out is None else Path(out))
  return {"table": rows, "table_text": analysis.format_sparsity_table(rows),
          "suggested_eps": eps, "stats": stats, "figures": figures,
          "length_stats": setup.length_stats}
