"""SEBP on several GPUs: one GPU against N at the same per-GPU batch, dense against SEBP.

* **LLaMA-3.2-3B, FSDP**: context 4096, 2 sequences per GPU; parameters and AdamW state sharded
  over the GPUs (each array along its largest dim that splits evenly,
  :func:`sebp_jax.sharding.fsdp_spec`), gathered for use and reduce-scattered back by XLA. By
  default the first ``--llama-layers 8`` of its 28 decoder layers (the exact layer shapes,
  embeddings and 128,256-token head), so that the whole run, compiles included, fits 8 minutes;
  ``--llama-layers 28`` runs the whole model.
* **BERT-base, data parallel**: context 512, 32 sequences per GPU, parameters replicated.

Real token lengths (:mod:`benchmarks.workloads`; ``--workloads`` chooses them), bfloat16, random
weights. Each device count has a 1-D mesh ``"data"`` over the first GPUs, batches split along it,
and the SEBP layers told so (:func:`sebp_jax.sharded_rows`); SEBP runs as ``sebp finetune`` runs
it, with the attention mask as row plan and no conditional. Every device gets the one-device
run's sequences, so the device counts differ in nothing but the devices. Times are medians of wall-clock
times of three jitted programs, as in :mod:`benchmarks.workloads`: ``fwd`` (the loss), ``grad``
(loss and gradients; ``bwd = grad - fwd``) and ``step`` (gradients and the AdamW update).

Read from the result (per model and workload):

* ``bwd speedup``: dense backward time over SEBP's on 1 GPU and on N; their ratio, the share of
  its one-GPU speedup that SEBP keeps on N GPUs (target >= 0.9);
* ``scaling``: N-GPU training throughput (sequences per second of ``step``) over one GPU's, for
  SEBP and dense (target for SEBP: >= 0.9 N).

Usage (writes ``multi_device.json``, ``multi_device.md`` and ``multi_device.png``)::

    python -m benchmarks.multi_device --out-dir benchmarks/results/h100x2
    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
      python -m benchmarks.multi_device --tiny --out-dir /tmp/md   # CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import sys
import time
from typing import Any, Iterator, Sequence

import numpy as np

from benchmarks.workloads import (LR, REPO, WEIGHT_DECAY, ModelSpec, Settings, library_versions,
                                  random_params, versions_text, workload_batches, xla_flags_text)

__all__ = ["MODELS", "Row", "add_model_arguments", "model_note", "model_spec", "placement",
           "programs", "run_model", "summarize", "rest_ms", "markdown", "main"]

TARGET_SPEEDUP_KEPT = 0.9   # N-GPU SEBP backward speedup over its 1-GPU speedup
TARGET_SCALING_PER_GPU = 0.9  # N-GPU SEBP throughput over N times one GPU's


@dataclasses.dataclass(frozen=True)
class ModelCase:
  """A model as this benchmark runs it: how parameters are placed and the per-GPU batch."""

  name: str
  fsdp: bool
  per_device_batch: int
  tiny_per_device_batch: int


MODELS = {
  "llama": ModelCase("llama", fsdp=True, per_device_batch=2, tiny_per_device_batch=2),
  "bert": ModelCase("bert", fsdp=False, per_device_batch=32, tiny_per_device_batch=4),
}


@dataclasses.dataclass
class Row:
  """One variant on one workload at one device count. Times in ms; ``None`` where not run."""

  model: str
  parallelism: str
  devices: int
  per_device_batch: int
  workload: str
  active_fraction: float
  variant: str
  fwd_ms: float | None = None
  bwd_ms: float | None = None
  step_ms: float | None = None
  sequences_per_s: float | None = None
  compile_s: float | None = None
  error: str | None = None


def model_spec(case: ModelCase, args: argparse.Namespace) -> ModelSpec:
  from benchmarks import bert, llama

  if case.name == "llama":
    return llama.build(args.tiny, layers=args.llama_layers, scan_layers=args.scan_layers)
  return bert.build(args.tiny)


def placement(mesh, fsdp: bool):
  """``tree -> tree`` on ``mesh``: replicated, or FSDP-sharded when ``fsdp``."""
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P

  from sebp_jax.sharding import fsdp_spec

  def place(leaf):
    spec = fsdp_spec(leaf.shape, "data", mesh.size) if fsdp else P()
    return jax.device_put(leaf, NamedSharding(mesh, spec))

  return lambda tree: jax.tree.map(place, tree)


def programs(spec: ModelSpec, module, variant: str, mesh, optimizer, dense_head: bool = False):
  """The jitted ``fwd``, ``grad`` and ``step`` programs of ``variant`` on ``mesh``; with
  ``dense_head`` SEBP leaves the tied output projection (``Embed.attend``) to autodiff."""
  import jax
  import optax

  from sebp_jax import RowPolicy, row_plan, sharded_rows, swap_dense

  where = (lambda path: path[-1] != "attend") if dense_head else None

  def loss(params, batch):
    context = contextlib.ExitStack()
    if variant == "sebp":
      # As `sebp finetune` trains (every workload here is below the crossover): the attention
      # mask as row plan, which each device re-plans for its rows, and no conditional.
      plan = row_plan(batch["attention_mask"])
      context.enter_context(swap_dense(RowPolicy(), crossover=1.0, rows=plan, where=where))
      context.enter_context(sharded_rows("data", mesh=mesh))
    with context:
      return spec.jax_loss(module, params, batch)

  def step(params, opt_state, batch):
    value, grads = jax.value_and_grad(loss)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return (jax.jit(loss), jax.jit(jax.value_and_grad(loss)),
          jax.jit(step, donate_argnums=(0, 1)))


def _median_ms(fn, batches) -> float:
  from benchmarks.timing import wall_ms

  return float(np.median([wall_ms(lambda: fn(b)) for b in batches]))


def run_model(case: ModelCase, spec: ModelSpec, per_device: int, device_counts: Sequence[int],
              settings: Settings, deadline: float, dense_head: bool = False) -> Iterator[Row]:
  """Every variant on every workload at every device count; rows as they are measured."""
  import jax
  import optax
  from jax.sharding import NamedSharding, PartitionSpec as P

  module = spec.jax_module()
  optimizer = optax.adamw(LR, weight_decay=WEIGHT_DECAY)
  parallelism = "fsdp" if case.fsdp else "data parallel"
  host_params = jax.device_get(random_params(module, spec))
  for devices in device_counts:
    mesh = jax.make_mesh((devices,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:devices])
    place = placement(mesh, case.fsdp)
    for variant in ("dense", "sebp"):
      fwd, grad, step = programs(spec, module, variant, mesh, optimizer, dense_head)
      params = place(host_params)
      opt_state = place(jax.jit(optimizer.init)(params))
      for workload in spec.workloads:
        batches, active = workload_batches(spec, workload, per_device, settings, dynamic=False)
        # Every device gets the same sequences as the one-device run: the comparison then
        # measures what going to N devices costs, not a different draw of lengths.
        batches = [{k: np.concatenate([v] * devices) for k, v in b.items()} for b in batches]
        row = Row(case.name, parallelism, devices, per_device, workload.name, active, variant)
        if time.perf_counter() > deadline:
          row.error = "skipped: --time-budget spent"
          yield row
          continue
        try:
          batches = [jax.device_put(b, NamedSharding(mesh, P("data"))) for b in batches]
          start = time.perf_counter()
          jax.block_until_ready((fwd(params, batches[0]), grad(params, batches[0])))
          params, opt_state, _ = jax.block_until_ready(step(params, opt_state, batches[0]))
          row.compile_s = time.perf_counter() - start
          for b in batches[:settings.warmup]:
            # All three programs: under --pgle each one's first call is its profiled run and its
            # second recompiles it with the profile, so no timed call may be either.
            jax.block_until_ready((fwd(params, b), grad(params, b)))
            params, opt_state, _ = step(params, opt_state, b)
          timed = batches[settings.warmup:]
          row.fwd_ms = _median_ms(lambda b: fwd(params, b), timed)
          grad_ms = _median_ms(lambda b: grad(params, b), timed)
          step_times = []
          for b in timed:
            began = time.perf_counter()
            params, opt_state, value = step(params, opt_state, b)
            jax.block_until_ready(value)
            step_times.append((time.perf_counter() - began) * 1e3)
          row.step_ms = float(np.median(step_times))
          row.bwd_ms = grad_ms - row.fwd_ms
          row.sequences_per_s = per_device * devices / row.step_ms * 1e3
        except Exception as e:  # recorded (an out-of-memory, say); the next workload runs
          row.error = f"{type(e).__name__}: {str(e).strip()[:400]}"
        print(f"  {case.name} {devices} device(s) {variant} {workload.name}: step "
              f"{row.step_ms} ms, bwd {row.bwd_ms} ms" + (f", {row.error}" if row.error else ""),
              file=sys.stderr, flush=True)
        yield row
      del params, opt_state


def _ratio(a: float | None, b: float | None) -> float | None:
  return a / b if a is not None and b is not None and b > 0 else None


def summarize(rows: Sequence[dict]) -> list[dict]:
  """Per model and workload: SEBP's backward speedup over dense at 1 and N devices, the share
  of it kept on N devices, and N-device throughput over one device's, for SEBP and dense."""
  by_key = {(r["model"], r["workload"], r["devices"], r["variant"]): r
            for r in rows if r["error"] is None}
  out = []
  for model, workload in dict.fromkeys((r["model"], r["workload"]) for r in rows):
    counts = sorted({r["devices"] for r in rows if r["model"] == model})
    one, many = counts[0], counts[-1]
    get = lambda n, v, key: by_key.get((model, workload, n, v), {}).get(key)  # noqa: E731
    speedup_one = _ratio(get(one, "dense", "bwd_ms"), get(one, "sebp", "bwd_ms"))
    speedup_many = _ratio(get(many, "dense", "bwd_ms"), get(many, "sebp", "bwd_ms"))
    out.append({
      "model": model, "workload": workload, "devices": many,
      "bwd_speedup_1": speedup_one, "bwd_speedup_n": speedup_many,
      "speedup_kept": _ratio(speedup_many, speedup_one),
      "sebp_scaling": _ratio(get(many, "sebp", "sequences_per_s"),
                             get(one, "sebp", "sequences_per_s")),
      "dense_scaling": _ratio(get(many, "dense", "sequences_per_s"),
                              get(one, "dense", "sequences_per_s")),
    })
  return out


