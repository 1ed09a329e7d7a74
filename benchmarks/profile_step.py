"""Where a model's backward time goes: GPU time per kernel of its loss-and-gradients program.

For one model benchmark (``bert``, ``llama``), one workload and batch size, and several JAX
variants (:data:`benchmarks.workloads.VARIANTS`), this traces ``--steps`` calls of the jitted
loss-and-gradients program with ``jax.profiler``, sums every GPU kernel's time per call, and groups
the kernels into families: the SEBP Pallas kernels, cuBLAS products, cuDNN attention, copies, and
XLA's own fusions. Beside ``jax-bound`` (every linear backward free), the families of an SEBP
variant say which kernels take the time that separates it from the bound; the difference between
``wall ms`` and ``busy ms`` is time the GPU idles (host round trips, launch gaps).

Each variant's GPU time is also split into the forward's kernels and the backward's
(:func:`benchmarks.device_trace.phase_times`: each traced call cut where its kernels turn from
the forward's model ops to autodiff's transpose), so that the backward is timed on
the device, inside the program that runs it, and ``GPU busy, backward`` of jax-dense over a
variant's is a backward speedup with no subtraction of programs timed apart.

Each of XLA's fusions in the kernel tables is named with the model op it came from (its
instruction's ``op_name`` in the optimized HLO, e.g. ``bwd LlamaForCausalLM/model/layers_*/
input_layernorm/mul``: XLA launches one kernel for identical fusions of every layer, so layer
numbers are starred).

Usage (writes ``profile_llama_b1_piqa.json`` and ``.md`` under ``--out-dir``; with ``--hlo``
also each variant's optimized HLO, ``hlo_llama_b1_piqa_<variant>.txt.gz``, where the fusions of
the kernel table are found by name)::

    python -m benchmarks.profile_step --model llama --batch 1 --workload piqa --out-dir $OUT \\
        --variants jax-dense jax-sebp-pallas jax-bound

Needs a GPU: a CPU trace has no kernel events, and the run stops saying so.
"""

from __future__ import annotations

import collections
import gzip
import json
import pathlib
import re
import statistics
from typing import Any, Callable, Iterable, Sequence

from benchmarks.collective_overlap import COLLECTIVE_NEEDLES
from benchmarks.device_trace import (
  PHASES, gpu_kernel_events, instruction_phases, is_backward, kernel_sides, phase_times,
  traced_events,
)
from benchmarks.workloads import (
  VARIANTS, ModelSpec, Settings, Variant, jax_loss_and_grad, prepared_workload,
  single_workload_parser, versions_text, xla_flags_text,
)

__all__ = ["family_times", "fusion_sources", "kernel_family", "kernel_times", "memset_neighbours",
           "per_kernel_times", "profile_variant", "traced_kernel_times", "variant_entry",
           "markdown_report"]

# (family, substrings of a kernel's name), first match wins. The Pallas kernels carry their
# `pallas_call` names (sebp_jax.backends.pallas), the torch reference's Triton kernels their
# function names (sebp_torch_ref.kernels); cuBLAS's Hopper kernels are "nvjet_*" or
# "sm90_xmma_*"; cuDNN's and torch's fused attention kernels name cudnn, flash or fmha.
_FAMILIES = (
  ("SEBP dX", ("sebp_dx",)),
  ("SEBP dW", ("sebp_dw", "_split_sum_kernel")),
  ("SEBP dX + dW (one launch)", ("sebp_grads", "_grads_kernel")),
  ("SEBP partition", ("sebp_partition", "_select_kernel", "_compact_kernel")),
  ("SEBP gather", ("sebp_gather", "_gather_kernel")),
  ("attention (cuDNN)", ("cudnn", "flash", "fmha", "attention")),
  ("collectives (NCCL)", COLLECTIVE_NEEDLES),
  ("GEMM (cuBLAS)", ("nvjet", "gemm", "cutlass", "xmma")),
  ("copies", ("memcpy", "memset")),
  # torch's own kernels (benchmarks.profile_torch); XLA's fusions never carry these names.
  ("torch elementwise, reductions", ("elementwise", "reduce_kernel", "at::native")),
)
OTHER = "XLA fusions, other"
_TOP = 15  # kernels listed by name per variant
# Memsets at least this long are listed with their neighbours: a memset of a few hundred bytes
# (cuBLAS's and cuDNN's own, ~1 µs) is launch cost; one that zeroes megabytes is work someone
# asked for (benchmarks/NOTES.md, "v9": 8-17 µs ones next to cuDNN attention inside a lax.cond).
_LARGE_MEMSET_US = 3.0


def kernel_family(name: str) -> str:
  """The family of a GPU kernel, from its name (see ``_FAMILIES``); :data:`OTHER` if none."""
  lowered = name.lower()
  for family, needles in _FAMILIES:
    if any(needle in lowered for needle in needles):
      return family
  return OTHER


