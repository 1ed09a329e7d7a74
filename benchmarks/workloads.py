"""Whole-model training benchmarks, JAX and PyTorch side by side: the machinery both scripts share.

:mod:`benchmarks.bert` and :mod:`benchmarks.llama` each describe one model (a :class:`ModelSpec`:
the model in both frameworks, its loss, its batches and its workloads) and hand it to :func:`main`,
which runs every variant of :data:`VARIANTS` on every workload and writes the results.

Workloads
  A workload is a distribution of real token lengths (of a dataset's texts, counted by a bundled
  tokenizer) at a fixed context. Each of its batches draws ``batch`` lengths from it with
  a fixed seed; token ids are random (speed does not depend on them) but the padding is real.
  Lengths are read from :data:`LENGTHS_FILE`, a small file made here once with
  ``python -m benchmarks.workloads --export-lengths benchmarks/results/token_lengths.json`` (the
  GPU machine has neither ``datasets`` nor the data packages); without it the data loaders of
  :mod:`sebp_jax.data` are used. :func:`glue_lengths` synthesizes the paper's GLUE length
  statistics, which have no offline text.

Variants (:data:`VARIANTS`)
  ``jax-dense`` (plain ``nn.Dense``), ``jax-sebp-pallas`` / ``jax-sebp-xla`` (:func:`swap_dense`
  with the exact policy), ``jax-bound`` (:func:`free_linear_backward`: every linear layer's
  backward costs nothing, the limit SEBP approaches), ``jax-dynamic`` (the dense model on each
  batch cut to its own longest sequence, rounded up to a multiple: the padding-free bound, paid for
  with one compilation per length bucket), ``torch-dense`` (Hugging Face, bfloat16 weights, with
  padding-aware flash attention, :mod:`benchmarks.torch_attention`: varlen segments over each
  sequence's real prefix and 128-token blocks of its padded tail, a fixed count computed on the
  device, so padded rows cost next to nothing, as the JAX models' cuDNN attention with sequence
  lengths skips them; every torch variant runs the same attention, exact for right-padded
  batches), ``torch-dense-compiled`` (the same under ``torch.compile``; beside it
  ``torch-sebp-plan-compiled``, ``torch-bound-compiled``, ``torch-sebp-compiled`` and
  ``torch-sebp-topn-compiled``, compared with it), ``torch-sebp``
  (:func:`sebp_torch_ref.apply_sebp`, Triton on CUDA, the dense backward chosen per step from the
  batch's real-token fraction with :func:`sebp_torch_ref.dense_backward`), ``torch-bound``
  (:func:`benchmarks.torch_bound.free_linear_backward_`: every ``nn.Linear`` backward free, ``dY``
  still read once, as ``jax-bound``), ``torch-sebp-plan`` (``torch-sebp`` under
  :func:`sebp_torch_ref.row_plan` of the batch's attention mask: no layer selects its rows) and
  ``torch-sebp-topn`` (the paper's fixed Top-N,
  ``RowPolicy(max_rows=ModelSpec.paper_max_rows)``, where the paper gives one);
  ``torch-dense-caller-thread``, ``torch-sebp-plan-caller-thread`` and
  ``torch-bound-caller-thread`` call ``backward()`` under
  ``torch.autograd.set_multithreading_enabled(False)``: the backward runs on the calling thread,
  not handed to autograd's worker thread for the GPU (compared with each other);
  ``torch-dense-graphed``, ``torch-sebp-plan-graphed``, ``torch-bound-graphed`` and
  ``torch-sebp-topn-graphed`` run the same
  models' steps as CUDA graphs (:class:`benchmarks.torch_graph.GraphedStep`: no host launch
  overhead; CUDA only, refused elsewhere), and ``torch-dense-compiled-graphed``,
  ``torch-sebp-plan-compiled-graphed`` and ``torch-bound-compiled-graphed`` the compiled models'
  steps (compared with each other);
  ``jax-sebp-pallas-nocond`` is ``jax-sebp-pallas`` with ``crossover=1.0`` (no dense-branch
  ``lax.cond``, whose predicate XLA fetches to the host once per layer); ``jax-sebp-pallas-per-batch`` decides the
  crossover once per step, and ``jax-sebp-pallas-plan`` besides hands every layer the step's row
  plan (the attention mask: no layer reads its ``dy`` to find the real tokens);
  ``jax-sebp-pallas-plan-nocond`` is the plan with ``crossover=1.0`` (no conditional in the step).
  ``jax-dense-einsum`` and ``jax-sebp-pallas-einsum`` run the same model built from Gemma-style
  ``nn.Einsum`` layers (:attr:`ModelSpec.jax_einsum_module`, LLaMA only); their speedups are over
  ``jax-dense-einsum``, so the einsum-built model's SEBP speedup compares with the Dense-built
  one's in one run.

Measurement
  Every variant runs in its own subprocess (a crash, an out-of-memory or a hang costs that variant
  only, and JAX's allocator peak, which cannot be reset, is the variant's own; JAX and torch never
  share a GPU process); ``--in-process`` runs them in one, for CPU smoke runs. Times are medians over ``steps`` distinct batches after warm-up.

  * JAX: three jitted programs, timed by wall clock around ``block_until_ready`` (a step lasts
    milliseconds, its dispatch microseconds): ``fwd`` (the loss), ``grad`` (loss and gradients)
    and ``step`` (loss, gradients and the AdamW update, parameters and optimizer state donated).
    ``bwd_ms = grad - fwd`` and ``opt_ms = step - grad``, each program timed on the same batches.
    (Timing the AdamW update as a program of its own, as an earlier version did, is not the same:
    on BERT-base that program's time varied from 3.8 to 6.4 ms between processes, and the
    subtraction put all of it into the backward.) On a GPU, one more traced call per timed batch
    splits ``grad``'s GPU time into its forward's and its backward's kernels
    (``gpu_fwd_ms``/``gpu_bwd_ms``, :mod:`benchmarks.device_trace`): the backward timed inside
    the one program, no forward program subtracted.
  * torch: CUDA events around the forward, ``backward()`` and ``optimizer.step()`` of one eager
    training step (``perf_counter`` on CPU). The ``*-graphed`` variants time the replays of the
    step's three graphs (forward, backward, optimizer) the same way; the batch is copied into the
    static buffers before the first event. Their graphs are captured once per batch size and
    crossover choice (the shapes are the same in every workload), before the workload's memory
    peak is reset, so the peak includes the graphs' pool. ``bwd_spread`` is the backward's
    ``(max - min) / median`` over the timed steps (distinct batches of one workload).
  * ``peak_mem_bytes``: JAX ``memory_stats()['peak_bytes_in_use']`` after the batch size's
    workloads (batch sizes run in ascending order, so the peak is that batch size's);
    ``torch.cuda.max_memory_allocated`` after a reset per workload. ``None`` on CPU.
  * ``compile_count``: traces of the jitted step (a Python counter in the traced function) that
    the workload's batches needed: new ones plus the shapes an earlier workload had compiled.
  * ``compile_s``: JAX, the seconds those traces and compilations took; torch (``*-compiled``
    variants), the warm-up steps' time beyond as many median steps (their first step traces and
    compiles, and Inductor's caches may already hold part of it; floored at 0); ``None`` without
    warm-up.
  * ``active_fraction``: real tokens over padded tokens: the fraction of linear-layer rows whose
    output gradient is not zero.

Parameters, gradients and AdamW moments are bfloat16 in both frameworks (torch's AdamW keeps its
moments in the parameters' dtype, and optax's ``adamw`` does too), as in the paper's LLaMA run
(25.98 GB at 3.2B parameters). Dropout is off: it costs every variant the same and would only add
random-number work that differs between frameworks.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import importlib.metadata
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import zlib
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from benchmarks.device_trace import PHASES, implausible_cut, traced_phase_times
from benchmarks.kernel_options import KERNEL_GRID, launch_options
from sebp_jax import xla_flags

__all__ = [
  "LENGTHS_FILE", "TOKENIZERS", "GLUE_STATS", "Workload", "Variant", "VARIANTS", "BASELINE",
  "EINSUM_BASELINE", "COMMAND_BUFFERS_BASELINE",
  "ModelSpec", "Row",
  "export_lengths", "dataset_lengths", "glue_lengths", "sample_lengths", "free_linear_backward",
  "weight_kernel", "Settings", "random_params", "workload_batches", "jax_loss_and_grad",
  "library_versions", "versions_text", "single_workload_parser", "xla_flags_text",
  "prepared_workload", "TORCH_CROSSOVER",
  "torch_variant_model", "torch_dense_steps", "torch_forward_context", "torch_backward",
  "speedups", "GRAD_KEYS", "with_grad_ms", "markdown_table", "write_results", "main",
  "JAX_FORWARD",
]

REPO = pathlib.Path(__file__).resolve().parents[1]
LENGTHS_FILE = REPO / "benchmarks" / "results" / "token_lengths.json"

# Tokenizer of each model family -> the bundled checkpoint whose tokenizer counts its tokens.
# minilm's is bert-base-uncased's WordPiece vocabulary; SmolLM2's is a LLaMA-architecture BPE
# (49,152 tokens against Llama-3's 128,256, so it counts somewhat more tokens per text).
TOKENIZERS = {"bert": "minilm", "llama": "smollm2"}
_EXPORT_PER_DATASET = 4000  # lengths kept per dataset (a sample of the larger ones)

# The paper's Table 1: tokens per sample (average, minimum, maximum) of the GLUE tasks (BERT).
GLUE_STATS: dict[str, tuple[int, int, int]] = {
  "stsb": (27, 10, 125), "cola": (47, 4, 111), "wnli": (37, 16, 108), "mrpc": (53, 19, 103),
  "rte": (66, 13, 128), "qqp": (30, 6, 128), "sst2": (13, 3, 66), "mnli": (39, 5, 128),
}
_GLUE_CONCENTRATION = 8.0  # Beta(a, b) with a + b = 8: right-skewed like real lengths

LR, WEIGHT_DECAY = 1e-5, 0.01


# ----------------------------------------------------------------------------- token lengths

def export_lengths(path: pathlib.Path = LENGTHS_FILE, *, seed: int = 0) -> dict:
  """Counts the tokens of every text of every task of :mod:`sebp_jax.data` with both tokenizers
  and writes them to ``path`` (at most 4000 per dataset, sampled with ``seed``).

  Needs ``datasets`` and the data and checkpoint packages; runs on a CPU in about a minute.
  """
  from sebp_jax import data

  rng = np.random.default_rng(seed)
  lengths: dict[str, dict[str, list[int]]] = {}
  for family, checkpoint in TOKENIZERS.items():
    tokenizer = data.bundled_tokenizer(checkpoint)
    lengths[family] = {}
    for task in data.TASKS:
      counts = _count_tokens(task, tokenizer)
      if counts.size > _EXPORT_PER_DATASET:
        counts = rng.choice(counts, _EXPORT_PER_DATASET, replace=False)
      lengths[family][task] = sorted(int(n) for n in counts)
  payload = {
    "description": "Untruncated token counts (special tokens included) of the texts of "
                   "sebp_jax.data's tasks; made by `python -m benchmarks.workloads "
                   "--export-lengths`.",
    "tokenizers": {family: f"sebp_jax.data.bundled_tokenizer({name!r})"
                   for family, name in TOKENIZERS.items()},
    "lengths": lengths,
  }
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(payload, separators=(",", ":")) + "\n")
  return payload


def dataset_lengths(family: str, task: str, path: pathlib.Path = LENGTHS_FILE) -> np.ndarray:
  """Real token lengths ``(n,)`` of ``task``'s texts under ``family``'s tokenizer (``"bert"`` or
  ``"llama"``): from ``path`` when it exists, else counted with :mod:`sebp_jax.data`."""
  if family not in TOKENIZERS:
    raise ValueError(f"`family` must be one of {tuple(TOKENIZERS)}, got {family!r}.")
  if path.is_file():
    table = json.loads(path.read_text())["lengths"][family]
    if task not in table:
      raise ValueError(f"`task` {task!r} is not in {path}; it has {sorted(table)}.")
    return np.asarray(table[task], np.int64)
  from sebp_jax import data

  return _count_tokens(task, data.bundled_tokenizer(TOKENIZERS[family]))


def _count_tokens(task: str, tokenizer: Any) -> np.ndarray:
  """Untruncated token counts ``(n,)`` of every text of ``task`` (:mod:`sebp_jax.data`)."""
  from sebp_jax import data

  # `tokenize` counts before truncating; the short `max_length` only keeps its id arrays small.
  tokenized = data.tokenize(data.load_task(task), tokenizer, max_length=8)
  return np.asarray(tokenized["length"], np.int64)


def glue_lengths(task: str, n: int = 4000, *, seed: int = 0) -> np.ndarray:
  """``n`` lengths matching the paper's Table 1 statistics of a GLUE task (:data:`GLUE_STATS`).

  ``min + (max - min) * Beta(a, b)``, rounded, with ``a / (a + b)`` set so that the expected
  length is the table's average and ``a + b = 8`` (a right-skewed shape, like real length
  distributions). Every length lies in ``[min, max]``; the sample mean is within a token of the
  average.
  """
  if task not in GLUE_STATS:
    raise ValueError(f"`task` must be one of {tuple(GLUE_STATS)}, got {task!r}.")
  avg, low, high = GLUE_STATS[task]
  mean = (avg - low) / (high - low)
  a, b = mean * _GLUE_CONCENTRATION, (1 - mean) * _GLUE_CONCENTRATION
  draws = np.random.default_rng(seed).beta(a, b, size=n)
  return np.clip(np.rint(low + (high - low) * draws), low, high).astype(np.int64)


def sample_lengths(pool: np.ndarray, *, batch: int, seq_len: int, n_batches: int,
                   seed: int) -> np.ndarray:
  """``(n_batches, batch)`` lengths drawn with replacement from ``pool``, truncated to
  ``seq_len`` (as a tokenizer with ``truncation=True`` does)."""
  pool = np.asarray(pool)
  if pool.ndim != 1 or pool.size == 0 or pool.min() < 1:
    raise ValueError("`pool` must be a non-empty 1-D array of positive lengths.")
  rng = np.random.default_rng(seed)
  return np.minimum(rng.choice(pool, size=(n_batches, batch)), seq_len)


@dataclasses.dataclass(frozen=True)
class Workload:
  """A named distribution of real token lengths (``pool``) that batches are drawn from."""

  name: str
  dataset: str
  pool: np.ndarray

  def lengths(self, batch: int, seq_len: int, n_batches: int) -> np.ndarray:
    """``(n_batches, batch)`` lengths, the same on every run and in every variant."""
    seed = zlib.crc32(f"{self.name}/{batch}".encode())
    return sample_lengths(self.pool, batch=batch, seq_len=seq_len, n_batches=n_batches, seed=seed)


# ----------------------------------------------------------------------------- variants

@dataclasses.dataclass(frozen=True)
class Variant:
  """One way of running the model: ``framework`` ``"jax"`` or ``"torch"``, its ``impl``, and for
  the SEBP variants the ``crossover`` passed to :func:`sebp_jax.swap_dense`. ``per_batch``: the
  crossover decided once per step from the batch's real-token fraction
  (:func:`sebp_jax.sebp_value_and_grad`) instead of in every layer. ``rows``: besides, the kept
  rows handed to every layer once per step from the attention mask (a row plan), instead of each
  layer reading its ``dy`` to find them. ``max_rows="paper"``: the paper's fixed Top-N of
  :attr:`ModelSpec.paper_max_rows`; models without one skip the variant. ``graphed``: the torch
  step captured in CUDA graphs and replayed per batch. ``compiled``: the torch model (after its
  patching) under ``torch.compile`` in its default mode; each SEBP layer is an op in the
  one graph (``sebp_torch_ref/compiled.py``; before v23, a graph break); with ``graphed``, the
  compiled step is what the CUDA graphs record. ``caller_thread``: the eager torch step's
  ``backward()`` under ``torch.autograd.set_multithreading_enabled(False)``
  (:func:`torch_backward`). ``layers``: ``"dense"``, the model as :attr:`ModelSpec.jax_module`
  builds it, or ``"einsum"``, as :attr:`ModelSpec.jax_einsum_module` does.
  ``command_buffers``: the JAX step run in a worker process whose ``XLA_FLAGS`` add
  :data:`sebp_jax.xla_flags.COMMAND_BUFFER_FLAGS` (conditionals inside CUDA graphs), beside the
  same variant without them in the same run. ``launch``: attributes of the framework's kernel
  module (:mod:`sebp_torch_ref.kernels`' launch plan, :mod:`sebp_jax.backends.pallas`' tile
  table) replaced while the variant runs (:mod:`benchmarks.kernel_options`: a kernel A/B in one
  process, beside the variant without them)."""

  name: str
  framework: str
  impl: str
  crossover: float | None = None
  per_batch: bool = False
  rows: bool = False
  max_rows: str | None = None  # "paper": the model's ModelSpec.paper_max_rows (torch)
  layers: str = "dense"
  graphed: bool = False  # torch: the step replayed from CUDA graphs (benchmarks.torch_graph)
  compiled: bool = False  # torch: the model under torch.compile (SEBP's layers: ops in the graph)
  command_buffers: bool = False  # jax: XLA_FLAGS with sebp_jax.xla_flags.COMMAND_BUFFER_FLAGS
  caller_thread: bool = False  # torch: backward() on the calling thread (no autograd worker)
  launch: tuple[tuple[str, Any], ...] = ()  # (kernel module attribute, value) pairs

  @property
  def baseline(self) -> str:
    """The variant whose times this one's speedups divide: the dense run of the same model,
    under the same XLA flags."""
    if self.command_buffers:
      return COMMAND_BUFFERS_BASELINE
    return EINSUM_BASELINE if self.layers == "einsum" else BASELINE


# In the order they run: the most telling first, in case the time budget cuts a run short.
VARIANTS: tuple[Variant, ...] = (
  Variant("jax-dense", "jax", "dense"),
  Variant("jax-sebp-pallas", "jax", "pallas"),
  Variant("jax-bound", "jax", "bound"),
  Variant("torch-dense", "torch", "dense"),
  Variant("torch-sebp", "torch", "triton"),  # "torch" (index ops) where there is no CUDA
  Variant("torch-sebp-plan", "torch", "triton", rows=True),
  # ... with every eager launch through Triton's kernel[grid], as up to v32 (a same-process A/B of
  # sebp_torch_ref.launch.CachedLaunch: eagerly, BERT-base's step waits on host time).
  Variant("torch-sebp-plan-kernel-grid", "torch", "triton", rows=True, launch=KERNEL_GRID),
  Variant("torch-bound", "torch", "bound"),
  Variant("torch-sebp-topn", "torch", "triton", max_rows="paper"),
  # The eager backward on the calling thread instead of autograd's worker thread for the GPU:
  # each SEBP layer's Python backward then runs without a thread handoff (eager BERT-base's
  # step waits on host time).
  Variant("torch-dense-caller-thread", "torch", "dense", caller_thread=True),
  Variant("torch-sebp-plan-caller-thread", "torch", "triton", rows=True, caller_thread=True),
  Variant("torch-bound-caller-thread", "torch", "bound", caller_thread=True),
  # Without host launch overhead: what the GPU work of the step costs.
  Variant("torch-dense-graphed", "torch", "dense", graphed=True),
  Variant("torch-sebp-plan-graphed", "torch", "triton", rows=True, graphed=True),
  Variant("torch-bound-graphed", "torch", "bound", graphed=True),
  Variant("torch-sebp-topn-graphed", "torch", "triton", max_rows="paper", graphed=True),
  # Compiling takes the longest (minutes on LLaMA-3B): last of the torch rows. Compared with
  # each other, as the graphed ones are: Inductor fuses the norms, activations and loss that the
  # eager step runs op by op, for dense, SEBP and the bound alike.
  Variant("torch-dense-compiled", "torch", "dense", compiled=True),
  Variant("torch-sebp-plan-compiled", "torch", "triton", rows=True, compiled=True),
  Variant("torch-bound-compiled", "torch", "bound", compiled=True),
  # The planned launch with dW's programs before dX's in its grid on every layer, as up to v29 (a
  # same-process A/B; the default puts dX's first where dW's fill two waves or more).
  Variant("torch-sebp-plan-dw-first-compiled", "torch", "triton", rows=True, compiled=True,
          launch=(("_DX_FIRST_WAVES", math.inf),)),
  # Rows scored from dY in every layer (the paper's method), and the paper's Top-N, compiled.
  Variant("torch-sebp-compiled", "torch", "triton", compiled=True),
  Variant("torch-sebp-topn-compiled", "torch", "triton", max_rows="paper", compiled=True),
  # Compiled and replayed from CUDA graphs: Inductor's fusions without the host launching
  # Inductor's kernels one by one (on BERT-base b32 the compiled SEBP and bound steps wait on it).
  Variant("torch-dense-compiled-graphed", "torch", "dense", compiled=True, graphed=True),
  Variant("torch-sebp-plan-compiled-graphed", "torch", "triton", rows=True, compiled=True,
          graphed=True),
  Variant("torch-bound-compiled-graphed", "torch", "bound", compiled=True, graphed=True),
  Variant("jax-dynamic", "jax", "dynamic"),
  Variant("jax-sebp-xla", "jax", "xla"),
  # The dense-branch conditional compiled out: what its host round trips cost per step.
  Variant("jax-sebp-pallas-nocond", "jax", "pallas", crossover=1.0),
  # One conditional per step instead of one per layer.
  Variant("jax-sebp-pallas-per-batch", "jax", "pallas", per_batch=True),
  # ... and one row plan per step instead of a score read and a partition per layer.
  Variant("jax-sebp-pallas-plan", "jax", "pallas", per_batch=True, rows=True),
  # The row plan with no conditional at all (crossover=1.0): what a training loop gets that
  # picks the dense or the SEBP step on the host from the batch, with the whole step in CUDA
  # graphs (XLA runs a conditional's body outside them).
  Variant("jax-sebp-pallas-plan-nocond", "jax", "pallas", per_batch=True, rows=True,
          crossover=1.0),
  # ... with the 768 x 768 projections on the narrow class's tiles, as up to v22 (a same-process
  # A/B of the "small" class's 64-wide dW tiles).
  Variant("jax-sebp-pallas-plan-nocond-no-small", "jax", "pallas", per_batch=True, rows=True,
          crossover=1.0, launch=(("_SMALL_WEIGHT", 0),)),
  # ... with a dW launch per sibling (q, k and v; gate and up) instead of the group's one
  # launch (NOTES "v37 measured"), against the default in the same process.
  Variant("jax-sebp-pallas-plan-nocond-dw-per-sibling", "jax", "pallas", per_batch=True,
          rows=True, crossover=1.0, launch=(("_SIBLINGS_DW_ONE_LAUNCH", False),)),
  # ... with a dX launch per sibling (q/k/v, gate/up), the later ones adding into the first
  # one's dx, instead of the group's one launch (NOTES "v39 measured").
  Variant("jax-sebp-pallas-plan-nocond-dx-per-sibling", "jax", "pallas", per_batch=True,
          rows=True, crossover=1.0, launch=(("_SIBLINGS_DX_ONE_LAUNCH", False),)),
  # ... with each lone Dense's bias gradient left to autodiff, a column sum over every row of its
  # `dy`, instead of its gather's over the kept rows (BERT's FFN up, attention output and FFN
  # down; NOTES "v38 measured"), against the default in the same process.
  Variant("jax-sebp-pallas-plan-nocond-bias-by-autodiff", "jax", "pallas", per_batch=True,
          rows=True, crossover=1.0, launch=(("_LONE_BIAS_IN_RULE", False),)),
  # The same model built from nn.Einsum layers: SEBP must speed it up as much as the Dense one.
  Variant("jax-dense-einsum", "jax", "dense", layers="einsum"),
  Variant("jax-sebp-pallas-einsum", "jax", "pallas", layers="einsum"),
  # The crossover's conditional captured in command buffers (sebp_jax.xla_flags): dense, the
  # bound and the row plan under the same flags, for an A/B within one run.
  Variant("jax-dense-cmdbuf", "jax", "dense", command_buffers=True),
  Variant("jax-bound-cmdbuf", "jax", "bound", command_buffers=True),
  Variant("jax-sebp-pallas-plan-cmdbuf", "jax", "pallas", per_batch=True, rows=True,
          command_buffers=True),
)
BASELINE = "jax-dense"
EINSUM_BASELINE = "jax-dense-einsum"
COMMAND_BUFFERS_BASELINE = "jax-dense-cmdbuf"


def _free_matmul_fwd(x, kernel):
  from jax import lax

  return lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ()))), (x, kernel)


def _free_matmul_bwd(residuals, dy):
  import jax.numpy as jnp

  x, kernel = residuals  # read for their shapes only: XLA drops them as residuals
  # The bound must still compute `dy`, as SEBP must: the backward of the attention, activations
  # and norms between linear layers. XLA deletes every op whose result nothing uses (an
  # optimization barrier's unused output included), so where no bias gradient (a row sum of `dy`)
  # uses `dy` -- LLaMA's layers have no bias -- the backward feeding it would vanish. Hence `dy`'s
  # sum, made finite and multiplied by zero, is added to the zero gradients: one read of `dy`,
  # the read SEBP's row scores make too. A runtime value, not a constant, so XLA cannot fold the
  # zeros into the ops that consume `dx` (the activation backward, the residual add) either.
  total = jnp.sum(dy, dtype=jnp.float32)
  zero = 0.0 * jnp.nan_to_num(total, nan=0.0, posinf=0.0, neginf=0.0)
  return (jnp.zeros(x.shape, x.dtype) + zero.astype(x.dtype),
          jnp.zeros(kernel.shape, kernel.dtype) + zero.astype(kernel.dtype))


def _free_matmul(backward: Callable):
  import jax

  matmul = jax.custom_vjp(lambda x, kernel: _free_matmul_fwd(x, kernel)[0])
  matmul.defvjp(_free_matmul_fwd, backward)
  return matmul


def weight_kernel(lhs, rhs, dimension_numbers, preferred_element_type=None):
  """The ``(K, N)`` kernel of a ``lax.dot_general`` call that is a linear layer's weight product,
  the contraction whose backward the bound (and :mod:`benchmarks.bound_definitions`) replaces:
  ``rhs`` for ``x (..., K) @ kernel (K, N)``, ``rhs.T`` for ``x @ w.T`` with ``w`` stored
  ``(N, K)`` (the tied output embedding, as the swapped ``Embed.attend`` contracts it), ``None``
  for any other contraction."""
  if rhs.ndim != 2 or preferred_element_type is not None or any(dimension_numbers[1]):
    return None
  contracting = tuple(map(tuple, dimension_numbers[0]))
  if contracting == ((lhs.ndim - 1,), (0,)):
    return rhs
  if contracting == ((lhs.ndim - 1,), (1,)):
    return rhs.T
  return None


def _free_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                      *, backward: Callable):
  """``lax.dot_general`` whose backward (for a :func:`weight_kernel` product) is ``backward``."""
  from jax import lax

  kernel = weight_kernel(lhs, rhs, dimension_numbers, preferred_element_type)
  if kernel is not None:
    return _free_matmul(backward)(lhs, kernel)
  return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                         preferred_element_type=preferred_element_type)


@contextlib.contextmanager
def free_linear_backward(backward: Callable = _free_matmul_bwd) -> Iterator[None]:
  """Every ``nn.Dense`` (and ``nn.Embed.attend``) traced inside gets a free backward.

  The forward is the plain matmul; the backward returns zero ``dx`` and ``dkernel`` without any
  matmul (the bias gradient, a row sum, is still computed, as SEBP computes it). The rest of the
  backward runs as usual, so a model's step under this context is the fastest any SEBP backend
  could make it: the bound of the ``jax-bound`` variant.

  Args:
    backward: the linear layers' VJP, ``((x, kernel), dy) -> (dx, dkernel)``. The default's zeros
      depend on ``dy`` at run time; :mod:`benchmarks.bound_definitions` passes others to show
      what a bound that lets XLA skip more would claim.
  """
  from sebp_jax.linen import swap_dot_general

  with swap_dot_general(functools.partial(_free_dot_general, backward=backward)):
    yield


def _jax_context(variant: Variant) -> contextlib.AbstractContextManager:
  """The context the loss is traced in: which backward every linear layer gets."""
  from sebp_jax import RowPolicy, swap_dense

  if variant.impl in ("pallas", "xla") and not variant.per_batch:
    return swap_dense(RowPolicy(), impl=variant.impl, crossover=variant.crossover)
  if variant.impl == "bound":
    return free_linear_backward()
  return contextlib.nullcontext()


def _jax_value_and_grad(variant: Variant, fun: Callable[[Any, Batch], Any]) -> Callable:
  """``jax.value_and_grad(fun)`` for ``fun(params, batch)``; for a ``per_batch`` variant, its SEBP
  form that decides the crossover once per step from the batch's real-token fraction."""
  import jax

  if not variant.per_batch:
    return jax.value_and_grad(fun)
  from sebp_jax import sebp_value_and_grad

  mask = lambda params, batch: batch["attention_mask"]
  return sebp_value_and_grad(fun, rows=mask if variant.rows else None,
                             active_fraction=lambda *args: jax.numpy.mean(mask(*args)),
                             impl=variant.impl, crossover=variant.crossover)