def _fmt(value, spec: str = ".2f") -> str:
  return "–" if value is None else format(value, spec)


def rest_ms(row: dict) -> float | None:
  """The step's time outside its forward and backward: the optimizer update, plus whatever the
  step program does differently from the separately timed gradient program; ``None`` where a
  time is missing."""
  parts = (row["step_ms"], row["fwd_ms"], row["bwd_ms"])
  return None if None in parts else parts[0] - parts[1] - parts[2]


def markdown(result: dict) -> str:
  """The summary and every row as markdown tables."""
  n = max((r["devices"] for r in result["rows"]), default=1)
  lines = [
    f"# SEBP on {n} devices: {result['gpu']}, bfloat16", "",
    f"Medians of {result['steps']} steps after {result['warmup']} warm-up steps, on 1 device and "
    f"on {n} at the same per-device batch. {result['note']} Versions: "
    f"{versions_text(result['versions'])}.{xla_flags_text(result)}", "",
    f"Targets: SEBP keeps >= {TARGET_SPEEDUP_KEPT:.0%} of its one-device backward speedup on "
    f"{n} devices; its {n}-device throughput is >= {TARGET_SCALING_PER_GPU * n:.1f}x one "
    f"device's.", "",
    "| model | workload | bwd × dense, 1 dev | bwd × dense, N dev | kept | SEBP scaling "
    "| dense scaling |",
    "|---|---|---|---|---|---|---|",
  ]
  for s in result["summary"]:
    lines.append(f"| {s['model']} | {s['workload']} | {_fmt(s['bwd_speedup_1'])} "
                 f"| {_fmt(s['bwd_speedup_n'])} | {_fmt(s['speedup_kept'])} "
                 f"| {_fmt(s['sebp_scaling'])} | {_fmt(s['dense_scaling'])} |")
  lines += [
    "", "| model | parallelism | devices | batch/device | workload | active % | variant "
    "| fwd ms | bwd ms | step ms | rest ms | seq/s | compile s | error |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in result["rows"]:
    error = (r["error"] or "").replace("|", "/").replace("\n", " ")[:120]
    lines.append(
      f"| {r['model']} | {r['parallelism']} | {r['devices']} | {r['per_device_batch']} "
      f"| {r['workload']} | {100 * r['active_fraction']:.1f} | {r['variant']} "
      f"| {_fmt(r['fwd_ms'])} | {_fmt(r['bwd_ms'])} | {_fmt(r['step_ms'])} | {_fmt(rest_ms(r))} "
      f"| {_fmt(r['sequences_per_s'], '.1f')} | {_fmt(r['compile_s'], '.0f')} | {error} |")
  return "\n".join(lines) + "\n"


def _figure(result: dict, path: pathlib.Path) -> pathlib.Path:
  """Two panels per summary row: backward speedup at 1 and N devices; throughput scaling."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  summary = result["summary"]
  labels = [f"{s['model']}\n{s['workload']}" for s in summary]
  x = np.arange(len(summary))
  value = lambda key: [np.nan if s[key] is None else s[key] for s in summary]  # noqa: E731
  n = max((s["devices"] for s in summary), default=1)
  fig, (left, right) = plt.subplots(1, 2, figsize=(max(8, 2.2 * len(summary) + 4), 4))
  left.bar(x - 0.2, value("bwd_speedup_1"), 0.4, label="1 device")
  left.bar(x + 0.2, value("bwd_speedup_n"), 0.4, label=f"{n} devices")
  left.axhline(1.0, color="gray", lw=0.8)
  left.set(title="SEBP backward speedup over dense", xticks=x, xticklabels=labels)
  left.legend()
  right.bar(x - 0.2, value("sebp_scaling"), 0.4, label="SEBP")
  right.bar(x + 0.2, value("dense_scaling"), 0.4, label="dense")
  right.axhline(TARGET_SCALING_PER_GPU * n, color="gray", lw=0.8, ls="--", label="target")
  right.set(title=f"throughput, {n} devices over 1", xticks=x, xticklabels=labels)
  right.legend()
  fig.suptitle(f"{result['gpu']}: same per-device batch")
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)
  return path


def write(out_dir: pathlib.Path, stem: str, result: dict) -> list[pathlib.Path]:
  """``<stem>.json``, ``<stem>.md`` and ``<stem>.png`` under ``out_dir``."""
  out_dir.mkdir(parents=True, exist_ok=True)
  result["summary"] = summarize(result["rows"])
  paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md"]
  paths[0].write_text(json.dumps(result, indent=1) + "\n")
  paths[1].write_text(markdown(result))
  if result["summary"]:
    paths.append(_figure(result, out_dir / f"{stem}.png"))
  return paths


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
  """The options that say which models run and how they are built (``--models``,
  ``--llama-layers``, ``--scan-layers``, ``--dense-head``, ``--tiny``): the timing and the
  profiling benchmarks take the same."""
  parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
  parser.add_argument("--llama-layers", type=int, default=8, metavar="L",
                      help="LLaMA-3.2-3B decoder layers to keep (default 8 of 28)")
  parser.add_argument("--scan-layers", action="store_true",
                      help="LLaMA's decoder layers as one nn.scan over stacked parameters, so "
                           "that XLA's collective pipeliner can gather layer i+1's FSDP shards "
                           "while layer i computes (with XLA_FLAGS="
                           "--xla_gpu_enable_pipelined_all_gather=true "
                           "--xla_gpu_enable_pipelined_reduce_scatter=true)")
  parser.add_argument("--dense-head", action="store_true",
                      help="SEBP leaves LLaMA's tied output projection to autodiff: under FSDP "
                           "XLA keeps the vocabulary-sharded table in place for it and moves "
                           "activations, where SEBP's backward gathers the table and reduces its "
                           "gradient whole (python -m benchmarks.collective_bytes)")
  parser.add_argument("--tiny", action="store_true", help="tiny models (CPU smoke runs)")


def model_note(args: argparse.Namespace) -> str:
  """What :func:`add_model_arguments`' options built, in words, for the result files."""
  if args.tiny:
    return "Tiny models."
  layers = "all 28" if args.llama_layers == 28 else f"the first {args.llama_layers} of 28"
  return (f"LLaMA-3.2-3B with {layers} decoder layers (exact shapes"
          f"{', scanned' if args.scan_layers else ''}"
          f"{', SEBP with a dense tied head' if args.dense_head else ''}), FSDP, context 4096, "
          f"2 sequences per device; BERT-base data parallel, context 512, 32 per device.")


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.multi_device", description=__doc__
                                   .split("\n\n")[0])
  parser.add_argument("--out-dir", type=pathlib.Path, default=REPO / "benchmarks" / "results")
  add_model_arguments(parser)
  parser.add_argument("--devices", type=int,
                      help="the device count compared with one (default: every device)")
  parser.add_argument("--workloads", type=int, default=1, metavar="N",
                      help="the first N workloads of each model (default 1)")
  parser.add_argument("--warmup", type=int, default=1)
  parser.add_argument("--steps", type=int, default=3, help="timed steps, distinct batches")
  parser.add_argument("--time-budget", type=float, default=420.0,
                      help="seconds; what has not started by then becomes error rows")
  parser.add_argument("--tag", default="", help="appended to the result files' names")
  parser.add_argument("--pgle", action="store_true",
                      help="profile-guided latency estimation: each program is traced on its "
                           "first call and recompiled with the measured op times on its second, "
                           "so that XLA's scheduler knows what a collective can hide behind "
                           "(needs --warmup >= 1)")
  return parser