def kernel_times(events: Iterable[dict], calls: int) -> dict[str, tuple[float, float]]:
  """``kernel name -> (ms per call, launches per call)`` from a Chrome/Perfetto trace's events.

  Kept: complete events (``"ph": "X"``) of processes whose name contains ``GPU`` (the device
  timeline), except on threads that annotate XLA modules or ops, which span the kernels they
  launch and would count them twice. ``calls``: how many program calls the trace holds.
  """
  return per_kernel_times(gpu_kernel_events(events), calls)


def per_kernel_times(kernel_events: Iterable[dict], calls: int) -> dict[str, tuple[float, float]]:
  """``kernel name -> (ms per call, launches per call)`` of kernel events already picked out of a
  trace (:func:`gpu_kernel_events`), ``calls`` program calls."""
  totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
  for e in kernel_events:
    totals[e["name"]][0] += e.get("dur", 0.0)
    totals[e["name"]][1] += 1
  return {name: (us / 1e3 / calls, n / calls) for name, (us, n) in totals.items()}


def memset_neighbours(kernel_events: Iterable[dict], calls: int, *,
                      min_us: float = _LARGE_MEMSET_US) -> list[list]:
  """Memsets of at least ``min_us`` each, by the kernels launched just before and after them on
  the same stream: ``[[previous, next, ms per call, memsets per call], ...]``, largest first.

  A memset names no buffer; its neighbours on the stream say which call asked for it. A
  neighbour is ``"-"`` at either end of a stream, and may itself be a memset (a run of them).
  """
  streams: dict[tuple, list[dict]] = collections.defaultdict(list)
  for e in kernel_events:
    streams[(e["pid"], e["tid"])].append(e)
  totals: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0])
  for stream in streams.values():
    stream.sort(key=lambda e: e["ts"])
    names = ["-", *(e["name"] for e in stream), "-"]
    for i, e in enumerate(stream):
      if "memset" in e["name"].lower() and e.get("dur", 0.0) >= min_us:
        total = totals[(names[i], names[i + 2])]
        total[0] += e["dur"]
        total[1] += 1
  ranked = sorted(totals.items(), key=lambda item: -item[1][0])
  return [[before, after, us / 1e3 / calls, n / calls] for (before, after), (us, n) in ranked]


# `%name = <shape> fusion(...), ..., metadata={op_name="..." ...}`: an instruction that XLA
# launches as a kernel named `name` with dots as underscores.
_FUSION = re.compile(
  r'^\s*(?:ROOT\s+)?%([\w.\-]+) = [^\n]*? fusion\([^\n]*?op_name="([^"]+)"', re.M)
_WRAPPERS = re.compile(r"^(?:\w+\()+")  # jit(, transpose(jvp(, ... around a path segment
_LAYER_INDEX = re.compile(r"\b(layers?)_\d+\b")


def _source(op_name: str) -> str:
  """``jit(f)/transpose(jvp(Model))/model/layers_3/mlp/mul`` →
  ``bwd Model/model/layers_*/mlp/mul``: the jitted function's name dropped, transforms
  unwrapped, ``bwd`` where the op is autodiff's transpose, layer numbers starred."""
  segments = op_name.split("/")[1:]
  path = "/".join(filter(None, (_WRAPPERS.sub("", segment).rstrip(")") for segment in segments)))
  return ("bwd " if is_backward(op_name) else "fwd ") + _LAYER_INDEX.sub(r"\1_*", path)


def fusion_sources(hlo: str) -> dict[str, str]:
  """Kernel name (as traces show it) → the model op each fusion of an optimized HLO module came
  from (:func:`_source` of its ``op_name``). Fusions without ``op_name`` are left out."""
  return {name.replace(".", "_"): _source(op_name) for name, op_name in _FUSION.findall(hlo)}


def family_times(kernels: dict[str, tuple[float, float]]) -> dict[str, float]:
  """``kernels`` (name -> (ms, launches)) summed per :func:`kernel_family`, largest first."""
  families: dict[str, float] = collections.defaultdict(float)
  for kernel, (ms, _) in kernels.items():
    families[kernel_family(kernel)] += ms
  return dict(sorted(families.items(), key=lambda item: -item[1]))


def traced_kernel_times(run: Callable[[], Any], calls: int) -> dict[str, tuple[float, float]]:
  """:func:`kernel_times` of what ``run()`` launches (``calls`` program calls), traced with
  ``jax.profiler``; ``run`` must block until its results are ready."""
  return kernel_times(traced_events(run), calls)