# ----------------------------------------------------------------------------- model specs

Batch = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """One benchmarked model, in both frameworks.

  Attributes:
    name: the script's module name under ``benchmarks`` (``"bert"``) and the result files' stem.
    seq_len: the padded context.
    batch_sizes: benchmarked batch sizes.
    dynamic_multiple: ``jax-dynamic`` pads each batch to its longest sequence rounded up to this.
    workloads: the length distributions to run.
    make_batch: ``(lengths (B,), seq_len, rng) -> {name: int32 array}``: inputs and labels,
      right-padded to ``seq_len``; ``jax-dynamic`` cuts the ``(B, seq_len)`` ones along axis 1.
    jax_module: builds the flax module (bfloat16 parameters and computation).
    jax_einsum_module: builds the same model from ``nn.Einsum`` layers, for the ``layers="einsum"``
      variants; ``None``: the model has no such form (those variants are not run by default).
    jax_loss: ``(module, params, batch) -> scalar``: the training loss.
    torch_model: ``(device) -> torch module`` in bfloat16, whose ``forward(**batch).loss`` is the
      same loss.
    warmup, steps: default untimed and timed steps per workload.
    paper_max_rows: the paper's fixed Top-N for this model (kept rows per layer call), if it
      states one: BERT-base's 3456 (its §4).
  """

  name: str
  seq_len: int
  batch_sizes: tuple[int, ...]
  dynamic_multiple: int
  workloads: tuple[Workload, ...]
  make_batch: Callable[[np.ndarray, int, np.random.Generator], Batch]
  jax_module: Callable[[], Any]
  jax_loss: Callable[[Any, Any, Batch], Any]
  torch_model: Callable[[str], Any]
  jax_einsum_module: Callable[[], Any] | None = None
  warmup: int = 2
  steps: int = 10
  paper_max_rows: int | None = None


