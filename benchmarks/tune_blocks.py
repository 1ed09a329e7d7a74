"""Check and time Pallas tile configurations of the SEBP backward on one GPU.

For each layer shape and active fraction: verify every configuration against the dense backward
on the masked gradient, then time it beside the dense XLA backward and the ideal (dense matmuls on
rows compacted beforehand). The winners go into ``_BLOCK_TABLE`` of ``sebp_jax/backends/pallas.py``;
the ``table`` configuration is the layer's entry there today, the one a candidate must beat.
Each configuration scores ``dy`` itself (per-layer selection, the dropped rows' zeros stored by the
dX kernel), or with ``--planned`` takes the kept rows as a row plan made beforehand, as a model
step hands them to every layer (no selection; the dropped rows zeroed by a select, which a model
fuses into ``dx``'s consumers and a lone layer runs as a pass of its own).

    python -m benchmarks.tune_blocks --shapes bert_up bert_down --configs table dx_split4 \
        --out tune.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import profile_step
from benchmarks.layer import ideal_backward, sebp_backward, with_row_plans
from benchmarks.layer_shapes import LAYER_SHAPES, padded_gradient
from benchmarks.timing import device_time_ms, environment
from sebp_jax.backends import pallas as pallas_backend
from sebp_jax.backends import xla as xla_backend
from sebp_jax.policy import RowPolicy, keep_mask

_Config = pallas_backend.BlockConfig
CANDIDATES = {
  "default": _Config(),
  # Wider dX tiles: fewer passes over dyc per column block, more work per program.
  "dx128": _Config(dx_m=128, dx_k=128, dx_n=64, dx_warps=8),
  "dx128x256": _Config(dx_m=128, dx_k=256, dx_n=64, dx_warps=8),
  # Wider dW tiles, or longer steps over rows.
  "dw128x256": _Config(dw_k=128, dw_n=256, dw_m=64, dw_warps=8),
  "dw_m128": _Config(dw_m=128, dw_k=128, dw_n=128, dw_warps=8),
  "stages4": _Config(dx_stages=4, dw_stages=4),
  "big": _Config(dx_m=128, dx_k=256, dx_n=64, dx_warps=8, dw_k=128, dw_n=256, dw_m=64),
  # Every row kept (benchmarks.gemm_floor; NOTES "v9"): the wide tiles with deeper pipelines or
  # shorter steps, dW with 4 warps, and dW's 128 x 256 tile transposed.
  "dx128_s4": _Config(dx_m=128, dx_k=128, dx_n=64, dx_warps=8, dx_stages=4),
  "dx128x256_n32_s4": _Config(dx_m=128, dx_k=256, dx_n=32, dx_warps=8, dx_stages=4),
  "dw_w4": _Config(dw_warps=4),
  # The LM head's dW at a few dozen kept rows: 24,048 128 x 128 tiles of one or two row blocks
  # each, a store-bound launch (NOTES "v32"): 4 warps, wider tiles, shallower pipelines.
  "dw_w4_n256": _Config(dw_n=256, dw_warps=4),
  "dw_w4_s2": _Config(dw_warps=4, dw_stages=2),
  "dw_w4_m32": _Config(dw_warps=4, dw_m=32),
  # One dW program per SM at 8 warps (151-159 registers, benchmarks/NOTES.md "Launch
  # resources"): BERT FFN's 144 tiles run in 1.09 waves; a 64-wide tile fits three per SM (78
  # registers) and 288 programs run in 0.73 waves.
  "dw_k64": _Config(dw_k=64),
  # ... split at run time as if three programs per SM (its 78 registers allow it): BERT attn's 72
  # tiles in up to 5 parts of at least 8 row blocks (dw_split and dw_slots in _AFTER_SIZING);
  # measured as `dw_k64_3sm` in v25 (NOTES), not adopted.
  "dw_k64_split5": _Config(dw_k=64, dw_min_part=8),
  # ... and the default tiles unsplit (dw_split set after sizing, in _AFTER_SIZING): dw_k64's
  # gain on BERT attn at 2-12 % real tokens came with its 72 tiles leaving the split at 1, where
  # 36 tiles split 3 ways (NOTES "Launch resources measured").
  "dw_unsplit": _Config(),
  "dw128x256_m32_s4": _Config(dw_k=128, dw_n=256, dw_m=32, dw_warps=8, dw_stages=4),
  "dw256x128": _Config(dw_k=256, dw_n=128, dw_m=64, dw_warps=8),
  # Few kept rows: each dW program loads one or two row blocks and stores its tile, so the time
  # is latency, not math (a LLaMA-b1 up projection's dW at 0 kept rows takes as long as at 81,
  # benchmarks/NOTES.md "v13"): smaller pipelines, so that more programs share an SM.
  "dw_m32_s2": _Config(dw_m=32, dw_stages=2),
  "dw_m32_s2_w4": _Config(dw_m=32, dw_stages=2, dw_warps=4),
  # ... or persistent dW programs (2 or 3 per SM of a 132-SM H100 or H200, as their pipelines
  # fit), each looping over tiles: a tile's stores drain while the program loads the next
  # tile's rows, instead of a new program's launch and first loads (benchmarks/NOTES.md, "v13":
  # 1,536 programs store LLaMA b1 up's 50 MB dW at 1.8 TB/s).
  # dW's tail tiles (with_dw_split) split one part per this many row blocks of kept rows (the
  # table's 16 and below it): more parts fill the SMs sooner, each adds a partial tile.
  "dw_min_part4": _Config(dw_min_part=4),
  "dw_min_part8": _Config(dw_min_part=8),
  "dw_p264": _Config(dw_programs=264),
  "dw_p396_s2_w4": _Config(dw_programs=396, dw_stages=2, dw_warps=4),
  # Few kept rows: narrower dX column blocks spread the stream of each row block over more SMs
  # (LLaMA-3B at batch 1, ~80 kept rows: 48 dX programs on 132 SMs with the default tiles, 96
  # with dx_k64, 192 with dx_k32); shorter row blocks waste less of the last one.
  "dx_k64": _Config(dx_k=64),
  "dx_k32": _Config(dx_k=32),
  "dx_m32_k64": _Config(dx_m=32, dx_k=64),
  "dx_m32_k32": _Config(dx_m=32, dx_k=32),
  "dx_k32_n128": _Config(dx_k=32, dx_n=128),
  # ... or one row block holds them all, so W streams from DRAM once, in narrow column blocks.
  "dx_m128_k32": _Config(dx_m=128, dx_k=32, dx_warps=8),
  "dx_m128_k64": _Config(dx_m=128, dx_k=64, dx_warps=8),
  "dx_m128_k32_n128": _Config(dx_m=128, dx_k=32, dx_n=128, dx_warps=8),
  # ... or longer steps over N with more of them in flight: more bytes per program in the air.
  "dx_n128": _Config(dx_n=128),
  "dx_n128_s4": _Config(dx_n=128, dx_stages=4),
  "dx_k64_n128": _Config(dx_k=64, dx_n=128),
  "group1": _Config(dx_group=1, dw_group=1),  # the grouped tile order off, for its effect
  # ... in dW alone: each SM's consecutive tiles then store to one row of dW's tiles, not a
  # column of eight (LLaMA b1's MLP dW stores 50 MB at ~1.8 TB/s, NOTES "Next").
  "dw_group1": _Config(dw_group=1),
  # Few kept rows: the count-adaptive dX split, at most 2 / 4 / 8 parts per tile, as many as fill
  # the persistent launch (`with_dx_programs`: two programs per SM where two tiles' pipelines fit
  # in its shared memory, 264 on a 132-SM H100 or H200 for these tiles; one per SM for the
  # `wide_short` class's four 128-column steps), and one program per SM for comparison; the split
  # on `wide_short`'s tiles, and on 32-row tiles (less of a last row block wasted on padding).
  "dx_split2": _Config(dx_split=2),
  "dx_split4": _Config(dx_split=4),
  "dx_split8": _Config(dx_split=8),
  "dx_split8_p132": _Config(dx_split=8, dx_programs=132),
  # Three persistent dX programs per SM, which the default tile's 72 KB pipeline and 158
  # registers allow (NOTES "Launch resources"; with_dx_programs sizes two): BERT FFN up at
  # 18.6 % real has 288 live tiles, a second round for 24 of 264 programs, one round of 396.
  "dx_p396": _Config(dx_programs=396),
  "dx_n128_s4_split4": _Config(dx_n=128, dx_stages=4, dx_split=4),
  # ... on the `wide_short` tiles (one program per SM: each live tile splits at most 2 ways), or
  # on 64-column steps four deep, two programs per SM (LLaMA b1's ~85 kept rows: 48 live tiles,
  # parts up to 4 or 5 of 264 programs; Nsight on the table's tiles had 54 % of the SMs active,
  # NOTES "v18").
  "dx_n128_s4_split2": _Config(dx_n=128, dx_stages=4, dx_split=2),
  "dx_s4_split4": _Config(dx_stages=4, dx_split=4),
  "dx_s4_split8": _Config(dx_stages=4, dx_split=8),
  # ... on the `wide` class's 128 x 256 dX tiles: LLaMA-3B at batch 4 keeps ~230 of 16,384 rows,
  # 2 row blocks x 12 column blocks = 24 live tiles for 132 programs (one 147 KB pipeline per
  # SM), so 24 SMs stream W; split, up to 4 (or 132 // 24 = 5) parts of each tile's N loop.
  "big_split4": _Config(dx_m=128, dx_k=256, dx_n=64, dx_warps=8, dw_k=128, dw_n=256, dw_m=64,
                        dx_split=4),
  "big_split8": _Config(dx_m=128, dx_k=256, dx_n=64, dx_warps=8, dw_k=128, dw_n=256, dw_m=64,
                        dx_split=8),
  # ... or on 128 x 128 dX tiles (`dx128`), which hold no spilled registers where the `wide`
  # tiles' 128 x 256 accumulator spills 132-260 B a thread inside the loop (NOTES "v35").
  "dx128_split4": _Config(dx_m=128, dx_k=128, dx_n=64, dx_warps=8, dx_split=4),
  # ... four steps deep (at 1.6 % kept rows `dx128_s4` had q/o's fastest dX, `dx128_split4` up's).
  "dx128_s4_split4": _Config(dx_m=128, dx_k=128, dx_n=64, dx_warps=8, dx_stages=4, dx_split=4),
  "dx_m32_split4": _Config(dx_m=32, dx_split=4),
  # ... or one 128-row block holds all of a few dozen kept rows, so W streams from memory once,
  # its N loop split so that ~24 tiles become ~200 items (NOTES "v13": at 2 % the dX time is
  # the GEMM programs streaming W, ~41 GB/s each).
  "dx_m128_split8": _Config(dx_m=128, dx_warps=8, dx_split=8),
  "dx_m128_n128_s3_split8": _Config(dx_m=128, dx_n=128, dx_stages=3, dx_warps=8, dx_split=8),
  # No gather: the GEMMs read the kept rows in place through the permutation (as the vocabulary
  # class does). At a few dozen kept rows the gather is a launch and ~8 µs of a ~0.1 ms layer
  # (benchmarks/NOTES.md, "v8"), and the GEMMs stream W, not the rows.
  "in_place": _Config(compact=False),
  # ... with dX's and dW's programs in one launch, as the torch reference's planned launch runs
  # them (benchmarks/NOTES.md, "What the torch launch has that the JAX kernels do not").
  "fused": _Config(compact=False, fused=True),
  # ... and on the compacted rows: v22 (benchmarks/NOTES.md, "v22 measured") had `fused` 14-24 % faster than
  # `in_place` and the default at 2 % real rows, and up to 1.7x slower than the default at 13-50 %,
  # where the GEMMs' loads through the permutation cost more than the gather saves.
  "fused_compact": _Config(fused=True),
  # ... on the `wide_short` class's tiles (LLaMA-3B at batch 1: four 128-column steps), and with
  # three steps in flight (one launch holds both GEMMs' pipelines).
  "fused_n128_s4": _Config(dx_n=128, dx_stages=4, fused=True),
  "fused_n128_s3": _Config(dx_n=128, dx_stages=3, fused=True),
  "in_place_n128_s4": _Config(dx_n=128, dx_stages=4, compact=False),
}
# The layer's own entry of the tile table, as `block_config` hands it to the layer: the baseline a
# candidate must beat ("default" is BlockConfig()'s tiles, which only the `narrow` class runs).
TABLE = "table"
# Launch parameters a candidate sets against sized_for_gpu's choice for this GPU.
_AFTER_SIZING = {"dw_unsplit": dict(dw_split=1),
                 "dw_k64_split5": dict(dw_split=5, dw_slots=396)}
_BASELINES = ("dense", "ideal", "xla", "selection")

_DENSE_BACKWARD = sebp_backward("dense")


def sized_candidate(name: str, num_rows: int, in_features: int, out_features: int,
                    dtype) -> pallas_backend.BlockConfig:
  """``CANDIDATES[name]`` as the tuner times it on a layer of that shape: read in place where
  :func:`~sebp_jax.backends.pallas.block_config` has the layer read in place (vocabulary-wide
  layers; the in-place candidates on every shape), sized for this GPU, then ``_AFTER_SIZING``'s
  parameters. :data:`TABLE` is the layer's own ``block_config``."""
  if name == TABLE:
    return pallas_backend.block_config(num_rows, in_features, out_features, dtype)
  candidate = CANDIDATES[name]
  config = dataclasses.replace(candidate, compact=candidate.compact and pallas_backend.block_config(
    num_rows, in_features, out_features, dtype).compact)
  return dataclasses.replace(pallas_backend.sized_for_gpu(config, in_features, out_features, dtype),
                             **_AFTER_SIZING.get(name, {}))


