"""Where the torch backward's time goes: GPU time per kernel family of a training step's
forward and backward, per torch variant (:data:`benchmarks.workloads.VARIANTS`).

The torch counterpart of :mod:`benchmarks.profile_step`: for one model, workload and batch size,
``--steps`` forward-and-backward calls of each variant run under ``torch.profiler``; every CUDA
kernel's time is summed per call and sorted into the families of
:func:`benchmarks.profile_step.kernel_family` (the SEBP Triton kernels, cuBLAS, attention, torch's
elementwise and reduction kernels, copies). ``wall ms`` (host-timed, synchronised calls) minus
``busy ms`` (the kernels' sum) is the time the GPU waits for the host: Python, autograd and
launch overhead.

Usage (writes ``profile_torch_bert_b32_glue_sst2.json`` and ``.md`` under ``--out-dir``)::

    python -m benchmarks.profile_torch --model bert --batch 32 --workload glue_sst2 \\
        --out-dir benchmarks/results --variants torch-dense torch-sebp torch-bound

Needs a GPU: without CUDA kernels to trace, the run stops saying so.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import pathlib
import time
from typing import Sequence

from benchmarks.profile_step import markdown_report, variant_entry
from benchmarks.workloads import (
  VARIANTS, Settings, Variant, library_versions, torch_backward, torch_dense_steps,
  torch_forward_context, torch_variant_model, workload_batches,
)

__all__ = ["profile_variant"]


def _kernel_times(events, calls: int) -> dict[str, tuple[float, float]]:
  """``kernel name -> (ms per call, launches per call)`` from the profiler's CUDA events."""
  import torch

  totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
  for event in events:
    if event.device_type != torch.autograd.DeviceType.CUDA:
      continue
    totals[event.name][0] += event.time_range.elapsed_us()  # a kernel event spans the kernel
    totals[event.name][1] += 1
  return {name: (us / 1e3 / calls, n / calls) for name, (us, n) in totals.items()}


def profile_variant(spec, variant: Variant, batches: Sequence[dict], dense_steps: Sequence[bool],
                    repeats: int = 3) -> dict:
  """Wall time and per-kernel GPU time of ``variant``'s forward and backward, per call.

  ``batches``: device batches; the first warms up (and compiles), the rest are timed ``repeats``
  times each and then traced once each. ``dense_steps``: per batch, the per-step crossover of
  :func:`sebp_torch_ref.dense_backward`. Returns the variant entry of
  :func:`benchmarks.profile_step.markdown_report`'s result.
  """
  import torch

  model = torch_variant_model(spec, variant, "cuda")

  def call(batch, dense):
    with torch_forward_context(variant, batch, dense):
      loss = model(**batch).loss
    torch_backward(variant, loss)
    for p in model.parameters():
      p.grad = None

  for _ in range(2):
    call(batches[0], dense_steps[0])
  torch.cuda.synchronize()
  timed = list(zip(batches[1:], dense_steps[1:]))
  walls = []
  for _ in range(repeats):
    for batch, dense in timed:
      start = time.perf_counter()
      call(batch, dense)
      torch.cuda.synchronize()
      walls.append((time.perf_counter() - start) * 1e3)
  activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
  with torch.profiler.profile(activities=activities) as prof:
    for batch, dense in timed:
      call(batch, dense)
    torch.cuda.synchronize()
  kernels = _kernel_times(prof.events(), len(timed))
  if not kernels:
    raise RuntimeError(f"{variant.name}: the profile has no CUDA kernel events")
  del model
  torch.cuda.empty_cache()
  return variant_entry(variant.name, walls, kernels)


def _main(argv: Sequence[str] | None = None) -> None:
  import torch

  # The profile traces eager steps: a graphed variant's replays would show no launches.
  by_name = {v.name: v for v in VARIANTS if v.framework == "torch" and not v.graphed}
  parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_torch")
  parser.add_argument("--model", required=True, choices=["bert", "llama"])
  parser.add_argument("--batch", type=int, required=True)
  parser.add_argument("--workload", required=True)
  parser.add_argument("--out-dir", type=pathlib.Path, required=True)
  parser.add_argument("--variants", nargs="+", choices=sorted(by_name),
                      default=["torch-dense", "torch-sebp", "torch-bound"])
  parser.add_argument("--steps", type=int, default=3, help="traced calls (distinct batches)")
  args = parser.parse_args(argv)
  if not torch.cuda.is_available():
    raise SystemExit("profile_torch needs a CUDA GPU.")
  spec = importlib.import_module(f"benchmarks.{args.model}").build(False)
  workloads = {w.name: w for w in spec.workloads}
  if args.workload not in workloads:
    parser.error(f"--workload: {args.workload!r} is not one of {sorted(workloads)}")
  host, active = workload_batches(spec, workloads[args.workload], args.batch,
                                  Settings(warmup=1, steps=args.steps), dynamic=False)
  batches = [{k: torch.from_numpy(v).long().cuda() for k, v in b.items()} for b in host]
  result = {"benchmark": spec.name, "gpu": torch.cuda.get_device_name(), "dtype": "bfloat16",
            "seq_len": spec.seq_len, "batch": args.batch, "workload": args.workload,
            "active_fraction": active, "versions": library_versions(),
            "traced_calls": args.steps, "variants": []}
  stem = f"profile_torch_{spec.name}_b{args.batch}_{args.workload}"
  args.out_dir.mkdir(parents=True, exist_ok=True)
  for name in args.variants:
    variant = by_name[name]
    result["variants"].append(profile_variant(spec, variant, batches, torch_dense_steps(variant, host)))
    # After every variant: a run cut short keeps what it profiled.
    (args.out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out_dir / f"{stem}.md").write_text(markdown_report(result))
    entry = result["variants"][-1]
    print(f"{name}: wall {entry['wall_ms']:.2f} ms, busy {entry['busy_ms']:.2f} ms, "
          f"{entry['launches']:.0f} launches", flush=True)


if __name__ == "__main__":
  _main()