@dataclasses.dataclass
class Row:
  """One result: a variant on a workload at one batch size. Times in ms; ``None`` if not run."""

  workload: str
  dataset: str
  framework: str
  impl: str
  variant: str
  batch: int
  seq_len: int
  active_fraction: float
  fwd_ms: float | None = None
  bwd_ms: float | None = None
  opt_ms: float | None = None
  step_ms: float | None = None
  peak_mem_bytes: int | None = None
  compile_count: int | None = None
  compile_s: float | None = None
  error: str | None = None
  bwd_spread: float | None = None
  # JAX on a GPU: the loss-and-gradients program's GPU time by phase (benchmarks.device_trace),
  # the backward's kernels timed inside the one program, no forward program subtracted.
  gpu_fwd_ms: float | None = None
  gpu_bwd_ms: float | None = None
  gpu_misplaced_ms: float | None = None


@dataclasses.dataclass(frozen=True)
class Settings:
  """How long to measure: ``warmup`` untimed steps, then ``steps`` timed distinct batches."""

  warmup: int
  steps: int


def workload_batches(spec: ModelSpec, workload: Workload, batch: int, settings: Settings,
             dynamic: bool) -> tuple[list[Batch], float]:
  """The workload's batches (warm-up ones first) and their active fraction."""
  n = settings.warmup + settings.steps
  lengths = workload.lengths(batch, spec.seq_len, n)
  rng = np.random.default_rng(zlib.crc32(workload.name.encode()))
  batches = []
  for row_lengths in lengths:
    arrays = spec.make_batch(row_lengths, spec.seq_len, rng)
    if dynamic:
      width = min(spec.seq_len, -(-int(row_lengths.max()) // spec.dynamic_multiple)
                  * spec.dynamic_multiple)
      arrays = {k: v[:, :width] if v.ndim == 2 and v.shape[1] == spec.seq_len else v
                for k, v in arrays.items()}
    batches.append(arrays)
  return batches, float(lengths.sum() / lengths.size / spec.seq_len)


def _median(samples: Sequence[float]) -> float:
  return float(statistics.median(samples))


# ----------------------------------------------------------------------------- JAX runner

def random_params(module, spec: ModelSpec, seed: int = 0):
  """Random bfloat16 parameters without compiling ``init``: normal(0.02) matrices, unit scales,
  zero biases. Shapes come from ``jax.eval_shape``; speed does not depend on the values."""
  import jax
  import jax.numpy as jnp

  example = spec.make_batch(np.full((1,), 2), 8, np.random.default_rng(0))
  shapes = jax.eval_shape(lambda: module.init(
    jax.random.key(0), example["input_ids"], example["attention_mask"]))

  def fill(path, leaf, key):
    name = getattr(path[-1], "key", "")
    if name == "scale":
      return jnp.ones(leaf.shape, leaf.dtype)
    if name == "bias":
      return jnp.zeros(leaf.shape, leaf.dtype)
    return (0.02 * jax.random.normal(key, leaf.shape, jnp.float32)).astype(leaf.dtype)

  leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
  # RBG keys: XLA's own bit generator compiles in a fraction of threefry's time.
  keys = jax.random.split(jax.random.key(seed, impl="rbg"), len(leaves))
  make = jax.jit(lambda keys: treedef.unflatten(
    [fill(path, leaf, key) for (path, leaf), key in zip(leaves, keys)]))
  return make(keys)


def single_workload_parser(prog: str) -> argparse.ArgumentParser:
  """The arguments of the tools that study one workload's program (:mod:`benchmarks.profile_step`,
  :mod:`benchmarks.bound_definitions`): ``--model``, ``--batch``, ``--workload``, ``--tiny``,
  ``--out-dir``, ``--xla-command-buffers``; each tool adds its own."""
  parser = argparse.ArgumentParser(prog=prog)
  parser.add_argument("--model", required=True, choices=["bert", "llama"])
  parser.add_argument("--batch", type=int, required=True)
  parser.add_argument("--workload", required=True)
  parser.add_argument("--tiny", action="store_true", help="the model's 1-layer configuration")
  parser.add_argument("--out-dir", type=pathlib.Path, required=True)
  parser.add_argument("--xla-command-buffers", action="store_true",
                      help="run with sebp_jax.xla_flags.COMMAND_BUFFER_FLAGS (conditionals "
                           "inside CUDA graphs) added to XLA_FLAGS")
  return parser


def xla_flags_text(result: dict) -> str:
  """`` XLA_FLAGS: `...`.`` for a result's header line, or nothing for results without it."""
  flags = result.get("xla_flags")
  return "" if flags is None else f" XLA_FLAGS: `{flags or '(none)'}`."


def prepared_workload(parser: argparse.ArgumentParser, args: argparse.Namespace,
                      settings: Settings) -> tuple[ModelSpec, Any, Any, list[Batch], dict, str]:
  """The workload named by :func:`single_workload_parser`'s ``args``, ready to run.

  Returns:
    ``(spec, module, params, batches, header, stem)``: random bfloat16 parameters; the
    workload's ``settings.warmup + settings.steps`` batches on the default device, warm-up ones
    first; the header of the tool's result (``benchmark``, ``gpu``, ``dtype``, ``seq_len``,
    ``batch``, ``workload``, ``active_fraction``, ``versions``); and ``<model>[_tiny]_b<batch>_
    <workload>``, to name its files. A ``--workload`` the model lacks is a parser error.
  """
  # Before JAX starts its backends (enable_command_buffers raises after); the header records the
  # XLA_FLAGS the run reads.
  if args.xla_command_buffers:
    xla_flags.enable_command_buffers()
  import jax

  from benchmarks.timing import environment

  spec = importlib.import_module(f"benchmarks.{args.model}").build(args.tiny)
  by_name = {w.name: w for w in spec.workloads}
  if args.workload not in by_name:
    parser.error(f"--workload: {args.workload!r} is not one of {sorted(by_name)}")
  module = spec.jax_module()
  host_batches, active = workload_batches(spec, by_name[args.workload], args.batch, settings,
                                          dynamic=False)
  header = {"benchmark": spec.name, "gpu": environment()["device"],
            "dtype": "bfloat16", "seq_len": spec.seq_len, "batch": args.batch,
            "workload": args.workload, "active_fraction": active, "versions": library_versions(),
            "xla_flags": os.environ.get("XLA_FLAGS", "")}
  stem = f"{spec.name}{'_tiny' if args.tiny else ''}_b{args.batch}_{args.workload}"
  return (spec, module, random_params(module, spec), [jax.device_put(b) for b in host_batches],
          header, stem)


def jax_loss_and_grad(spec: ModelSpec, variant: Variant, module) -> tuple[Callable, Callable]:
  """The variant's loss ``(params, batch) -> scalar``, traced in its context (which backward each
  linear layer gets), and the ``jax.value_and_grad`` form of it that the variant uses, traced
  under its ``launch`` options (the Pallas backward picks its tiles when it is traced)."""

  def loss(params, batch):
    with _jax_context(variant):
      return spec.jax_loss(module, params, batch)

  value_and_grad = _jax_value_and_grad(variant, loss)

  def value_and_grad_under_launch(params, batch):
    with launch_options(variant.launch, framework="jax"):
      return value_and_grad(params, batch)

  return loss, value_and_grad_under_launch


# What JAX's `fwd_ms` times, as result files record it; files without the key timed the same.
# (Files of 2026-12-01/02 name "the loss, keeping the residuals of its backward": `jax.vjp`
# under `jit` returning them. At LLaMA-3B its peak was ~18 GB above the loss-and-gradients
# program's, and it overstated the forward inside `grad` by 11-21 ms; benchmarks/NOTES.md,
# "v41: the forward that keeps its residuals is not grad's forward".)
JAX_FORWARD = "the loss alone"


def run_jax(spec: ModelSpec, variant: Variant, settings: Settings) -> Iterator[Row | dict]:
  """Runs ``variant`` on every workload and batch size.

  Yields the environment (:func:`benchmarks.timing.environment`), then each row as soon as it is
  measured; its ``peak_mem_bytes`` is filled in place once its batch size is done, so a consumer
  serializes rows when the generator is exhausted (and on the way, to keep what a crash loses).
  """
  import jax
  import optax

  from benchmarks.timing import environment, wall_ms

  yield environment()
  if variant.layers == "einsum":
    if spec.jax_einsum_module is None:
      raise ValueError(f"{variant.name}: the {spec.name} benchmark has no einsum-built model.")
    module = spec.jax_einsum_module()
  else:
    module = spec.jax_module()
  params = random_params(module, spec)
  optimizer = optax.adamw(LR, weight_decay=WEIGHT_DECAY)
  opt_state = jax.jit(optimizer.init)(params)  # one program, not one per leaf shape
  traces = {"step": 0}

  loss, value_and_grad = jax_loss_and_grad(spec, variant, module)

  def update(params, opt_state, grads):
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def step(params, opt_state, batch):
    # Runs once per trace, i.e. per compilation (the loss inside may be traced more often: once
    # per branch of the per-batch variant).
    traces["step"] += 1
    value, grads = value_and_grad(params, batch)
    return (*update(params, opt_state, grads), value)

  fwd_fn = jax.jit(loss)
  # Gradients without the update: its peak (parameters, state, activations, one gradient tree)
  # is the training step's.
  grad_fn = jax.jit(value_and_grad)
  step_fn = jax.jit(step, donate_argnums=(0, 1))
  dynamic = variant.impl == "dynamic"
  for batch_size in sorted(spec.batch_sizes):
    compiled: set[tuple] = set()  # input shapes the step has been compiled for
    batch_rows = []
    for workload in spec.workloads:
      batches, active = workload_batches(spec, workload, batch_size, settings, dynamic)
      if dynamic and active == 1.0:
        continue  # nothing to cut: the dynamic variant is jax-dense there
      row = Row(workload.name, workload.dataset, "jax", variant.impl, variant.name, batch_size,
                spec.seq_len, active)
      batch_rows.append(row)
      try:
        device_batches = [jax.device_put(b) for b in batches]
        # Compile every shape this workload needs (one first batch of each) outside the timing.
        firsts = {tuple(b["input_ids"].shape): b for b in reversed(device_batches)}
        row.compile_count = len(firsts.keys() & compiled)  # compiled by an earlier workload
        row.compile_s = 0.0
        for b in firsts.values():
          before, start = traces["step"], time.perf_counter()
          jax.block_until_ready((fwd_fn(params, b), grad_fn(params, b)))
          params, opt_state, _ = jax.block_until_ready(step_fn(params, opt_state, b))
          if traces["step"] > before:
            row.compile_count += traces["step"] - before
            row.compile_s += time.perf_counter() - start
        compiled |= firsts.keys()
        for b in device_batches[:settings.warmup]:
          params, opt_state, _ = step_fn(params, opt_state, b)
        timed = device_batches[settings.warmup:]
        row.fwd_ms = _median([wall_ms(lambda: fwd_fn(params, b)) for b in timed])
        grad_ms = _median([wall_ms(lambda: grad_fn(params, b)) for b in timed])
        step_times = []
        for b in timed:
          start = time.perf_counter()
          params, opt_state, value = step_fn(params, opt_state, b)
          jax.block_until_ready(value)
          step_times.append((time.perf_counter() - start) * 1e3)
        row.step_ms = _median(step_times)
        row.bwd_ms, row.opt_ms = grad_ms - row.fwd_ms, row.step_ms - grad_ms
        if len(firsts) == 1:  # one program (the per-batch variant's shapes are several)
          phases = _backward_on_device(grad_fn, params, timed, row.variant)
          wrong = phases and implausible_cut(phases, row.fwd_ms)
          if wrong:  # no GPU columns rather than a wrong ratio (benchmarks/NOTES.md "v44")
            print(f"{row.variant} {row.workload}: no GPU phases ({wrong})", file=sys.stderr)
          elif phases is not None:
            row.gpu_fwd_ms, row.gpu_bwd_ms, row.gpu_misplaced_ms = (
              phases[phase] for phase in PHASES)
      except Exception as e:  # recorded; the next workload runs (if the state survived)
        row.error = _error_text(e)
      yield row
    stats = jax.devices()[0].memory_stats() or {}
    for row in batch_rows:
      row.peak_mem_bytes = stats.get("peak_bytes_in_use")


def _backward_on_device(grad_fn: Callable, params, batches: Sequence, variant: str,
                        ) -> dict[str, float] | None:
  """:func:`benchmarks.device_trace.traced_phase_times` of one call of the jitted ``grad_fn`` per
  batch: ``None`` on a CPU, and where the profiler fails (said on stderr; the timed row stays).

  The program traced is the ``Compiled`` whose HLO names the trace's kernels: ``grad_fn``'s
  cache hit, the timed executable itself (``jax_log_compiles`` shows no second compile)."""
  import jax

  try:
    compiled = grad_fn.lower(params, batches[0]).compile()
    return traced_phase_times(
      lambda: [jax.block_until_ready(compiled(params, b)) for b in batches], compiled.as_text(),
      len(batches))
  except Exception as e:  # noqa: BLE001 - the profiler's failures have no common type
    print(f"{variant}: no GPU phases ({type(e).__name__}: {e})", file=sys.stderr)
    return None


# ----------------------------------------------------------------------------- torch runner

class _TorchClock:
  """Timestamps on the device's timeline: CUDA events, or ``perf_counter`` on CPU."""

  def __init__(self, torch, device: str):
    self.torch, self.cuda = torch, device.startswith("cuda")

  def mark(self):
    if self.cuda:
      event = self.torch.cuda.Event(enable_timing=True)
      event.record()
      return event
    return time.perf_counter()

  def ms(self, start, end) -> float:
    return start.elapsed_time(end) if self.cuda else (end - start) * 1e3


TORCH_CROSSOVER = 0.5  # torch-sebp runs the dense backward for batches with more real tokens


def torch_forward_context(variant: Variant, batch: dict, dense: bool) -> contextlib.ExitStack:
  """What a torch variant's forward runs under: :func:`sebp_torch_ref.dense_backward` of the
  step's crossover ``dense``, and for ``rows`` variants :func:`sebp_torch_ref.row_plan` of the
  device batch's attention mask."""
  from sebp_torch_ref import dense_backward, row_plan

  context = contextlib.ExitStack()
  context.enter_context(dense_backward(dense))
  if variant.rows:
    context.enter_context(row_plan(batch["attention_mask"]))
  return context


def torch_backward(variant: Variant, loss) -> None:
  """``loss.backward()`` as a torch variant's step runs it: ``caller_thread`` variants on the
  calling thread (autograd's worker threads off), the others as autograd does by default."""
  import torch

  with torch.autograd.set_multithreading_enabled(not variant.caller_thread):
    loss.backward()


def _torch_marks(model, optimizer, clock: _TorchClock, variant: Variant, batches: Sequence[dict],
                 dense_steps: Sequence[bool]) -> list[tuple]:
  """Runs one training step per batch; returns its (start, forward done, backward done, end).

  ``dense_steps``: per batch, whether its forward records the dense backward (decided on the
  host: no device read); see :func:`torch_forward_context`."""
  marks = []
  for batch, dense in zip(batches, dense_steps):
    t0 = clock.mark()
    with torch_forward_context(variant, batch, dense):
      loss = model(**batch).loss
    t1 = clock.mark()
    torch_backward(variant, loss)
    t2 = clock.mark()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    marks.append((t0, t1, t2, clock.mark()))
  return marks


def _graphed_marks(steps: dict, clock: _TorchClock, batches: Sequence[dict],
                   dense_steps: Sequence[bool]) -> list[tuple]:
  """:func:`_torch_marks` of a ``graphed`` variant: per batch, loads it into the static buffers of
  ``steps[dense]`` (a :class:`benchmarks.torch_graph.GraphedStep` per crossover choice), then
  replays the forward, backward and optimizer graphs between the marks."""
  marks = []
  for batch, dense in zip(batches, dense_steps):
    step = steps[dense]
    step.load(batch)
    t0 = clock.mark()
    step.forward.replay()
    t1 = clock.mark()
    step.backward.replay()
    t2 = clock.mark()
    step.step.replay()
    marks.append((t0, t1, t2, clock.mark()))
  return marks


def torch_variant_model(spec: ModelSpec, variant: Variant, device: str):
  """The variant's torch model: Hugging Face in bfloat16, patched or compiled as it says."""
  import torch

  from sebp_torch_ref import RowPolicy, apply_sebp

  from benchmarks.torch_bound import free_linear_backward_

  model = spec.torch_model(device)
  if variant.impl == "bound":
    free_linear_backward_(model)
  elif variant.impl != "dense":
    max_rows = spec.paper_max_rows if variant.max_rows == "paper" else None
    apply_sebp(model, RowPolicy(max_rows=max_rows), impl=_torch_impl(variant, device))
  model.train()
  return torch.compile(model) if variant.compiled else model


def _torch_impl(variant: Variant, device: str) -> str:
  """The backend a torch variant runs: Triton needs CUDA (or its interpreter), so elsewhere the
  SEBP variants run the index-op backend."""
  return "torch" if variant.impl == "triton" and device != "cuda" else variant.impl


def torch_dense_steps(variant: Variant, batches: Sequence[Batch]) -> list[bool]:
  """Per host batch, whether a torch SEBP variant runs that step's backward dense: more than
  :data:`TORCH_CROSSOVER` of its tokens real. Decided from the host's copy of the batch, so the
  crossover costs no device read."""
  sebp = variant.impl == "triton"
  return [sebp and float(b["attention_mask"].mean()) > TORCH_CROSSOVER for b in batches]


def _spread(samples: Sequence[float]) -> float | None:
  median = _median(samples)
  return (max(samples) - min(samples)) / median if median > 0 else None


def _capture_steps(steps: dict, model, optimizer, variant: Variant, batch: dict,
                   dense_steps: Sequence[bool]) -> None:
  """Adds to ``steps`` a :class:`benchmarks.torch_graph.GraphedStep` for each crossover choice
  in ``dense_steps`` that has none, captured on ``batch``'s shapes."""
  from benchmarks.torch_graph import GraphedStep

  for dense in sorted(set(dense_steps) - set(steps)):
    steps[dense] = GraphedStep(model, optimizer, batch,
                               functools.partial(torch_forward_context, variant, dense=dense))


def run_torch(spec: ModelSpec, variant: Variant, settings: Settings) -> Iterator[Row | dict]:
  """Runs ``variant`` (torch) on every workload and batch size, under its ``launch`` options;
  yields the device, then rows."""
  with launch_options(variant.launch):
    yield from _run_torch(spec, variant, settings)


def _run_torch(spec: ModelSpec, variant: Variant, settings: Settings) -> Iterator[Row | dict]:
  import torch

  device = "cuda" if torch.cuda.is_available() else "cpu"
  yield {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
         "platform": device}
  if variant.max_rows == "paper" and spec.paper_max_rows is None:
    return  # the paper states no fixed Top-N for this model
  if variant.graphed and device != "cuda":
    raise ValueError(f"{variant.name}: CUDA graphs need a CUDA device, and torch sees none.")
  torch.manual_seed(0)
  model = torch_variant_model(spec, variant, device)
  # A graphed optimizer step keeps its step count on the device (capturable).
  optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                                capturable=variant.graphed)
  clock = _TorchClock(torch, device)
  for batch_size in sorted(spec.batch_sizes):
    graphed = {}  # crossover choice -> GraphedStep, shared by the batch size's workloads
    for workload in spec.workloads:
      batches, active = workload_batches(spec, workload, batch_size, settings, dynamic=False)
      row = Row(workload.name, workload.dataset, "torch", _torch_impl(variant, device),
                variant.name, batch_size, spec.seq_len, active)
      dense_steps = torch_dense_steps(variant, batches)
      try:
        device_batches = [{k: torch.from_numpy(v).long().to(device) for k, v in b.items()}
                          for b in batches]
        if variant.graphed:
          _capture_steps(graphed, model, optimizer, variant, device_batches[0], dense_steps)
        if device == "cuda":
          torch.cuda.synchronize()
          torch.cuda.reset_peak_memory_stats()
        if variant.graphed:
          timed = _graphed_marks(graphed, clock, device_batches, dense_steps)
        else:
          timed = _torch_marks(model, optimizer, clock, variant, device_batches, dense_steps)
        warm, timed = timed[:settings.warmup], timed[settings.warmup:]
        if device == "cuda":
          torch.cuda.synchronize()
          row.peak_mem_bytes = torch.cuda.max_memory_allocated()
        row.fwd_ms = _median([clock.ms(t0, t1) for t0, t1, _, _ in timed])
        backward = [clock.ms(t1, t2) for _, t1, t2, _ in timed]
        row.bwd_ms, row.bwd_spread = _median(backward), _spread(backward)
        row.opt_ms = _median([clock.ms(t2, t3) for _, _, t2, t3 in timed])
        row.step_ms = _median([clock.ms(t0, t3) for t0, _, _, t3 in timed])
        if variant.compiled and warm:
          # Floored at 0: with Inductor's caches warm the warm-up step can be no slower than a
          # timed one (compile_s is then noise, not a negative compile time).
          extra_ms = sum(clock.ms(t0, t3) - row.step_ms for t0, _, _, t3 in warm)
          row.compile_s = max(0.0, extra_ms / 1e3)
      except Exception as e:  # recorded; the next workload runs
        row.error = _error_text(e)
        optimizer.zero_grad(set_to_none=True)
      if row.error is not None and device == "cuda":
        torch.cuda.empty_cache()  # the failed step's graph is gone once the exception is
      yield row