def profile_variant(spec: ModelSpec, variant: Variant, params: Any, module: Any,
                    batches: Sequence[dict], repeats: int = 3,
                    hlo_path: pathlib.Path | None = None) -> dict:
  """Wall time and per-kernel GPU time of ``variant``'s loss-and-gradients program.

  ``batches``: device batches; the first compiles and warms up, the rest are timed ``repeats``
  times each (wall clock, median) and then traced once each. Returns ``{"variant", "wall_ms", "busy_ms",
  "launches", "families": {family: ms}, "kernels": [[name, family, ms, launches], ...]}``, all per
  call. Raises ``RuntimeError`` if the trace holds no GPU kernel (no GPU, or a profiler without
  CUPTI). With ``hlo_path``, first writes the program's optimized HLO there, gzipped: the fusions
  the kernel table names (``input_add_reduce_fusion_14``) are its instructions (``%input_add_
  reduce_fusion.14``), with the ops they fuse and the model code each op came from.
  """
  import jax

  from benchmarks.timing import wall_ms

  _, value_and_grad = jax_loss_and_grad(spec, variant, module)
  warm, timed = batches[0], batches[1:]
  # The program timed and traced is the `Compiled` whose HLO is read here, so the trace's kernel
  # names are that HLO's fusions by construction (jit's own call would find this executable in
  # its cache too; an autotuning of another compile names its fusions differently).
  grad_fn = jax.jit(value_and_grad).lower(params, warm).compile()
  jax.block_until_ready(grad_fn(params, warm))
  hlo = grad_fn.as_text()
  if hlo_path is not None:
    hlo_path.write_bytes(gzip.compress(hlo.encode()))
  walls = [wall_ms(lambda: grad_fn(params, batch)) for _ in range(repeats) for batch in timed]
  events = gpu_kernel_events(traced_events(
    lambda: [jax.block_until_ready(grad_fn(params, batch)) for batch in timed]))
  if not events:
    raise RuntimeError(f"{variant.name}: the trace has no GPU kernel events; profile on a GPU "
                       f"(devices here: {jax.devices()})")
  sides = kernel_sides(events, instruction_phases(hlo), len(timed))
  backward = [e for e, side, _ in sides if side == "backward"]
  return variant_entry(variant.name, walls, per_kernel_times(events, len(timed)),
                       memset_neighbours(events, len(timed)), fusion_sources(hlo),
                       phase_times(sides, len(timed)), per_kernel_times(backward, len(timed)))


def variant_entry(name: str, walls: Sequence[float], kernels: dict[str, tuple[float, float]],
                  memsets: list[list] | None = None, sources: dict[str, str] | None = None,
                  phases: dict[str, float] | None = None,
                  backward_kernels: dict[str, tuple[float, float]] | None = None) -> dict:
  """One variant of :func:`markdown_report`'s result: the median of ``walls`` (ms per call),
  ``kernels`` (name -> (ms, launches) per call) summed per family, the top kernels (each with
  its model op from ``sources``, :func:`fusion_sources`, or ``""``), and ``memsets``
  (:func:`memset_neighbours`), ``phases`` (:func:`phase_times`) and the backward's kernels
  (``backward_kernels``, as ``kernels``; :func:`kernel_sides`) summed per family where given."""
  sources = sources or {}
  ranked = sorted(kernels.items(), key=lambda item: -item[1][0])
  return {
    "variant": name,
    "wall_ms": statistics.median(walls),
    "busy_ms": sum(ms for ms, _ in kernels.values()),
    "launches": sum(n for _, n in kernels.values()),
    "families": family_times(kernels),
    "kernels": [[kernel, kernel_family(kernel), ms, n, sources.get(kernel, "")]
                for kernel, (ms, n) in ranked[:_TOP]],
    **({} if memsets is None else {"memsets": memsets}),
    **({} if phases is None else {"phases": phases}),
    **({} if backward_kernels is None
       else {"backward_families": family_times(backward_kernels)}),
  }


def _family_rows(variants: Sequence[dict], key: str) -> list[str]:
  """One table row per kernel family found in any variant's ``key`` (``"families"`` or
  ``"backward_families"``), ms per variant: ``0.00`` where a variant lacks that family, ``–``
  where it lacks ``key`` (a result written before it)."""
  families = dict.fromkeys(f for v in variants for f in v.get(key, {}))
  return [f"| {family} | " + " | ".join(
            f"{v[key].get(family, 0.0):.2f}" if key in v else "–" for v in variants) + " |"
          for family in families]