def _selection(dy):
  return pallas_backend.partition_pallas(keep_mask(dy, RowPolicy()))


def _family_times(fn, input_sets) -> dict[str, float]:
  """GPU ms per call of ``fn`` by kernel family (``profile_step``'s), over ``input_sets``."""
  jitted = jax.jit(fn)
  jax.block_until_ready(jitted(*input_sets[0]))
  kernels = profile_step.traced_kernel_times(
    lambda: [jax.block_until_ready(jitted(*args)) for args in input_sets], len(input_sets))
  families = profile_step.family_times(kernels)
  return {"busy": sum(families.values()), **families}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", nargs="+", default=["bert_up", "bert_down"])
  parser.add_argument("--fractions", nargs="+", type=float, default=[0.05, 0.2, 0.5])
  parser.add_argument("--configs", nargs="+", default=[TABLE, *CANDIDATES],
                      choices=[TABLE, *CANDIDATES])
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--reps", type=int, default=8)
  parser.add_argument("--baselines", nargs="*", default=list(_BASELINES), choices=_BASELINES,
                      help="reference timings per shape and fraction (default: all)")
  parser.add_argument("--out", default=None, help="JSON file, rewritten after every shape and "
                      "fraction (so a run cut short keeps what it measured)")
  parser.add_argument("--kernels", action="store_true",
                      help="also time gather, dX and dW alone on a ready partition")
  parser.add_argument("--families", action="store_true",
                      help="also trace each configuration's backward and report GPU time per "
                           "kernel family (partition, gather, dX, dW, other); GPU only")
  parser.add_argument("--planned", action="store_true",
                      help="hand each configuration the kept rows as a row plan made beforehand "
                           "instead of scoring dy (the path of a model step with a plan)")
  args = parser.parse_args()
  dtype = jnp.dtype(args.dtype)
  rows = []
  for shape_name in args.shapes:
    shape = LAYER_SHAPES[shape_name]
    for fraction in args.fractions:
      sets = [padded_gradient(shape, fraction, dtype, seed) for seed in range(args.reps)]
      # The inputs of a configuration's backward: the layer's, its weight as the model stores
      # it (a tied head's (N, K): in the (K, N) layout its dX took 1.36 ms against the model's
      # 0.375, NOTES "v32"), and its row plan where planned.
      config_sets = [(x, jnp.asarray(w.T) if shape.tied else w, dy) for x, w, dy, _ in sets]
      if args.planned:
        config_sets = with_row_plans(config_sets)
      x, w, dy, count = sets[0]
      expected = _DENSE_BACKWARD(x, w, dy)
      keep = np.asarray(jnp.max(jnp.abs(dy), axis=1) > 0)
      ideal_sets = [(s[0][keep], s[1], s[2][keep]) for s in sets]
      base = {"shape": shape_name, "M": shape.rows, "K": shape.in_features,
              "N": shape.out_features, "active_fraction": count / shape.rows}
      baselines = {
        "dense": lambda: device_time_ms(_DENSE_BACKWARD, [s[:3] for s in sets]),
        "ideal": lambda: device_time_ms(ideal_backward, ideal_sets),
        "xla": lambda: device_time_ms(
          functools.partial(xla_backend.backward, policy=RowPolicy()), [s[:3] for s in sets]),
        "selection": lambda: device_time_ms(_selection, [s[2:3] for s in sets]),
      }
      timings = {name: baselines[name]() for name in args.baselines}
      families = {}
      for name in args.configs:
        config = sized_candidate(name, shape.rows, shape.in_features, shape.out_features, dtype)
        fn = lambda x, w, dy, plan=None, config=config: pallas_backend.backward(
          x, w, dy, policy=RowPolicy(), config=dataclasses.replace(config, crossover=1.0),
          plan=plan, kernel_nk=shape.tied)
        got = jax.jit(fn)(*config_sets[0])
        if shape.tied:  # dW comes back in the weight's stored layout
          got = (got[0], got[1].T)
        errors = [float(jnp.linalg.norm((g - e).astype(jnp.float32))
                        / jnp.linalg.norm(e.astype(jnp.float32))) for g, e in zip(got, expected)]
        timings[name] = device_time_ms(fn, config_sets)
        if args.kernels:
          timings[name + "/kernels"] = device_time_ms(
            functools.partial(pallas_backend.sparse_backward, config=config,
                              kernel_nk=shape.tied),
            [(*s[:3], *_selection(s[2])) for s in config_sets])
        if args.families:
          families[name] = _family_times(fn, config_sets)
        if max(errors) > 2e-2:
          print(f"  MISMATCH {shape_name} {fraction} {name}: rel err dx/dw {errors}", flush=True)
        rows.append({**base, "config": name, "rel_err_dx": errors[0], "rel_err_dw": errors[1],
                     "ms": timings[name], "kernels_ms": timings.get(name + "/kernels"),
                     "families_ms": families.get(name),
                     "block_config": dataclasses.asdict(config)})
      for name in args.baselines:
        rows.append({**base, "config": name, "ms": timings[name]})
      print(f"{shape_name} {count / shape.rows:5.1%} " + " ".join(
        f"{k}={v:.3f}" for k, v in timings.items()), flush=True)
      for name, times in families.items():
        print(f"  {name}: " + " ".join(f"{k}={v:.4f}" for k, v in times.items()), flush=True)
      if args.out:
        with open(args.out, "w") as f:
          json.dump({**environment(), "dtype": args.dtype, "planned": args.planned,
                     "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