# ----------------------------------------------------------------------------- driver

def _error_text(error: BaseException) -> str:
  return f"{type(error).__name__}: {str(error).strip()[:500]}"


def library_versions() -> dict[str, str | None]:
  """Library versions, read from package metadata (importing them here would grab the GPU)."""
  out = {}
  for name in ("jax", "jaxlib", "flax", "optax", "torch", "triton", "transformers"):
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = None
  return out


def versions_text(versions: dict[str, str | None]) -> str:
  """``"jax 0.11.2, flax 0.12.10, ..."``: the installed ones of :func:`library_versions`."""
  return ", ".join(f"{name} {version}" for name, version in versions.items() if version)


def _error_rows(spec: ModelSpec, variant: Variant, settings: Settings, error: str) -> list[Row]:
  rows = []
  for batch_size in sorted(spec.batch_sizes):
    for workload in spec.workloads:
      lengths = workload.lengths(batch_size, spec.seq_len, settings.warmup + settings.steps)
      if variant.impl == "dynamic" and lengths.min() == spec.seq_len:
        continue  # not run: see run_jax
      rows.append(Row(workload.name, workload.dataset, variant.framework, variant.impl,
                      variant.name, batch_size, spec.seq_len,
                      float(lengths.mean() / spec.seq_len), error=error))
  return rows