def main(argv: Sequence[str] | None = None) -> list[pathlib.Path]:
  args = _parser().parse_args(argv)
  if args.workloads < 1 or args.steps < 1 or args.warmup < 0:
    raise SystemExit("--workloads and --steps must be >= 1, --warmup >= 0")
  if args.pgle and args.warmup < 1:
    raise SystemExit("--pgle needs --warmup >= 1: the first warm-up call recompiles each program")
  import jax

  from benchmarks.timing import environment

  available = jax.device_count()
  devices = available if args.devices is None else args.devices
  if not 2 <= devices <= available:
    raise SystemExit(f"--devices must be between 2 and the {available} devices here")
  if args.pgle:
    jax.config.update("jax_enable_pgle", True)
    jax.config.update("jax_pgle_profiling_runs", 1)
  deadline = time.perf_counter() + args.time_budget
  settings = Settings(args.warmup, args.steps)
  env = environment()
  result: dict[str, Any] = {
    "benchmark": "multi_device", "gpu": env["device"], "platform": env["platform"],
    "devices": devices, "warmup": args.warmup,
    "steps": args.steps, "tiny": args.tiny, "versions": library_versions(),
    "xla_flags": os.environ.get("XLA_FLAGS", ""), "pgle": args.pgle,
    "note": ("Profile-guided latency estimation (--pgle): every program recompiled with its "
             "first call's op times. " if args.pgle else "") + model_note(args),
    "rows": []}
  stem = "multi_device" + ("_tiny" if args.tiny else "") + (f"_{args.tag}" if args.tag else "")
  paths = []
  for name in args.models:
    case = MODELS[name]
    spec = model_spec(case, args)
    spec = dataclasses.replace(spec, workloads=spec.workloads[:args.workloads])
    per_device = case.tiny_per_device_batch if args.tiny else case.per_device_batch
    for row in run_model(case, spec, per_device, (1, devices), settings, deadline,
                         args.dense_head):
      result["rows"].append(dataclasses.asdict(row))
      paths = write(args.out_dir, stem, result)  # after every row: a cut-off run keeps its rows
  for s in result["summary"]:
    print(f"{s['model']} {s['workload']}: bwd speedup {_fmt(s['bwd_speedup_1'])}x on 1 device, "
          f"{_fmt(s['bwd_speedup_n'])}x on {devices} (kept {_fmt(s['speedup_kept'])}); SEBP "
          f"throughput x{_fmt(s['sebp_scaling'])}, dense x{_fmt(s['dense_scaling'])}")
  print("wrote " + ", ".join(str(p) for p in paths))
  return paths


if __name__ == "__main__":
  main()
