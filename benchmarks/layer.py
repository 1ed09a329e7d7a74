"""Dense vs SEBP backward of one linear layer, over layer shapes and active-row fractions.

For each shape of :data:`benchmarks.layer_shapes.LAYER_SHAPES` and each fraction, the output
gradient is ``batch`` sequences whose first ``fraction`` of tokens are real (random normal rows)
and the rest padding (zero rows). Timed, each jitted on its own:

* every ``--impls`` backend: ``jax.vjp`` of ``sebp_matmul(x, kernel, impl=...)`` at ``dy``
  (``dense`` is the plain backward). A suffix picks a variant: ``-nocond`` (``crossover=1.0``:
  the sparse path at every fraction, no conditional), ``-plan`` (besides, the kept rows handed in
  as a row plan made beforehand, as a model step makes it once for all its layers);
* ``ideal``: the two dense matmuls on rows compacted beforehand, the floor SEBP aims at.

On a GPU the default timer is ``device`` (:func:`benchmarks.timing.device_time_ms`: distinct
input sets, the slope between programs of R and R/2 calls); ``loop`` (a chained ``fori_loop``) has
the traps its docstring names.

Prints a markdown table and writes JSON (``--out``) with a markdown copy beside it::

    python -m benchmarks.layer --shapes bert_up bert_down --dtype float32 --reps 5 \\
        --out benchmarks/results/layer_cpu_float32.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.layer_shapes import LAYER_SHAPES, padded_gradient
from benchmarks.timing import device_time_ms, environment, loop_time_ms
from sebp_jax import row_plan, sebp_matmul

FRACTIONS = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
IDEAL = "ideal"


Cases = dict[str, tuple[Callable[..., Any], Sequence[tuple]]]


def wall_time_ms(cases: Cases, *, trials: int) -> dict[str, list[float]]:
  """Wall time of one jitted call of each case's ``fn(*inputs)`` in each of ``trials`` rounds, ms.

  The cases take turns, one call each per round, so a drift of the machine's speed (a shared
  CPU) hits a round's cases alike. Fine where a call is long against its ~0.1 ms dispatch (the
  CPU); on a GPU use :func:`device_timer`.
  """
  jitted = {name: jax.jit(fn) for name, (fn, _) in cases.items()}
  for name, (_, input_sets) in cases.items():  # compile, then warm up
    for inputs in input_sets[:2]:
      jax.block_until_ready(jitted[name](*inputs))
  samples = {name: [] for name in cases}
  for i in range(trials):
    for name, (_, input_sets) in cases.items():
      inputs = input_sets[i % len(input_sets)]
      start = time.perf_counter()
      jax.block_until_ready(jitted[name](*inputs))
      samples[name].append((time.perf_counter() - start) * 1e3)
  return samples


def device_timer(cases: Cases, *, trials: int) -> dict[str, list[float]]:
  """Device time of each case (:func:`benchmarks.timing.device_time_ms`), one sample each."""
  return {name: [device_time_ms(fn, input_sets, trials=trials)]
          for name, (fn, input_sets) in cases.items()}


def loop_timer(cases: Cases, *, trials: int) -> dict[str, list[float]]:
  """Device time of each case (:func:`benchmarks.timing.loop_time_ms`) on its first input set."""
  return {name: [loop_time_ms(fn, input_sets[0], trials=trials)]
          for name, (fn, input_sets) in cases.items()}


# How the backwards are timed: `(cases, trials=) -> {name: [ms per round]}`.
TIMERS = {"wall": wall_time_ms, "device": device_timer, "loop": loop_timer}
# Variants of an impl, by suffix: sebp_matmul's keyword arguments.
_SUFFIXES = {"-nocond": dict(crossover=1.0), "-plan": dict(crossover=1.0)}


def sebp_backward(impl: str) -> Callable[..., tuple[jax.Array, jax.Array]]:
  """``(x, kernel, dy[, plan]) -> (dx, dkernel)`` of ``sebp_matmul``, exact policy; ``impl`` may
  carry a suffix of :data:`_SUFFIXES` (``-plan``: the row plan is the fourth argument)."""
  base, options = impl, {}
  for suffix, extra in _SUFFIXES.items():
    if impl.endswith(suffix):
      base, options = impl[:-len(suffix)], extra

  def backward(x, kernel, dy, plan=None):
    _, vjp = jax.vjp(lambda x, k: sebp_matmul(x, k, impl=base, rows=plan, **options), x, kernel)
    return vjp(dy)
  return backward


def with_row_plans(input_sets: Sequence[tuple]) -> list[tuple]:
  """``(x, kernel, dy)`` input sets, each with its row plan: the non-zero rows of its ``dy``."""
  return [(x, kernel, dy, row_plan(jnp.any(dy != 0, axis=1))) for x, kernel, dy in input_sets]


def _with_plan(impl: str, input_sets: Sequence[tuple]) -> Sequence[tuple]:
  """``input_sets``, each with its row plan for a ``-plan`` impl."""
  return with_row_plans(input_sets) if impl.endswith("-plan") else input_sets


def ideal_backward(x_rows, kernel, dy_rows):
  """The dense backward on the kept rows only, compacted before the timer starts."""
  return dy_rows @ kernel.T, x_rows.T @ dy_rows


def _relative_error(got, want) -> float:
  got = jnp.concatenate([g.astype(jnp.float32).ravel() for g in got])
  want = jnp.concatenate([w.astype(jnp.float32).ravel() for w in want])
  return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


def run(shape_names: Sequence[str], fractions: Sequence[float], impls: Sequence[str], dtype: Any,
        reps: int, timer: Callable[..., dict[str, list[float]]], input_sets: int = 1,
        on_point: Callable[[list[dict]], None] | None = None) -> list[dict]:
  """Time every impl (and the ideal) at every shape and fraction; one result row each.
  ``on_point(rows)`` is called with the rows so far after each (shape, fraction)."""
  rows = []
  for shape_name in shape_names:
    shape = LAYER_SHAPES[shape_name]
    for fraction in fractions:
      sets = [padded_gradient(shape, fraction, dtype, seed) for seed in range(input_sets)]
      counts = [s[3] for s in sets]
      sets = [s[:3] for s in sets]
      # Each set's ideal keeps that set's own rows: at batch 1 the sets' counts differ by several
      # times (one sequence's length each), and the timers average over the sets.
      ideal_sets = []
      for x, kernel, dy in sets:
        keep = np.asarray(jnp.any(dy != 0, axis=1))
        ideal_sets.append((x[keep], kernel, dy[keep]))
      count = statistics.mean(counts)
      base = dict(shape=shape_name, M=shape.rows, K=shape.in_features, N=shape.out_features,
                  active_rows=count, active_fraction=count / shape.rows,
                  active_rows_per_set=counts)
      reference = jax.jit(sebp_backward("dense"))(*sets[0])
      cases = {impl: (sebp_backward(impl), _with_plan(impl, sets)) for impl in impls}
      errors = {impl: _relative_error(jax.jit(fn)(*inputs[0]), reference)
                for impl, (fn, inputs) in cases.items()}
      samples = timer({**cases, IDEAL: (ideal_backward, ideal_sets)}, trials=reps)
      times = {impl: statistics.median(ms) for impl, ms in samples.items()}
      for impl, ms in samples.items():
        # The median of per-round ratios: robust to the machine's speed drifting between rounds.
        speedup = (statistics.median(d / t for d, t in zip(samples["dense"], ms))
                   if "dense" in samples else None)
        rows.append({**base, "impl": impl, "bwd_ms": times[impl], "speedup_vs_dense": speedup,
                     "over_ideal": times[impl] / times[IDEAL] if times[IDEAL] > 0 else None,
                     "rel_err_vs_dense": errors.get(impl)})
      print(f"{shape_name:>14} {count / shape.rows:6.1%}  " + "  ".join(
        f"{impl}={ms:.3f}ms" for impl, ms in times.items()), flush=True)
      if on_point is not None:
        on_point(rows)
  return rows


def markdown_table(rows: Sequence[dict]) -> str:
  """One line per (shape, fraction): each impl's backward time, and its speedup over dense."""
  impls = list(dict.fromkeys(r["impl"] for r in rows))
  sparse = [i for i in impls if i not in ("dense", IDEAL)]
  header = ["shape", "M", "K→N", "active (mean of sets)"] + [f"{i} ms" for i in impls] + [
    f"{i} speedup" for i in impls if i != "dense"] + [f"{i} ÷ ideal" for i in sparse]
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  groups = dict.fromkeys((r["shape"], r["active_fraction"]) for r in rows)
  for shape, fraction in groups:
    by_impl = {r["impl"]: r for r in rows if (r["shape"], r["active_fraction"]) == (shape, fraction)}
    first = next(iter(by_impl.values()))
    cells = [shape, str(first["M"]), f"{first['K']}→{first['N']}", f"{fraction:.1%}"]
    cells += [f"{by_impl[i]['bwd_ms']:.3f}" for i in impls]
    cells += [f"{by_impl[i]['speedup_vs_dense']:.2f}×" if by_impl[i]["speedup_vs_dense"] else "–"
              for i in impls if i != "dense"]
    cells += [f"{by_impl[i]['over_ideal']:.2f}" if by_impl[i]["over_ideal"] else "–"
              for i in sparse]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
  on_gpu = jax.default_backend() == "gpu"
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", nargs="+", choices=sorted(LAYER_SHAPES),
                      default=["bert_up", "bert_down"])
  parser.add_argument("--fractions", nargs="+", type=float, default=list(FRACTIONS),
                      help="fractions of real tokens per sequence, in (0, 1]")
  parser.add_argument("--impls", nargs="+", default=["xla", "dense"],
                      help="sebp_matmul backends to time; 'dense' is the baseline")
  parser.add_argument("--dtype", default="bfloat16" if on_gpu else "float32")
  parser.add_argument("--reps", type=int, default=10, help="timed calls (or trials) per point")
  parser.add_argument("--timer", choices=sorted(TIMERS), default="device" if on_gpu else "wall")
  parser.add_argument("--input-sets", type=int, default=8 if on_gpu else 1,
                      help="distinct input sets per point (the device timer needs >= 2)")
  parser.add_argument("--out", type=pathlib.Path, default=None,
                      help="JSON file to write; a .md table is written beside it")
  args = parser.parse_args(argv)
  if any(not 0 < f <= 1 for f in args.fractions):
    parser.error("--fractions must lie in (0, 1]")

  # Wall times on a shared host scale with its load: record it beside the numbers.
  load = {"start": os.getloadavg()[0]}
  env = environment()

  def write(rows: list[dict]) -> str:
    load["end"] = os.getloadavg()[0]
    table = markdown_table(rows)
    if args.out:  # after every point: a run cut off by a time limit keeps what it measured
      result = {"gpu": env["device"] if env["platform"] == "gpu" else None, **env,
                "cpu_count": os.cpu_count(), "load_average_1min": load, "dtype": args.dtype,
                "timer": args.timer, "reps": args.reps, "input_sets": args.input_sets,
                "rows": rows}
      args.out.parent.mkdir(parents=True, exist_ok=True)
      args.out.write_text(json.dumps(result, indent=1) + "\n")
      args.out.with_suffix(".md").write_text(
        f"Backward of one linear layer, {args.dtype}, on {env['device']} ({os.cpu_count()} "
        f"cores, 1-min load {load['start']:.1f} at start, {load['end']:.1f} at end; "
        f"{args.timer} timer, median of {args.reps}, {args.input_sets} input sets; speedups are "
        f"medians of per-round ratios); jax {env['versions']['jax']}.\n\n{table}\n")
    return table

  rows = run(args.shapes, args.fractions, args.impls, jnp.dtype(args.dtype), args.reps,
             TIMERS[args.timer], args.input_sets, on_point=write)
  print(write(rows))


if __name__ == "__main__":
  main()