def _run_variant(spec: ModelSpec, variant: Variant, settings: Settings) -> Iterator[Row | dict]:
  runner = run_jax if variant.framework == "jax" else run_torch
  return runner(spec, variant, settings)


def _worker(spec: ModelSpec, variant: Variant, settings: Settings, out: pathlib.Path) -> None:
  """Subprocess entry: runs one variant, rewriting ``out`` after every row (a crash keeps them)."""
  environment, rows = None, []

  def write():  # atomically: the driver may read it after killing this process
    partial = out.with_suffix(".partial")
    partial.write_text(json.dumps({"environment": environment,
                                   "rows": [dataclasses.asdict(r) for r in rows]}))
    os.replace(partial, out)

  for item in _run_variant(spec, variant, settings):
    if isinstance(item, Row):
      rows.append(item)
      print(f"  {item.variant} {item.workload} b{item.batch}: step {_fmt(item.step_ms)} ms, "
            f"fwd {_fmt(item.fwd_ms)} ms, compiles {_fmt(item.compile_count, 'd')}"
            + (f", compile {item.compile_s:.1f} s" if item.compile_s is not None else "")
            + (f", {item.error}" if item.error else ""), flush=True)
    else:
      environment = item
    write()
  write()  # the runner completes rows in place after yielding them


