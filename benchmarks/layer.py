"""Dense vs SEBP backward of one linear layer, over layer shapes and active-row fractions.

For each shape of :data:`benchmarks.layer_shapes.LAYER_SHAPES` and each fraction, the output
gradient is ``batch`` sequences whose first ``fraction`` of tokens are real (random normal rows)
and the rest padding (zero rows). Timed, each jitted on its own:

* every ``--impls`` backend: ``jax.vjp`` of ``sebp_matmul(x, kernel, impl=...)`` at ``dy``
  (``dense`` is the plain backward);
* ``ideal``: the two dense matmuls on rows compacted beforehand, the floor SEBP aims at.

Prints a markdown table and writes JSON (``--out``) with a markdown copy beside it::

    python -m benchmarks.layer --shapes bert_up bert_down --dtype float32 --reps 5 \\
        --out benchmarks/results/layer_cpu_float32.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.layer_shapes import LAYER_SHAPES, padded_gradient
from benchmarks.timing import device_time_ms, environment
from sebp_jax import sebp_matmul

FRACTIONS = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
IDEAL = "ideal"


def wall_time_ms(fn: Callable[..., Any], input_sets: Sequence[tuple], *, trials: int) -> float:
  """Median wall time of one jitted ``fn(*inputs)`` call in milliseconds, cycling input sets.

  Fine where a call is long against its ~0.1 ms dispatch (the CPU); on a GPU use
  :func:`benchmarks.timing.device_time_ms`.
  """
  jitted = jax.jit(fn)
  for inputs in input_sets[:2]:  # compile, then warm up
    jax.block_until_ready(jitted(*inputs))
  samples = []
  for i in range(trials):
    inputs = input_sets[i % len(input_sets)]
    start = time.perf_counter()
    jax.block_until_ready(jitted(*inputs))
    samples.append((time.perf_counter() - start) * 1e3)
  return statistics.median(samples)


def device_timer(fn: Callable[..., Any], input_sets: Sequence[tuple], *, trials: int) -> float:
  return device_time_ms(fn, input_sets, trials=trials)


# How one backward is timed: `(fn, input_sets, trials=) -> ms`.
TIMERS = {"wall": wall_time_ms, "device": device_timer}


def sebp_backward(impl: str) -> Callable[..., tuple[jax.Array, jax.Array]]:
  """``(x, kernel, dy) -> (dx, dkernel)`` of ``sebp_matmul`` with ``impl``, exact policy."""
  def backward(x, kernel, dy):
    _, vjp = jax.vjp(lambda x, k: sebp_matmul(x, k, impl=impl), x, kernel)
    return vjp(dy)
  return backward


def ideal_backward(x_rows, kernel, dy_rows):
  """The dense backward on the kept rows only, compacted before the timer starts."""
  return dy_rows @ kernel.T, x_rows.T @ dy_rows


def _relative_error(got, want) -> float:
  got = jnp.concatenate([g.astype(jnp.float32).ravel() for g in got])
  want = jnp.concatenate([w.astype(jnp.float32).ravel() for w in want])
  return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


def run(shape_names: Sequence[str], fractions: Sequence[float], impls: Sequence[str], dtype: Any,
        reps: int, timer: Callable[..., float], input_sets: int = 1) -> list[dict]:
  """Time every impl (and the ideal) at every shape and fraction; one result row each."""
  rows = []
  for shape_name in shape_names:
    shape = LAYER_SHAPES[shape_name]
    for fraction in fractions:
      sets = [padded_gradient(shape, fraction, dtype, seed) for seed in range(input_sets)]
      count = sets[0][3]
      sets = [s[:3] for s in sets]
      keep = np.asarray(jnp.any(sets[0][2] != 0, axis=1))
      ideal_sets = [(x[keep], kernel, dy[keep]) for x, kernel, dy in sets]
      base = dict(shape=shape_name, M=shape.rows, K=shape.in_features, N=shape.out_features,
                  active_rows=count, active_fraction=count / shape.rows)
      reference = jax.jit(sebp_backward("dense"))(*sets[0])
      times = {}
      for impl in impls:
        got = jax.jit(sebp_backward(impl))(*sets[0])
        times[impl] = (timer(sebp_backward(impl), sets, trials=reps), _relative_error(got, reference))
      times[IDEAL] = (timer(ideal_backward, ideal_sets, trials=reps), None)
      dense_ms = times["dense"][0] if "dense" in times else None
      for impl, (ms, error) in times.items():
        rows.append({**base, "impl": impl, "bwd_ms": ms,
                     "speedup_vs_dense": dense_ms / ms if dense_ms else None,
                     "rel_err_vs_dense": error})
      print(f"{shape_name:>14} {count / shape.rows:6.1%}  " + "  ".join(
        f"{impl}={ms:.2f}ms" for impl, (ms, _) in times.items()), flush=True)
  return rows


def markdown_table(rows: Sequence[dict]) -> str:
  """One line per (shape, fraction): each impl's backward time, and its speedup over dense."""
  impls = list(dict.fromkeys(r["impl"] for r in rows))
  header = ["shape", "M", "K→N", "active"] + [f"{i} ms" for i in impls] + [
    f"{i} speedup" for i in impls if i != "dense"]
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  groups = dict.fromkeys((r["shape"], r["active_fraction"]) for r in rows)
  for shape, fraction in groups:
    by_impl = {r["impl"]: r for r in rows if (r["shape"], r["active_fraction"]) == (shape, fraction)}
    first = next(iter(by_impl.values()))
    cells = [shape, str(first["M"]), f"{first['K']}→{first['N']}", f"{fraction:.1%}"]
    cells += [f"{by_impl[i]['bwd_ms']:.2f}" for i in impls]
    cells += [f"{by_impl[i]['speedup_vs_dense']:.2f}×" if by_impl[i]["speedup_vs_dense"] else "–"
              for i in impls if i != "dense"]
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

  rows = run(args.shapes, args.fractions, args.impls, jnp.dtype(args.dtype), args.reps,
             TIMERS[args.timer], args.input_sets)
  table = markdown_table(rows)
  print(table)
  if args.out:
    env = environment()
    result = {"gpu": env["device"] if env["platform"] == "gpu" else None, **env,
              "dtype": args.dtype, "timer": args.timer, "reps": args.reps, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(
      f"Backward of one linear layer, {args.dtype}, on {env['device']} ({args.timer} timer, "
      f"median of {args.reps}); jax {env['versions']['jax']}.\n\n{table}\n")


if __name__ == "__main__":
  main()
