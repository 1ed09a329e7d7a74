"""The ranges the README quotes from a model benchmark's result file.

For every variant and batch size, over the workloads with padding (``active_fraction < 1``):
the backward, forward-and-backward (``grad``) and train-step speedups over ``jax-dense`` (and
the backward's GPU time inside the loss-and-gradients program over ``jax-dense``'s, where the
run measured it: ``gpu_bwd_ms``, with its way to ``jax-bound``), the
backward speedup over the variant's own framework's dense (``jax-dense`` or ``torch-dense``;
``torch-dense-caller-thread`` / ``torch-dense-graphed`` / ``torch-dense-compiled`` /
``torch-dense-compiled-graphed`` for the caller-thread / graphed / compiled / compiled and
graphed torch variants), the way to its own framework's bound ``(dense_bwd − variant_bwd) /
(dense_bwd − bound_bwd)`` (``jax-bound``, ``torch-bound`` or the torch bound of the same
suffix), and peak memory against its own dense; and, for the ``full_length`` workload, the step
time as a multiple of its own dense's. Computed from the JSON, so a re-measured file gives the
README's numbers without copying them by hand::

    python -m benchmarks.summary benchmarks/results/llama_b1.json benchmarks/results/llama_b4.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Sequence

from benchmarks.workloads import BASELINE, GRAD_KEYS, speedups, with_grad_ms

__all__ = ["BOUND", "REFERENCES", "way_to_bound", "variant_ranges", "markdown_summary"]

BOUND = "jax-bound"
# framework -> (its dense variant, its bound variant); an eager torch step whose backward runs on
# the calling thread is compared with dense and the bound run so; a CUDA-graphed torch step with
# the graphed dense and bound steps (the same host overhead: none), a compiled one with the
# compiled ones (the same fusions between the linear layers), a compiled and graphed one with the
# compiled and graphed ones (both).
# A JAX step under the command-buffer flags likewise with dense and the bound under them.
REFERENCES = {"jax": (BASELINE, BOUND), "torch": ("torch-dense", "torch-bound"),
              "torch-graphed": ("torch-dense-graphed", "torch-bound-graphed"),
              "torch-caller-thread": ("torch-dense-caller-thread", "torch-bound-caller-thread"),
              "torch-compiled": ("torch-dense-compiled", "torch-bound-compiled"),
              "torch-compiled-graphed": ("torch-dense-compiled-graphed",
                                         "torch-bound-compiled-graphed"),
              "jax-cmdbuf": ("jax-dense-cmdbuf", "jax-bound-cmdbuf")}
# The keys' suffixes after the framework, longest first: "-compiled-graphed" before "-graphed".
_SUFFIXES = sorted({key[key.find("-"):] for key in REFERENCES if "-" in key}, key=len, reverse=True)


def _references(row: dict) -> tuple[str, str]:
  suffix = next((s for s in _SUFFIXES if row["variant"].endswith(s)), "")
  return REFERENCES[row["framework"] + suffix]


def way_to_bound(dense_ms: float, variant_ms: float, bound_ms: float) -> float:
  """How much of the time the bound saves a variant saves: 0 at dense, 1 at the bound."""
  if dense_ms <= bound_ms:
    raise ValueError(f"the bound ({bound_ms} ms) must be faster than dense ({dense_ms} ms)")
  return (dense_ms - variant_ms) / (dense_ms - bound_ms)


def _span(values: list[float]) -> tuple[float, float] | None:
  return (min(values), max(values)) if values else None


def variant_ranges(result: dict) -> dict[tuple[int, str], dict[str, tuple[float, float] | None]]:
  """``(batch, variant) -> {"bwd_x", "grad_x", "step_x", "gpu_bwd_x", "own_bwd_x", "way",
  "gpu_way", "mem", "full_step"}``: each a ``(low, high)`` range (``None`` where nothing
  measured it). ``bwd_x``/``grad_x``/``step_x``/``gpu_bwd_x`` are over ``jax-dense``
  (``grad_x``: the forward and backward together, :func:`~benchmarks.workloads.with_grad_ms`;
  ``gpu_bwd_x`` and ``gpu_way``: of ``gpu_bwd_ms``); ``own_bwd_x``, ``way``, ``mem`` (+0.01
  = 1 % more) and ``full_step`` against the variant's own framework's dense and bound
  (:data:`REFERENCES`; graphed torch variants: the graphed ones)."""
  rows = [with_grad_ms(r) for r in result["rows"] if r["error"] is None]
  by_key = {(r["workload"], r["batch"], r["variant"]): r for r in rows}
  ratios = speedups(rows, (*GRAD_KEYS, "gpu_bwd_ms"))
  collected: dict[tuple[int, str], dict[str, list[float]]] = {}
  for r in rows:
    dense_name, bound_name = _references(r)
    dense = by_key.get((r["workload"], r["batch"], dense_name))
    if dense is None:
      continue
    into = collected.setdefault((r["batch"], r["variant"]), {
      "bwd_x": [], "grad_x": [], "step_x": [], "gpu_bwd_x": [], "own_bwd_x": [], "way": [],
      "gpu_way": [], "mem": [], "full_step": []})
    if r["active_fraction"] >= 1.0:
      into["full_step"].append(r["step_ms"] / dense["step_ms"])
      continue
    # `speedups` leaves a ratio out (None) where a time is not positive: a noisy difference.
    for name, ratio in zip(("bwd_x", "grad_x", "step_x", "gpu_bwd_x"),
                           ratios[(r["workload"], r["batch"], r["variant"])]):
      if ratio is not None:
        into[name].append(ratio)
    if r["bwd_ms"] > 0:
      into["own_bwd_x"].append(dense["bwd_ms"] / r["bwd_ms"])
    bound = by_key.get((r["workload"], r["batch"], bound_name))
    # Meaningful for the variants that run SEBP (or pad less), not for the references themselves,
    # and only where the bound is faster than dense: an eager torch step that waits on the host
    # can have a bound (a Python backward per layer too) slower than dense's GPU-bound one.
    for name, key in (("way", "bwd_ms"), ("gpu_way", "gpu_bwd_ms")):
      times = [None if row is None else row.get(key) for row in (dense, r, bound)]
      if (None not in times and r["variant"] not in (dense_name, bound_name)
          and times[2] < times[0]):
        into[name].append(way_to_bound(*times))
    if r["peak_mem_bytes"] and dense["peak_mem_bytes"]:
      into["mem"].append(r["peak_mem_bytes"] / dense["peak_mem_bytes"] - 1.0)
  return {key: {name: _span(values) for name, values in found.items()}
          for key, found in collected.items()}


def _fmt(span: tuple[float, float] | None, spec: str, suffix: str = "") -> str:
  if span is None:
    return "–"
  low, high = (format(v, spec) for v in span)
  return (low if low == high else f"{low}–{high}") + suffix


def markdown_summary(result: dict) -> str:
  """One row per (batch, variant): the ranges of :func:`variant_ranges` as the README writes
  them."""
  lines = [
    f"# {result['benchmark']}: {result['gpu']}, {result['dtype']}, context {result['seq_len']}",
    "",
    "Ranges over the padded workloads; × is over jax-dense, \"own\" over the variant's own "
    "framework's dense and bound; full length is the step time over its own dense's.",
    "",
    "| batch | variant | backward × | grad × | step × | backward GPU × | backward × own dense "
    "| way to own bound | way to bound, GPU | peak memory vs own dense "
    "| full-length step / own dense |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for (batch, variant), spans in variant_ranges(result).items():
    mem = None if spans["mem"] is None else tuple(100 * v for v in spans["mem"])
    way, gpu_way = (None if spans[k] is None else tuple(100 * v for v in spans[k])
                    for k in ("way", "gpu_way"))
    lines.append(
      f"| {batch} | {variant} | {_fmt(spans['bwd_x'], '.2f', '×')} "
      f"| {_fmt(spans['grad_x'], '.2f', '×')} | {_fmt(spans['step_x'], '.2f', '×')} "
      f"| {_fmt(spans['gpu_bwd_x'], '.2f', '×')} | {_fmt(spans['own_bwd_x'], '.2f', '×')} "
      f"| {_fmt(way, '.0f', ' %')} | {_fmt(gpu_way, '.0f', ' %')} "
      f"| {_fmt(mem, '+.2f', ' %')} | {_fmt(spans['full_step'], '.3f', '×')} |")
  return "\n".join(lines) + "\n"


def _main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.summary")
  parser.add_argument("results", type=pathlib.Path, nargs="+", help="result JSON files")
  for path in parser.parse_args(argv).results:
    print(markdown_summary(json.loads(path.read_text())))


if __name__ == "__main__":
  _main()