def _in_subprocess(spec: ModelSpec, variant: Variant, settings: Settings, argv: Sequence[str],
                   timeout: float) -> tuple[dict | None, list[Row]]:
  """Runs one variant through ``python -m benchmarks.<spec.name> --worker``; rows it did not
  finish become error rows carrying the end of its stderr."""
  with tempfile.TemporaryDirectory() as tmp:
    out, log = pathlib.Path(tmp) / "rows.json", pathlib.Path(tmp) / "stderr.txt"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    # The JAX allocator takes 75 % of the GPU by default; LLaMA-3B at batch 4 needs more.
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if variant.command_buffers:
      env["XLA_FLAGS"] = xla_flags.with_command_buffer_flags(env.get("XLA_FLAGS", ""))
    command = [sys.executable, "-m", f"benchmarks.{spec.name}", *argv,
               "--worker", variant.name, "--worker-out", str(out)]
    error = None
    try:  # the worker's progress lines (stdout) pass through; stderr is kept for the error rows
      with open(log, "w") as stderr:
        done = subprocess.run(command, cwd=REPO, env=env, timeout=timeout, stderr=stderr)
      if done.returncode != 0:
        error = f"worker exited with {done.returncode}: {log.read_text().strip()[-800:]}"
    except subprocess.TimeoutExpired:
      error = f"worker timed out after {timeout:.0f} s"
    result = json.loads(out.read_text()) if out.is_file() else {"environment": None, "rows": []}
  rows = [Row(**r) for r in result["rows"]]
  if error is not None:
    print(f"  {variant.name}: {error}", file=sys.stderr)
    finished = {(r.workload, r.batch) for r in rows}
    rows += [r for r in _error_rows(spec, variant, settings, error)
             if (r.workload, r.batch) not in finished]
  return result["environment"], rows


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    description="Training-step time and memory of every variant on every workload.")
  parser.add_argument("--out-dir", type=pathlib.Path, default=REPO / "benchmarks" / "results")
  parser.add_argument("--tiny", action="store_true",
                      help="a tiny model, context and batch (CPU smoke runs)")
  parser.add_argument("--variants", nargs="+", choices=[v.name for v in VARIANTS],
                      help="run in this order (default: every variant the model has)")
  parser.add_argument("--workloads", nargs="+", metavar="NAME",
                      help="run only these workloads (default: all)")
  parser.add_argument("--batches", nargs="+", type=int, metavar="B",
                      help="run only these batch sizes (default: the script's)")
  parser.add_argument("--warmup", type=int, help="untimed steps per workload (default: the "
                      "script's)")
  parser.add_argument("--steps", type=int, help="timed steps, each on a distinct batch "
                      "(default: the script's)")
  parser.add_argument("--in-process", action="store_true",
                      help="run the variants in this process (CPU only: JAX and torch would "
                           "share a GPU, and the JAX memory peak would be cumulative)")
  parser.add_argument("--variant-timeout", type=float, default=300.0,
                      help="seconds before a variant's subprocess is stopped")
  parser.add_argument("--time-budget", type=float, default=540.0,
                      help="seconds for the whole run: a variant gets at most what is left, "
                           "and variants with nothing left become error rows")
  parser.add_argument("--tag", default="", help="appended to the result files' names")
  parser.add_argument("--worker", help=argparse.SUPPRESS)
  parser.add_argument("--worker-out", type=pathlib.Path, help=argparse.SUPPRESS)
  return parser


