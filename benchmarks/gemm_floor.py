"""The Pallas dX and dW GEMMs alone, against cuBLAS on the same rows.

Both measurements run on compacted inputs (the kept rows first, the identity permutation), so
the two GEMM kernels run without the selection and the gather (benchmarks/NOTES.md, "v9"):

* ``floor``: every row kept. :func:`~sebp_jax.backends.pallas.dx_pallas` and
  :func:`~sebp_jax.backends.pallas.dw_pallas` per tile configuration of
  :data:`benchmarks.tune_blocks.CANDIDATES` (a configuration runs the GEMM whose tiles it changes;
  one that changes both, ``default`` among them, runs both), beside ``lax.dot_general`` with the
  XLA backend's ``DX_DIMS`` / ``DW_DIMS`` (cuBLAS on a GPU). v9 found the default 64 x 128 dX
  tile at half of cuBLAS and 128 x 256 tiles at 0.89-0.96x of it, and dW on BERT's shapes held
  back by wave quantization (72 programs on 132 SMs), not by a slow GEMM.
* ``dw_split``: ``dw_pallas`` alone (the fix-up of its float32 partial tiles included) with
  every tile split ``dw_split`` ways (fewer only where fewer row blocks are kept: v9's split,
  which XLA summed then; the table's own split is its last wave's, sized from ``count``), on the
  table's tiles (:func:`~sebp_jax.backends.pallas.block_config`) and on each
  of ``--dw-tiles``, at each kept fraction, the rows past ``count`` zero; beside cuBLAS on the kept
  rows only. v9: at the fractions the models run (<= 20 %) split 1 is at or below cuBLAS and
  every split only costs; a split pays only above the crossover.
* ``kept``: both GEMMs on the table's tiles (:func:`~sebp_jax.backends.pallas.block_config`) at
  each kept fraction, ``0`` included (no kept row: dX only stores the zeros of the dropped rows,
  dW only zero tiles), beside cuBLAS on the kept rows (none at ``0``) and, at ``0``, XLA writing
  zeros of dX's shape. v13 found both GEMMs of LLaMA-3B's MLP up at batch 1 as slow at 0 kept
  rows as at 81 (dX 45 against 42 us, dW 36 against 35 on an H200): fixed costs per program,
  not the products, set their time.

Each result row carries the relative error of its product against cuBLAS's on the first input
set. Off GPU the kernels run in the Pallas interpreter (the times then measure the interpreter).
Writes ``gemm_floor[_TAG].json`` and a markdown copy beside it into ``--out-dir``, rewritten after
every shape (``dw_split``: every shape and fraction), so a run cut short keeps what it measured;
``--time-budget`` starts no shape (fraction) once its seconds are spent and lists the rest as not
run. v9's two tables (the time budget keeps it under 9 minutes on one H100)::

    python -m benchmarks.gemm_floor --shapes bert_up bert_attn llama_up_b1 llama_up_b8 bert_down \
        --time-budget 480 --out-dir $OUT
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from benchmarks.layer_shapes import LAYER_SHAPES, LayerShape, padded_gradient
from benchmarks.timing import device_time_ms, environment
from benchmarks.tune_blocks import CANDIDATES
from benchmarks.workloads import library_versions, versions_text
from sebp_jax.backends import pallas as pallas_backend
from sebp_jax.backends.xla import DW_DIMS, DX_DIMS

__all__ = ["PARTS", "FLOOR_CONFIGS", "TINY_SHAPE", "gemms_of", "gemm_inputs", "pallas_gemm",
           "cublas_gemm", "floor_rows", "dw_split_rows", "kept_rows", "markdown", "main"]

PARTS = ("floor", "dw_split", "kept")
# The configurations of v9's full-density table: the default, then dX's and dW's wider tiles.
FLOOR_CONFIGS = ("default", "dx128", "dx128x256", "dx128_s4", "dx128x256_n32_s4", "dw128x256",
                 "dw_w4", "dw128x256_m32_s4", "dw256x128")
# Small enough for the Pallas interpreter on a CPU, large enough for every tile of FLOOR_CONFIGS.
TINY_SHAPE = LayerShape(batch=2, seq_len=128, in_features=256, out_features=256)
_CUBLAS = "cublas"
_MISMATCH = 2e-2  # relative error past which a row is reported: bf16 rounding is ~4e-3
_GEMMS = ("dx", "dw")
_TABLE = "table"
_ZEROS = "xla_zeros"
_LABELS = {"dx": "dX", "dw": "dW", _CUBLAS: "cuBLAS", _TABLE: "Pallas", _ZEROS: "XLA zeros"}
_Config = pallas_backend.BlockConfig
Gemm = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def gemms_of(config: _Config) -> tuple[str, ...]:
  """The GEMMs (``"dx"``, ``"dw"``) whose fields ``config`` changes from the default's; both
  where it changes both or neither."""
  default = _Config()
  changed = {field.name.split("_")[0] for field in dataclasses.fields(config)
             if getattr(config, field.name) != getattr(default, field.name)}
  return tuple(g for g in _GEMMS if g in changed) or _GEMMS


def _check_fits(gemm: str, config: _Config, name: str, shape: LayerShape) -> None:
  """The kernels take whole tiles only: a ``ValueError`` naming ``name`` where ``shape`` is not."""
  tiles = ((config.dx_m, config.dx_k, config.dx_n) if gemm == "dx"
           else (config.dw_m, config.dw_k, config.dw_n))
  dims = (shape.rows, shape.in_features, shape.out_features)
  if any(dim % tile for dim, tile in zip(dims, tiles)):
    raise ValueError(f"{name}: {gemm} tiles (M, K, N) = {tiles} do not divide the "
                     f"shape {dims}")


def gemm_inputs(shape: LayerShape, count: int, dtype, seed: int):
  """``(x, kernel, dy)`` of ``shape``, the kept rows first: rows from ``count`` on are zero in
  ``x`` and ``dy`` (random normal rows, :func:`benchmarks.layer_shapes.padded_gradient`'s)."""
  x, kernel, dy, _ = padded_gradient(shape, 1.0, dtype, seed)
  live = (jnp.arange(shape.rows) < count)[:, None]
  return jnp.where(live, x, 0), kernel, jnp.where(live, dy, 0)


def pallas_gemm(gemm: str, config: _Config, rows: int, count: int, *, interpret: bool) -> Gemm:
  """``(x, kernel, dy) -> dX (rows, K) or dW (K, N)`` through the Pallas kernel, on the first
  ``count`` of ``rows`` compacted rows (identity permutation)."""
  perm = jnp.arange(rows, dtype=jnp.int32)  # built once: no iota kernel in the timed program
  kept = jnp.full((1,), count, jnp.int32)

  def product(x, kernel, dy):
    if gemm == "dx":
      return pallas_backend.dx_pallas(dy, kernel, perm, kept, config=config, interpret=interpret)
    return pallas_backend.dw_pallas(x, dy, perm, kept, config=config, interpret=interpret)
  return product


def cublas_gemm(gemm: str, count: int) -> Gemm:
  """The same product by ``lax.dot_general`` on the first ``count`` rows only (cuBLAS on a
  GPU): dX ``(count, K)``, dW ``(K, N)``."""
  def product(x, kernel, dy):
    if gemm == "dx":
      return lax.dot_general(dy[:count], kernel, DX_DIMS)
    return lax.dot_general(x[:count], dy[:count], DW_DIMS)
  return product


def _relative_error(got: jax.Array, want: jax.Array) -> float:
  got, want = got.astype(jnp.float32), want.astype(jnp.float32)
  return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


def _measure(base: dict, gemm: str, cases: dict[str, tuple[Gemm, _Config | None]],
             input_sets: Sequence[tuple], *, trials: int) -> list[dict]:
  """One row per case: its device time, its speed against the first case's (cuBLAS's) and its
  relative error against the first case's product on the first input set."""
  rows, reference, cublas_ms = [], None, None
  for name, (fn, config) in cases.items():
    out = jax.jit(fn)(*input_sets[0])
    reference = out if reference is None else reference
    error = _relative_error(out, reference)
    if error > _MISMATCH:
      print(f"  MISMATCH {base['shape']} {gemm} {name}: relative error {error:.3g}", flush=True)
    ms = device_time_ms(fn, input_sets, trials=trials)
    cublas_ms = ms if cublas_ms is None else cublas_ms
    flops = 2 * base["count"] * base["K"] * base["N"]
    rows.append({**base, "gemm": gemm, "config": name, "ms": ms,
                 "tflops": flops / ms / 1e9 if ms > 0 else None,
                 "vs_cublas": cublas_ms / ms if ms > 0 else None, "rel_err": error,
                 "block_config": dataclasses.asdict(config) if config is not None else None})
  return rows


def _base(part: str, name: str, shape: LayerShape, count: int) -> dict:
  return {"part": part, "shape": name, "M": shape.rows, "K": shape.in_features,
          "N": shape.out_features, "count": count, "kept_fraction": count / shape.rows}


def floor_rows(name: str, shape: LayerShape, configs: Sequence[str], dtype, *, reps: int,
               trials: int, interpret: bool) -> list[dict]:
  """Every row kept: cuBLAS, then each configuration's Pallas dX and/or dW (:func:`gemms_of`),
  its ``dw_split`` filling this GPU's SMs as a model's would (a ``dx_split`` sized likewise)."""
  m, k, n = shape.rows, shape.in_features, shape.out_features
  sets = [gemm_inputs(shape, m, dtype, seed) for seed in range(reps)]
  rows = []
  for gemm in _GEMMS:
    cases = {_CUBLAS: (cublas_gemm(gemm, m), None)}
    for config_name in configs:
      if gemm in gemms_of(CANDIDATES[config_name]):
        # Split as tune_blocks splits them, for this GPU (off a GPU both splits stay off).
        config = pallas_backend.sized_for_gpu(CANDIDATES[config_name], k, n, dtype)
        _check_fits(gemm, config, config_name, shape)
        cases[config_name] = (pallas_gemm(gemm, config, m, m, interpret=interpret), config)
    if len(cases) > 1:  # no configuration of this GEMM: no cuBLAS time either
      rows += _measure(_base("floor", name, shape, m), gemm, cases, sets, trials=trials)
  return rows


def _tile(text: str) -> tuple[int, int]:
  """``"128x256"`` -> ``(dw_k, dw_n) = (128, 256)``."""
  try:
    dw_k, dw_n = (int(v) for v in text.split("x"))
  except ValueError:
    raise argparse.ArgumentTypeError(f"a dW tile is KxN, e.g. 128x256; got {text!r}") from None
  return dw_k, dw_n


def dw_split_rows(name: str, shape: LayerShape, fraction: float, splits: Sequence[int],
                  tiles: Sequence[tuple[int, int]], tile_splits: Sequence[int], dtype, *,
                  reps: int, trials: int, interpret: bool) -> list[dict]:
  """dW at ``fraction`` kept rows: cuBLAS on them, then ``split{s}`` (the table's tiles, every
  one split ``s`` ways, as far as the kept row blocks go) for each of ``splits`` and
  ``t{K}x{N}_s{s}`` (8 warps) for each tile and each of ``tile_splits``."""
  m, k, n = shape.rows, shape.in_features, shape.out_features
  count = max(1, int(fraction * m))
  table = pallas_backend.block_config(m, k, n, dtype)
  # Every tile (no whole waves: dw_slots=0) in s parts from one row block each.
  uniform = dict(dw_slots=0, dw_min_part=1)
  configs = {f"split{s}": dataclasses.replace(table, dw_split=s, **uniform) for s in splits}
  configs.update({f"t{dw_k}x{dw_n}_s{s}": dataclasses.replace(
    table, dw_k=dw_k, dw_n=dw_n, dw_split=s, dw_warps=8, **uniform) for dw_k, dw_n in tiles
    for s in tile_splits})
  cases = {_CUBLAS: (cublas_gemm("dw", count), None)}
  for config_name, config in configs.items():
    _check_fits("dw", config, config_name, shape)
    cases[config_name] = (pallas_gemm("dw", config, m, count, interpret=interpret), config)
  sets = [gemm_inputs(shape, count, dtype, seed) for seed in range(reps)]
  base = {**_base("dw_split", name, shape, count), "table_split": table.dw_split}
  rows = _measure(base, "dw", cases, sets, trials=trials)
  for row in rows:
    config = row["block_config"]
    row["tiles"] = config and (k // config["dw_k"]) * (n // config["dw_n"])
  return rows


def kept_rows(name: str, shape: LayerShape, fraction: float, dtype, *, reps: int, trials: int,
              interpret: bool) -> list[dict]:
  """dX and dW on the table's tiles at ``fraction`` kept rows (``0``: none), each beside cuBLAS
  on the kept rows (none at ``0``; XLA's zeros of dX's shape instead). Each Pallas row's error is
  against cuBLAS's product with the dropped rows' zeros (at ``0``: the largest magnitude, which
  must be 0)."""
  m, k, n = shape.rows, shape.in_features, shape.out_features
  count = int(fraction * m)
  config = pallas_backend.block_config(m, k, n, dtype)
  sets = [gemm_inputs(shape, count, dtype, seed) for seed in range(reps)]
  base = _base("kept", name, shape, count)
  rows = []
  for gemm in _GEMMS:
    cases = {_CUBLAS: cublas_gemm(gemm, count)} if count else {}
    if gemm == "dx" and not count:
      # Tied to an input, or XLA would make the zeros a constant outside the timed program.
      cases[_ZEROS] = lambda x, kernel, dy: jnp.zeros((m, k), dy.dtype) + dy[0, 0] * 0
    cases[_TABLE] = pallas_gemm(gemm, config, m, count, interpret=interpret)
    times = {case: device_time_ms(fn, sets, trials=trials) for case, fn in cases.items()}
    got = jax.jit(cases[_TABLE])(*sets[0])
    if count:
      want = jax.jit(cases[_CUBLAS])(*sets[0])
      error = _relative_error(got, jnp.pad(want, ((0, got.shape[0] - want.shape[0]), (0, 0))))
    else:
      error = float(jnp.max(jnp.abs(got.astype(jnp.float32))))
    if error > _MISMATCH:
      print(f"  MISMATCH {name} {gemm} kept {count}: error {error:.3g}", flush=True)
    for case, ms in times.items():
      reference = times.get(_CUBLAS) if case == _TABLE else None
      rows.append({**base, "gemm": gemm, "config": case, "ms": ms,
                   "vs_cublas": reference / ms if reference and ms > 0 else None,
                   "rel_err": error if case == _TABLE else None,
                   "block_config": dataclasses.asdict(config) if case == _TABLE else None})
  return rows


def _table(rows: Sequence[dict]) -> list[str]:
  """One line per (shape, kept rows): each (GEMM, configuration)'s ms, and its speed against
  cuBLAS's (``0.96×``: 0.96 of cuBLAS's speed)."""
  columns = list(dict.fromkeys((r["gemm"], r["config"]) for r in rows))
  header = ["shape", "M×K→N", "kept"] + [f"{_LABELS[g]} {_LABELS.get(c, c)}" for g, c in columns]
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for key in dict.fromkeys((r["shape"], r["count"]) for r in rows):
    cells = {(r["gemm"], r["config"]): r for r in rows if (r["shape"], r["count"]) == key}
    first = next(iter(cells.values()))
    line = [first["shape"], f"{first['M']}×{first['K']}→{first['N']}",
            f"{first['kept_fraction']:.0%}"]
    for column in columns:
      row = cells.get(column)
      if row is None:
        line.append("–")
      elif row["config"] == _CUBLAS or row["vs_cublas"] is None:
        line.append(f"{row['ms']:.3f}")
      else:
        # A floor dW runs split as a model's would (sized_for_gpu): say so where it is.
        split = row["block_config"]["dw_split"] if (row["part"], row["gemm"]) == (
          "floor", "dw") else 1
        note = f", split {split}" if split > 1 else ""
        line.append(f"{row['ms']:.3f} ({row['vs_cublas']:.2f}×{note})")
    lines.append("| " + " | ".join(line) + " |")
  return lines


def markdown(result: dict) -> str:
  """The result as markdown: a header naming card, dtype and versions, one table per part."""
  lines = [f"# Pallas GEMMs alone against cuBLAS: {result['device']}, {result['dtype']}", "",
           f"Device time per call, ms (median of {result['trials']} slopes over {result['reps']} "
           "input sets, `benchmarks.timing.device_time_ms`); in brackets the speed against "
           "cuBLAS (`lax.dot_general`; XLA's own dot off GPU) on the same rows. Compacted "
           "inputs, identity permutation. Versions: "
           f"{versions_text(result['versions'])}."
           + (" **Pallas interpreter** (no GPU): the times measure the interpreter."
              if result["interpret"] else "")]
  titles = {"floor": "Every row kept (dX and dW per tile configuration)",
            "dw_split": "dW per row split and kept fraction (the table's tiles: `splitS`; "
                        "`tKxN_sS`: K×N tiles, 8 warps, split S)",
            "kept": "dX and dW on the table's tiles per kept fraction, 0 included (Pallas dX "
                    "stores every row; cuBLAS only the kept ones)"}
  for part in PARTS:
    rows = [r for r in result["rows"] if r["part"] == part]
    if rows:
      lines += ["", f"## {titles[part]}", "", *_table(rows)]
  if result["skipped"]:
    lines += ["", "Not run (time budget spent): " + ", ".join(result["skipped"]) + "."]
  return "\n".join(lines) + "\n"


def _write(out_dir: pathlib.Path, stem: str, result: dict) -> None:
  out_dir.mkdir(parents=True, exist_ok=True)
  (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
  (out_dir / f"{stem}.md").write_text(markdown(result))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
  parser.add_argument("--shapes", nargs="+", choices=sorted(LAYER_SHAPES),
                      default=["bert_up", "bert_attn", "bert_down", "llama_up_b8"])
  parser.add_argument("--tiny", action="store_true",
                      help=f"one tiny shape {TINY_SHAPE} instead of --shapes (a CPU smoke run)")
  parser.add_argument("--configs", nargs="+", choices=list(CANDIDATES),
                      default=list(FLOOR_CONFIGS), help="floor: tune_blocks.CANDIDATES names")
  parser.add_argument("--fractions", nargs="+", type=float, default=[0.05, 0.2, 0.5, 1.0],
                      help="dw_split, kept: kept fractions of the rows, in (0, 1] (kept alone: "
                           "0 too)")
  parser.add_argument("--splits", nargs="+", type=int, default=[1, 2, 3, 4, 5, 6, 8],
                      help="dw_split: row splits of the table's dW tiles")
  parser.add_argument("--dw-tiles", nargs="*", type=_tile, default=[(128, 256), (128, 128)],
                      help="dw_split: other dW tiles (KxN), each at every --tile-splits")
  parser.add_argument("--tile-splits", nargs="+", type=int, default=[1, 3, 5])
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--reps", type=int, default=6, help="distinct input sets per timing (>= 2)")
  parser.add_argument("--trials", type=int, default=15, help="timed program pairs per timing")
  parser.add_argument("--time-budget", type=float, default=None,
                      help="seconds: start no shape (fraction) after this; the rest is listed "
                           "as not run")
  parser.add_argument("--out-dir", type=pathlib.Path, default=pathlib.Path("."))
  parser.add_argument("--tag", default="", help="file name suffix: gemm_floor_TAG.json")
  args = parser.parse_args(argv)
  if any(not 0 <= f <= 1 for f in args.fractions) or (
      0 in args.fractions and "dw_split" in args.parts):
    parser.error("--fractions must lie in (0, 1] (0 too for --parts kept without dw_split)")
  if any(s < 1 for s in [*args.splits, *args.tile_splits]):
    parser.error("--splits and --tile-splits must be >= 1")
  if args.reps < 2:
    parser.error("--reps must be >= 2 (device_time_ms takes the slope between R and R/2 calls)")

  shapes = {"tiny": TINY_SHAPE} if args.tiny else {s: LAYER_SHAPES[s] for s in args.shapes}
  dtype = jnp.dtype(args.dtype)
  env = environment()
  interpret = env["platform"] != "gpu"  # the Pallas kernels lower to Triton on GPUs only
  result = {**env, "versions": library_versions(), "benchmark": "gemm_floor",
            "gpu": env["device"] if not interpret else None, "dtype": args.dtype,
            "reps": args.reps, "trials": args.trials, "interpret": interpret,
            "rows": [], "skipped": []}
  stem = "gemm_floor" + (f"_{args.tag}" if args.tag else "")
  timing = dict(reps=args.reps, trials=args.trials, interpret=interpret)
  jobs = [(f"floor {name}", lambda name=name, shape=shape: floor_rows(
    name, shape, args.configs, dtype, **timing)) for name, shape in shapes.items()
    if "floor" in args.parts]
  jobs += [(f"dw_split {name} {fraction:g}",
            lambda name=name, shape=shape, fraction=fraction: dw_split_rows(
              name, shape, fraction, args.splits, args.dw_tiles, args.tile_splits, dtype,
              **timing))
           for name, shape in shapes.items() for fraction in args.fractions
           if "dw_split" in args.parts]
  jobs += [(f"kept {name} {fraction:g}",
            lambda name=name, shape=shape, fraction=fraction: kept_rows(
              name, shape, fraction, dtype, **timing))
           for name, shape in shapes.items() for fraction in args.fractions
           if "kept" in args.parts]
  start = time.monotonic()
  for label, job in jobs:
    if args.time_budget is not None and time.monotonic() - start > args.time_budget:
      result["skipped"].append(label)
      continue
    rows = job()
    result["rows"] += rows
    print(f"{label}: " + " ".join(f"{r['gemm']}/{r['config']}={r['ms']:.4f}" for r in rows),
          flush=True)
    _write(args.out_dir, stem, result)
  _write(args.out_dir, stem, result)
  print(markdown(result))
  return result


if __name__ == "__main__":
  main()
