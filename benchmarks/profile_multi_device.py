"""Where the time of a training step on several GPUs goes, and how much collective time is exposed.

For each model of :mod:`benchmarks.multi_device` (LLaMA-3.2-3B FSDP, BERT-base data parallel, the
same per-device batch and placement) and each variant (dense, SEBP), on a mesh over ``--devices``
GPUs: the median wall time of the jitted training step (gradients and the AdamW update), and from
a ``jax.profiler`` trace of ``--steps`` steps, per device: GPU busy time (the union of its kernels'
intervals), time per kernel family (:func:`benchmarks.profile_step.kernel_family`, collectives
included), and the **exposed collective time**: collective kernels running while no compute
kernel runs on that device (:func:`benchmarks.collective_overlap.exposed_ms`). A collective that
SEBP's shorter backward no longer hides shows as exposed time that dense does not have.

Usage (writes ``profile_multi_device.json`` and ``.md`` under ``--out-dir``)::

    python -m benchmarks.profile_multi_device --devices 2 --out-dir $OUT
    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
      python -m benchmarks.profile_multi_device --tiny --out-dir /tmp/pmd   # CPU: no kernels

On CPU the trace holds no GPU kernel: the tables then say so and only wall times are reported.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import pathlib
import statistics
import sys
from typing import Any, Sequence

import numpy as np

from benchmarks import device_trace, multi_device, profile_step
from benchmarks.collective_overlap import exposed_ms, is_collective, union
from benchmarks.workloads import (LR, WEIGHT_DECAY, REPO, Settings, random_params, workload_batches,
                                  xla_flags_text)

__all__ = ["TOP_KERNELS", "device_breakdown", "markdown", "main"]


# Kernels listed by name per device: a family total hides which kernel grew (a transposed LM-head
# gradient fused into the optimizer update showed as 8 ms more "XLA fusions, other" in one
# kernel: benchmarks/NOTES.md, "v12").
TOP_KERNELS = 12


def device_breakdown(events: Sequence[dict], steps: int) -> list[dict]:
  """Per device (one trace process per GPU), per step: busy, exposed collective and per-family
  ms, kernel launches and the :data:`TOP_KERNELS` longest kernels by name (``[name, ms]``);
  ``events``: the trace's GPU kernel events (:func:`benchmarks.device_trace.gpu_kernel_events`),
  ``steps`` traced steps."""
  by_device: dict[Any, list[dict]] = collections.defaultdict(list)
  for event in events:
    by_device[event["pid"]].append(event)
  out = []
  for pid in sorted(by_device):
    kernels = by_device[pid]
    per_kernel = profile_step.per_kernel_times(kernels, steps)
    families = profile_step.family_times(per_kernel)
    top = sorted(((name, ms) for name, (ms, _) in per_kernel.items()), key=lambda item: -item[1])
    busy = sum(end - start for start, end in union(
      (e["ts"], e["ts"] + e.get("dur", 0.0)) for e in kernels)) / 1e3 / steps
    collective = sum(e.get("dur", 0.0) for e in kernels if is_collective(e["name"])) / 1e3 / steps
    out.append({"device": pid, "busy_ms": busy, "collective_ms": collective,
                "exposed_collective_ms": exposed_ms(kernels) / steps,
                "launches": len(kernels) / steps, "families": dict(families),
                "kernels": [list(item) for item in top[:TOP_KERNELS]]})
  return out


def _profile(case, spec, devices: int, variant: str, settings: Settings, tiny: bool,
             dense_head: bool = False, hlo_path: pathlib.Path | None = None) -> dict:
  import jax
  import optax
  from jax.sharding import NamedSharding, PartitionSpec as P

  from benchmarks.timing import wall_ms

  module = spec.jax_module()
  optimizer = optax.adamw(LR, weight_decay=WEIGHT_DECAY)
  mesh = jax.make_mesh((devices,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:devices])
  place = multi_device.placement(mesh, case.fsdp)
  _, _, step = multi_device.programs(spec, module, variant, mesh, optimizer, dense_head)
  params = place(jax.device_get(random_params(module, spec)))
  opt_state = place(jax.jit(optimizer.init)(params))
  per_device = case.tiny_per_device_batch if tiny else case.per_device_batch
  batches, active = workload_batches(spec, spec.workloads[0], per_device, settings, dynamic=False)
  batches = [jax.device_put({k: np.concatenate([v] * devices) for k, v in b.items()},
                            NamedSharding(mesh, P("data"))) for b in batches]
  state = [params, opt_state]

  def run(batch):
    state[0], state[1], value = step(state[0], state[1], batch)
    return value

  for batch in batches[:max(settings.warmup, 1)]:  # compiles
    jax.block_until_ready(run(batch))
  if hlo_path is not None:  # where the collectives sit: in the layers' loop, or hoisted
    hlo = step.lower(*state, batches[0]).compile().as_text()  # the same program: a cache hit
    hlo_path.write_bytes(gzip.compress(hlo.encode()))
  timed = batches[settings.warmup:] or batches
  walls = [wall_ms(lambda: run(batch)) for batch in timed]
  events = device_trace.gpu_kernel_events(device_trace.traced_events(
    lambda: [jax.block_until_ready(run(batch)) for batch in timed]))
  return {"model": case.name, "parallelism": "fsdp" if case.fsdp else "data parallel",
          "devices": devices, "per_device_batch": per_device, "workload": spec.workloads[0].name,
          "active_fraction": active, "variant": variant,
          "step_ms": statistics.median(walls), "step_ms_min": min(walls),
          "step_ms_max": max(walls), "per_device": device_breakdown(events, len(timed))}


def markdown(result: dict) -> str:
  """One table per model: each variant's step and its devices' busy, collective and exposed ms,
  then the families of the first device."""
  lines = [f"# Where a {result['devices']}-device step's time goes: {result['gpu']}, bfloat16", "",
           f"Median (min–max) of {result['steps']} timed steps; GPU times per step from a trace of "
           f"them, per device. {result['note']}{xla_flags_text(result)}", ""]
  for model in dict.fromkeys(r["model"] for r in result["rows"]):
    rows = [r for r in result["rows"] if r["model"] == model]
    first = rows[0]
    lines += [f"## {model}, {first['parallelism']}, {first['per_device_batch']} per device, "
              f"{first['workload']} ({100 * first['active_fraction']:.1f} % real)", "",
              "| variant | step ms | device | busy ms | collectives ms | exposed collectives ms "
              "| launches |", "|---|---|---|---|---|---|---|"]
    for r in rows:
      step = f"{r['step_ms']:.2f} ({r['step_ms_min']:.2f}–{r['step_ms_max']:.2f})"
      if not r["per_device"]:
        lines.append(f"| {r['variant']} | {step} | no GPU kernels traced | | | | |")
      for d in r["per_device"]:
        lines.append(f"| {r['variant']} | {step} | {d['device']} | {d['busy_ms']:.2f} "
                     f"| {d['collective_ms']:.2f} | {d['exposed_collective_ms']:.2f} "
                     f"| {d['launches']:.0f} |")
    families = sorted({f for r in rows for d in r["per_device"][:1] for f in d["families"]})
    if families:
      lines += ["", "| family (first device), ms | " + " | ".join(r["variant"] for r in rows) + " |",
                "|---|" + "---|" * len(rows)]
      for family in families:
        lines.append(f"| {family} | " + " | ".join(
          f"{r['per_device'][0]['families'].get(family, 0.0):.2f}" for r in rows) + " |")
    tops = [dict(r["per_device"][0].get("kernels", [])) if r["per_device"] else {} for r in rows]
    names = sorted({n for top in tops for n in top},
                   key=lambda n: -max(top.get(n, 0.0) for top in tops))
    if names:
      lines += ["", f"| longest kernels (first device; each variant's {TOP_KERNELS}), ms | "
                + " | ".join(r["variant"] for r in rows) + " |", "|---|" + "---|" * len(rows)]
      for name in names:
        lines.append(f"| `{name[:60]}` | " + " | ".join(
          f"{top[name]:.2f}" if name in top else "–" for top in tops) + " |")
    lines.append("")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> pathlib.Path:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_multi_device",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--out-dir", type=pathlib.Path, default=REPO / "benchmarks" / "results")
  multi_device.add_model_arguments(parser)
  parser.add_argument("--devices", type=int, default=2)
  parser.add_argument("--warmup", type=int, default=1)
  parser.add_argument("--steps", type=int, default=5, help="timed, then traced, steps")
  parser.add_argument("--tag", default="", help="appended to the result files' names")
  parser.add_argument("--hlo", action="store_true",
                      help="also write each step program's optimized HLO, "
                           "hlo_<stem>_<model>_<variant>.txt.gz")
  args = parser.parse_args(argv)
  import jax

  from benchmarks.timing import environment
  from benchmarks.workloads import library_versions

  if not 1 <= args.devices <= jax.device_count():
    parser.error(f"--devices must be between 1 and the {jax.device_count()} devices here")
  settings = Settings(args.warmup, args.steps)
  env = environment()
  result = {"benchmark": "profile_multi_device", "gpu": env["device"], "devices": args.devices,
            "steps": args.steps, "versions": library_versions(), "rows": [],
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "note": multi_device.model_note(args)}
  stem = "profile_multi_device" + ("_tiny" if args.tiny else "") + (f"_{args.tag}" if args.tag
                                                                     else "")
  path = args.out_dir / f"{stem}.json"
  args.out_dir.mkdir(parents=True, exist_ok=True)
  for name in args.models:
    case = multi_device.MODELS[name]
    spec = multi_device.model_spec(case, args)
    for variant in ("dense", "sebp"):
      hlo_path = args.out_dir / f"hlo_{stem}_{name}_{variant}.txt.gz" if args.hlo else None
      row = _profile(case, spec, args.devices, variant, settings, args.tiny, args.dense_head,
                     hlo_path)
      result["rows"].append(row)
      print(f"  {name} {variant}: step {row['step_ms']:.2f} ms; exposed collectives per device "
            + ", ".join(f"{d['exposed_collective_ms']:.2f}" for d in row["per_device"]) + " ms",
            file=sys.stderr, flush=True)
      # After every variant: a run cut short keeps what it profiled.
      path.write_text(json.dumps(result, indent=1) + "\n")
      path.with_suffix(".md").write_text(markdown(result))
  return path


if __name__ == "__main__":
  main()