def _select(spec: ModelSpec, args: argparse.Namespace) -> ModelSpec:
  workloads = spec.workloads
  if args.workloads:
    known = {w.name for w in workloads}
    unknown = set(args.workloads) - known
    if unknown:
      raise SystemExit(f"--workloads: unknown {sorted(unknown)}; known: {sorted(known)}")
    workloads = tuple(w for w in workloads if w.name in args.workloads)
  batch_sizes = tuple(args.batches) if args.batches else spec.batch_sizes
  if min(batch_sizes) < 1:
    raise SystemExit("--batches: batch sizes must be >= 1")
  return dataclasses.replace(spec, workloads=workloads, batch_sizes=batch_sizes)


def main(build: Callable[[bool], ModelSpec], argv: Sequence[str] | None = None) -> list[Row]:
  """Command line of a model script: ``build(tiny)`` gives its :class:`ModelSpec`."""
  argv = list(sys.argv[1:] if argv is None else argv)
  args = _parser().parse_args(argv)
  spec = _select(build(args.tiny), args)
  if args.variants is None:
    # The command-buffer A/B variants only when asked for: three more compilations per run.
    args.variants = [v.name for v in VARIANTS if not v.command_buffers
                     and (v.layers == "dense" or spec.jax_einsum_module is not None)]
  settings = Settings(spec.warmup if args.warmup is None else args.warmup,
                      spec.steps if args.steps is None else args.steps)
  if settings.warmup < 0 or settings.steps < 1:
    raise SystemExit("--warmup must be >= 0 and --steps >= 1")
  by_name = {v.name: v for v in VARIANTS}
  if args.worker:
    _worker(spec, by_name[args.worker], settings, args.worker_out)
    return []

  forwarded = [a for a in argv if a != "--in-process"]
  header: dict[str, Any] = {"benchmark": spec.name, "gpu": None, "platform": None,
                            "dtype": "bfloat16", "seq_len": spec.seq_len,
                            "batch_sizes": list(spec.batch_sizes), "warmup": settings.warmup,
                            "steps": settings.steps, "versions": library_versions(),
                            "xla_flags": os.environ.get("XLA_FLAGS", ""),
                            "jax_forward": JAX_FORWARD, "rows": []}
  # Runs split by batch size (to fit a time limit) write files of their own.
  stem = spec.name + ("_tiny" if args.tiny else "") + "".join(
    f"_b{b}" for b in (args.batches or ())) + (f"_{args.tag}" if args.tag else "")
  rows: list[Row] = []
  deadline = time.perf_counter() + args.time_budget
  # In the order given: a run cut short by its time budget keeps the variants named first.
  for name in dict.fromkeys(args.variants):
    variant = by_name[name]
    print(f"{spec.name}: {name} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    left = deadline - start
    if left < 10:
      environment = None
      variant_rows = _error_rows(spec, variant, settings, "skipped: --time-budget spent")
    elif args.in_process and variant.command_buffers:
      environment = None
      variant_rows = _error_rows(spec, variant, settings, "skipped: its XLA_FLAGS need a worker "
                                 "process of their own (not --in-process)")
    elif args.in_process:
      environment, variant_rows = None, []
      try:
        for item in _run_variant(spec, variant, settings):
          if isinstance(item, Row):
            variant_rows.append(item)
          else:
            environment = item
      except Exception as e:
        traceback.print_exc()
        done = {(r.workload, r.batch) for r in variant_rows}
        variant_rows += [r for r in _error_rows(spec, variant, settings, _error_text(e))
                         if (r.workload, r.batch) not in done]
    else:
      environment, variant_rows = _in_subprocess(spec, variant, settings, forwarded,
                                                 min(args.variant_timeout, left))
    print(f"  {name}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    if environment and (header["gpu"] is None or variant.framework == "jax"):
      header["gpu"], header["platform"] = environment["device"], environment["platform"]
    rows += variant_rows
    header["rows"] = [dataclasses.asdict(r) for r in rows]
    write_results(args.out_dir, stem, header)  # after every variant: a cut-off run keeps its rows
  return rows


# ----------------------------------------------------------------------------- outputs

def speedups(rows: Sequence[dict], keys: Sequence[str] = ("bwd_ms", "step_ms"),
             ) -> dict[tuple, tuple[float | None, ...]]:
  """``(workload, batch, variant) -> (speedup of each of keys)`` (default: the backward's and the
  step's) against the variant's baseline (:attr:`Variant.baseline`: :data:`BASELINE`, or
  :data:`EINSUM_BASELINE` for the einsum-built variants)."""
  base = {(r["workload"], r["batch"], r["variant"]): r for r in rows if r["error"] is None}
  baselines = {v.name: v.baseline for v in VARIANTS}
  out = {}
  for r in rows:
    b = base.get((r["workload"], r["batch"], baselines.get(r["variant"], BASELINE)))
    if b is None or r["error"] is not None:
      out[(r["workload"], r["batch"], r["variant"])] = (None,) * len(keys)
      continue
    # Keys that older result files lack count as not measured.
    ratio = lambda key: (b[key] / r[key]  # noqa: E731
                         if r.get(key) and r[key] > 0 and b.get(key) is not None else None)
    out[(r["workload"], r["batch"], r["variant"])] = tuple(ratio(key) for key in keys)
  return out


# The speedups the tables give: the backward's, the forward and backward together (with_grad_ms),
# the step's.
GRAD_KEYS = ("bwd_ms", "grad_ms", "step_ms")


def with_grad_ms(row: dict) -> dict:
  """``row`` with ``grad_ms``, the forward and the backward together: in JAX the
  loss-and-gradients program as timed, where ``bwd_ms`` is that program less the forward program
  timed alone, so it moves with how the two programs' schedules differ; ``grad_ms`` does not."""
  parts = (row["fwd_ms"], row["bwd_ms"])
  return {**row, "grad_ms": None if None in parts else sum(parts)}


def _fmt(value, spec: str = ".2f") -> str:
  return "–" if value is None else format(value, spec)


def markdown_table(result: dict) -> str:
  """The rows as a markdown table, with speedups against ``jax-dense``."""
  rows = [with_grad_ms(r) for r in result["rows"]]
  ratios = speedups(rows, (*GRAD_KEYS, "gpu_bwd_ms"))
  lines = [
    f"# {result['benchmark']}: {result['gpu']}, {result['dtype']}, context {result['seq_len']}",
    "",
    f"Medians of {result['steps']} steps after {result['warmup']} warm-up steps. "
    "Speedups are jax-dense's time over the variant's (`python -m benchmarks.summary` gives each "
    "framework's own; jax-dense-einsum's for the einsum-built variants); grad ×: of the "
    "forward and backward together (JAX: the loss-and-gradients program as timed, of which the "
    f"backward is that program less the forward program timed alone: "
    f"{result.get('jax_forward', JAX_FORWARD)}). bwd GPU: the GPU time of the backward's "
    "kernels inside the loss-and-gradients program (JAX on a GPU: `benchmarks.device_trace`), "
    "no program subtracted. bwd spread: (max − min) / "
    "median of the torch backward over the steps. "
    f"Versions: {versions_text(result['versions'])}.{xla_flags_text(result)}"
    + (" Merged from the runs " + ", ".join(result["merged_from"]) + "."
       if result.get("merged_from") else ""),
    "",
    "| workload | batch | active % | variant | fwd ms | bwd ms | bwd GPU ms | opt ms | step ms "
    "| bwd × | bwd GPU × | grad × | step × | peak GB | compiles | bwd spread | error |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    bwd_x, grad_x, step_x, gpu_bwd_x = ratios[(r["workload"], r["batch"], r["variant"])]
    peak = None if r["peak_mem_bytes"] is None else r["peak_mem_bytes"] / 1e9
    spread = r.get("bwd_spread")  # torch rows; absent from older result files
    error = (r["error"] or "").replace("|", "/").replace("\n", " ")[:120]
    lines.append(
      f"| {r['workload']} | {r['batch']} | {100 * r['active_fraction']:.1f} | {r['variant']} "
      f"| {_fmt(r['fwd_ms'])} | {_fmt(r['bwd_ms'])} | {_fmt(r.get('gpu_bwd_ms'))} "
      f"| {_fmt(r['opt_ms'])} | {_fmt(r['step_ms'])} | {_fmt(bwd_x)} | {_fmt(gpu_bwd_x)} "
      f"| {_fmt(grad_x)} | {_fmt(step_x)} "
      f"| {_fmt(peak)} "
      f"| {_fmt(r['compile_count'], 'd')} | {_fmt(spread, '.0%')} | {error} |")
  return "\n".join(lines) + "\n"


def write_results(out_dir: pathlib.Path, stem: str, result: dict) -> list[pathlib.Path]:
  """Writes ``<stem>.json``, ``<stem>.md`` and the figures of :mod:`benchmarks.figures`."""
  out_dir.mkdir(parents=True, exist_ok=True)
  json_path = out_dir / f"{stem}.json"
  json_path.write_text(json.dumps(result, indent=1) + "\n")
  md_path = out_dir / f"{stem}.md"
  md_path.write_text(markdown_table(result))
  written = [json_path, md_path]
  try:
    from benchmarks import figures
  except ImportError as e:  # matplotlib missing: `python -m benchmarks.figures` renders them later
    print(f"figures skipped ({e})", file=sys.stderr)
    return written
  return written + figures.render(result, out_dir, stem)


def _export_main() -> None:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.workloads")
  parser.add_argument("--export-lengths", type=pathlib.Path, required=True, metavar="PATH",
                      help=f"write the token lengths file (default place: {LENGTHS_FILE})")
  args = parser.parse_args()
  payload = export_lengths(args.export_lengths)
  for family, tasks in payload["lengths"].items():
    for task, lengths in tasks.items():
      print(f"{family:5s} {task:16s} n={len(lengths):5d} mean={np.mean(lengths):6.1f} "
            f"max={max(lengths)}")
  print(f"wrote {args.export_lengths} ({args.export_lengths.stat().st_size / 1e3:.0f} kB)")


if __name__ == "__main__":
  _export_main()