def markdown_report(result: dict) -> str:
  """The families of every profiled variant side by side, then each variant's top kernels."""
  variants = result["variants"]
  lines = [
    f"# Profile of {result['benchmark']}'s loss-and-gradients program: {result['gpu']}, "
    f"{result['dtype']}, batch {result['batch']} × {result['seq_len']}, {result['workload']} "
    f"({100 * result['active_fraction']:.1f} % real tokens)",
    "",
    "GPU time per call in ms, summed over the kernels of each family, averaged over "
    f"{result['traced_calls']} traced calls; wall is the median of host-timed calls. Versions: "
    f"{versions_text(result['versions'])}.{xla_flags_text(result)}",
    "",
    "| | " + " | ".join(v["variant"] for v in variants) + " |",
    "|---|" + "---|" * len(variants),
  ]
  lines += _family_rows(variants, "families")
  for key, label, spec in (("busy_ms", "**GPU busy**", ".2f"), ("wall_ms", "**wall**", ".2f"),
                           ("launches", "kernel launches", ".0f")):
    lines.append(f"| {label} | " + " | ".join(format(v[key], spec) for v in variants) + " |")
  # Results written before phase_times have no phases; those of its first GPU run (2026-12-02,
  # results/v42_h200/call1, call5) have "unattributed" where the cut's have "misplaced".
  if any("phases" in v for v in variants):
    for phase, label in zip(PHASES, ("GPU busy, forward", "GPU busy, backward",
                                     "of which on the other side's instruction (misplaced)")):
      lines.append(f"| {label} | " + " | ".join(
        f"{v['phases'][phase]:.2f}" if phase in v.get("phases", {}) else "–"
        for v in variants) + " |")
    dense = next((v for v in variants if v["variant"] == "jax-dense" and "phases" in v), None)
    if dense is not None:
      lines.append("| GPU busy, backward: jax-dense's ÷ the variant's | " + " | ".join(
        f"{dense['phases']['backward'] / v['phases']['backward']:.2f}×"
        if v.get("phases", {}).get("backward") else "–" for v in variants) + " |")
  if any("backward_families" in v for v in variants):
    # The backward's share of each family: what separates a variant from the bound there.
    lines += ["", "The backward's GPU time per family (ms per call; the kernels on the backward's "
              "side of each call's cut):", "",
              "| backward | " + " | ".join(v["variant"] for v in variants) + " |",
              "|---|" + "---|" * len(variants), *_family_rows(variants, "backward_families")]
  for v in variants:
    # Five fields per kernel, the model op last ("" where none: cuBLAS, Pallas, torch's
    # kernels); results written before that field have four. No op at all: no column.
    kernels = [(*k, "")[:5] for k in v["kernels"]]
    ops = any(source for *_, source in kernels)
    lines += ["", f"## {v['variant']}: top {len(kernels)} kernels", "",
              "| kernel | family | ms | launches |" + (" model op |" if ops else ""),
              "|---|---|---|---|" + ("---|" if ops else "")]
    lines += [f"| `{name[:90]}` | {family} | {ms:.3f} | {n:.0f} |"
              + (f" {source[:100]} |" if ops else "") for name, family, ms, n, source in kernels]
    if v.get("memsets"):
      lines += ["", f"Memsets of at least {_LARGE_MEMSET_US:g} µs, by the kernels just before "
                "and after them on the stream:", "",
                "| before | after | ms | memsets per call |", "|---|---|---|---|"]
      lines += [f"| `{before[:60]}` | `{after[:60]}` | {ms:.3f} | {n:g} |"
                for before, after, ms, n in v["memsets"][:_TOP]]
  return "\n".join(lines) + "\n"


def _main(argv: Sequence[str] | None = None) -> None:
  by_name = {v.name: v for v in VARIANTS if v.framework == "jax" and v.impl != "dynamic"}
  parser = single_workload_parser("python -m benchmarks.profile_step")
  parser.add_argument("--variants", nargs="+", choices=sorted(by_name),
                      default=["jax-dense", "jax-sebp-pallas", "jax-bound"])
  parser.add_argument("--steps", type=int, default=3, help="traced calls (distinct batches)")
  parser.add_argument("--hlo", action="store_true",
                      help="also write each variant's optimized HLO, hlo_<stem>_<variant>.txt.gz")
  args = parser.parse_args(argv)
  if args.steps < 1:
    parser.error("--steps must be >= 1")
  spec, module, params, batches, header, stem = prepared_workload(
    parser, args, Settings(warmup=1, steps=args.steps))
  result = {**header, "traced_calls": args.steps, "variants": []}
  args.out_dir.mkdir(parents=True, exist_ok=True)
  for name in args.variants:
    hlo_path = args.out_dir / f"hlo_{stem}_{name}.txt.gz" if args.hlo else None
    result["variants"].append(profile_variant(spec, by_name[name], params, module, batches,
                                              hlo_path=hlo_path))
    # After every variant: a run cut short keeps what it profiled.
    (args.out_dir / f"profile_{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out_dir / f"profile_{stem}.md").write_text(markdown_report(result))
    print(f"{name}: wall {result['variants'][-1]['wall_ms']:.2f} ms, busy "
          f"{result['variants'][-1]['busy_ms']:.2f} ms", flush=True)


if __name__ == "__main__":
  _main()
