"""SEBP backward as Pallas kernels lowered through Triton (GPU), or run by the Pallas interpreter.

The plan (DESIGN §5, v5: compact first):

* **selection** (XLA, memory-bound): the keep mask (:mod:`sebp_jax.policy`), or a
  :class:`~sebp_jax.plan.RowPlan` handed in once per step;
* **partition kernel**: the active-first permutation ``perm`` of all rows and the runtime
  ``count``, one program per chunk of rows (each sums the flags before its chunk itself, so no
  second launch carries offsets between programs);
* **gather kernel**: copies the kept rows of ``x`` and ``dy`` into contiguous buffers ``xc`` and
  ``dyc`` (row ``i`` of ``dyc`` is row ``perm[i]`` of ``dy``). A few programs per SM and column
  chunk loop over the row blocks below ``count``; the block that straddles ``count`` gets zeros
  past it, so the GEMMs below never mask.
  Vocabulary-wide layers (``compact=False``) skip it: their copy of ``dy`` would be as large as
  ``dy`` itself (1 GB for LLaMA's head at 4096 tokens), a peak-memory cost dense does not have,
  so the GEMMs read the kept rows in place through ``perm`` and mask the rows past ``count``;
* **dX kernel**: a GEMM over the compacted prefix. Each ``(dx_m, dx_k)`` tile with kept rows
  multiplies contiguous rows of ``dyc`` by ``kernelᵀ`` and stores to rows ``perm[tile]`` of
  ``dx``; a tile past ``count`` stores zeros there, reading nothing. Every row of ``dx`` is
  written exactly once. The launch is persistent: ``dx_programs`` programs (sized for the GPU)
  loop over the live tiles, then over the zero tiles (sent to the programs the GEMM leaves idle
  where those can absorb them), so no program is launched just to store one zero tile. With
  few kept rows those tiles are fewer than the programs, each streaming all of ``N``; with
  ``dx_split`` each live tile's ``N`` loop is shared by ``parts`` programs, ``parts`` chosen from
  ``count`` at run time to occupy the launch, and the last of them to arrive sums their float32
  partial tiles and stores the tile (the fix-up that dW's split uses, no second launch);
* **dW kernel**: a GEMM over the contiguous prefix of ``xc`` and ``dyc``, with the runtime trip
  count ``cdiv(count, dw_m)``. The tiles of a last wave that would leave most SMs idle (all of
  them where the tiles are fewer than the SMs) are split over rows: up to ``dw_split`` programs
  share such a tile, as many as ``count`` gives ``dw_min_part`` row blocks each, and the last to
  arrive sums their float32 partial tiles (split-K with a stream-K fix-up, no second launch);
  ``dw_programs`` (opt-in) makes the whole tiles' programs persistent;
* **crossover**: above a measured fraction of kept rows ``lax.cond`` runs the dense backward.

Both GEMMs walk their tiles in grouped order (``dx_group`` / ``dw_group`` row blocks at a time,
every column block of a group before the next group), so the tiles that run at once share their
operand rows in L2 instead of each streaming them from memory.

Every Pallas detail of the project lives in this file.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from sebp_jax.backends.xla import (DW_DIMS, DX_DIMS, DX_NK_DIMS, accumulate_siblings,
                                   dense_backward, full_column_sums)
from sebp_jax.plan import RowPlan
from sebp_jax.policy import RowPolicy, keep_mask

__all__ = ["BlockConfig", "block_config", "sized_for_gpu", "with_dw_split", "with_dx_programs",
           "backward", "siblings_backward", "sparse_backward", "partition_pallas", "gather_pallas",
           "dx_pallas", "dw_pallas", "dw_siblings_pallas", "grads_pallas"]


@dataclasses.dataclass(frozen=True)
class BlockConfig:
  """Tile sizes and launch parameters of the kernels.

  ``dx_*``: the dX kernel's tile is ``dx_m`` rows x ``dx_k`` columns, looping over ``N`` in steps
  of ``dx_n``. ``dw_*``: the dW kernel's tile is ``dw_k x dw_n``, looping over kept rows in steps
  of ``dw_m``; up to ``dw_split`` programs share the rows of each tile of the *tail* (split-K over
  rows): past ``dw_slots`` tiles (the dW programs the GPU runs at once; ``0``: unknown) the tiles
  of the last, partial wave, else every tile. How many share it is decided at run time: one per
  ``dw_min_part`` row blocks of kept rows, at most ``dw_split``; the last part to finish sums
  their float32 partial tiles in the kernel. ``dx_group`` / ``dw_group``: row (``K``) blocks per
  group of the grouped tile order. ``compact``: copy the kept rows into contiguous buffers before
  the GEMMs (``False``: the GEMMs read them in place through the permutation; :func:`block_config`
  chooses that for vocabulary-wide layers, where the copy would add a ``dy``-sized buffer to the
  peak memory). ``crossover``: the kept-row fraction above which the dense backward runs instead.
  ``fused``: dX's and dW's programs in one launch (``sebp_grads``), as the torch reference's
  planned launch does, instead of one each, on the compacted rows (or in place with
  ``compact=False``); it splits no dX tile, so it needs ``dx_split == 1``. Its ``num_warps`` and
  ``num_stages`` are the larger of the two GEMMs'.

  ``dx_programs``: the programs of the (persistent) dX launch, each looping over live tiles;
  ``0`` is one per tile, :func:`with_dx_programs` sizes it for a GPU (its SMs times the
  programs one SM holds). ``dw_programs``: likewise for the dW tiles that are not split, each
  program looping over them (``0``, the default everywhere: one program per tile).

  The dX split (off at ``dx_split == 1``): with few kept rows only ``cdiv(count, dx_m) * K /
  dx_k`` dX tiles have work, fewer than the programs, and each streams its whole loop over ``N``
  alone (LLaMA-3B at batch 1: ~100 of 4096 rows, 48 tiles for 132 SMs). With ``dx_split > 1``
  each live tile's ``N`` loop is shared by ``parts = clamp(dx_programs // live tiles, 1,
  dx_split)`` programs, chosen at run time from ``count``; the last of them to finish sums their
  float32 partial tiles in the same launch. Past ``dx_programs // 2`` live tiles ``parts`` is 1
  and the split costs only the memset of its arrival counters.
  """

  dx_m: int = 64
  dx_k: int = 128
  dx_n: int = 64
  dx_warps: int = 4
  dx_stages: int = 3
  dx_group: int = 8
  dw_m: int = 64
  dw_k: int = 128
  dw_n: int = 128
  dw_warps: int = 8
  dw_stages: int = 3
  dw_group: int = 8
  dw_split: int = 1
  dw_slots: int = 0
  dw_min_part: int = 16
  dx_split: int = 1
  dx_programs: int = 0
  dw_programs: int = 0
  compact: bool = True
  crossover: float = 0.4
  fused: bool = False


# Measured tile choices, keyed by (GPU generation, dtype width in bytes, shape class). Tuned with
# benchmarks/tune_blocks.py on an H100 (results/v5_h100/tune_h100_v5.json; benchmarks/NOTES.md, "v5").
# "wide": at least _WIDE_ROWS rows and a weight of at least _WIDE_WEIGHT entries (LLaMA-3B's
# 3072 x 8192 MLP at batch 8), where 128 x 256 tiles in both GEMMs run 1.25x (23 % kept rows) to
# 1.44x (all rows) faster than the default. With fewer rows the kept ones are few (LLaMA at batch
# 1: ~80 of 4096), and the wide dX tiles leave most SMs idle: the model step was 11 % slower
# with them than with the default tiles (results/v5_h100/llama_b1_v4_vs_v5.md). BERT-base's
# 768 x 3072 layers are faster on the default tiles below ~20 % kept rows.
_BLOCK_TABLE: dict[tuple[str, int, str], BlockConfig] = {
  ("hopper", 2, "narrow"): BlockConfig(),
  # "small": a weight of at most _SMALL_WEIGHT entries (BERT-base's 768 x 768 projections):
  # 64-wide dW tiles, 72 of them, one wave, never split. Against the 128 x 128 tiles (36, split 3
  # ways at run time) dW took 3.7 / 5.7 / 11.1 / 15.8 us against 5.1 / 7.9 / 14.0 / 16.1 at 1.9 /
  # 4.7 / 12.1 / 18.6 % real, and lost only at 46.5 % (46.7 against 26.9), where the 0.4
  # crossover runs the dense backward; split at run time themselves (5 parts of >= 8 row blocks,
  # three programs per SM, which their 78 registers allow) they lost at 12.1 and 18.6 % (17.0
  # and 19.0 us) (results/v35_h200/call2/, benchmarks/NOTES.md "v25"; v23 measured the tile
  # first, with XLA summing the split: BERT-base b32's step -0.17 ms of GPU time at 2.5 % real
  # tokens, results/v32_h200/call4/).
  ("hopper", 2, "small"): BlockConfig(dw_k=64),
  # Its dX split up to 4 ways below 5 row blocks of kept rows (2 for the down projection's 32
  # column blocks): LLaMA-3B at batch 4 keeps ~230 of 16,384 rows, 24 live tiles for 132 SMs.
  # Planned dX on an H200 at 1.6 / 6.6 / 26.2 % real, up 81.9 -> 47.7 / 86.1 -> 86.0 / 276.6 ->
  # 279.6 us, q/o 36.7 -> 28.6 / 38.7 -> 38.7 / 119.8 -> 119.6, down 39.9 -> 39.8 / 92.1 ->
  # 92.4 / 292.8 -> 295.0 (results/v40_h200/call2/, benchmarks/NOTES.md "v35"). Both GEMMs'
  # 128 x 256 tiles spill registers inside their loops (132-260 B a thread); the 128 x 128 dX
  # tiles and the default dW tiles, which do not, were slower at 6.6 and 26.2 % all the same.
  ("hopper", 2, "wide"): BlockConfig(dx_m=128, dx_k=256, dx_n=64, dx_warps=8, dx_split=4,
                                     dw_k=128, dw_n=256, dw_m=64, dw_warps=8),
  # "wide_short": a weight as large, fewer rows (LLaMA-3B at batch 1-3). Its ~2-5 % kept rows
  # give a few dozen dX tiles, each streaming all of N alone; steps of 128 columns four deep keep
  # more of W in flight per program: MLP up 0.154 -> 0.120 ms at 2 %, 0.170 -> 0.132 at 5 %,
  # 0.241 -> 0.233 at 21 %; q/o 0.089 -> 0.069 at 2 % but +10 % at 21 %
  # (results/v8_h100/tune_v8_dx_h100.json, whole backward with selection). The MLP down
  # projection (N = 3072 < K = 8192) lost with these steps while every dead tile had its own
  # program (dX +18 % at 2 %, results/v10_h100/tune_v10.log); on the persistent launch it gains:
  # dX 57 -> 49 us at 2 %, 62 -> 58 at 5 %, 127 -> 130 at 21 % (results/v14_h100/tune_v14_h100.json).
  # Split 2 ways below 128 kept rows (one program per SM, 2 row blocks x 24 column blocks = 48
  # live tiles on 132 SMs; the last part sums the two in the launch): planned dX on an H200 at
  # 2.1 % / 22.3 % real, up 33.4 -> 29.5 / 109.7 -> 112.8 us, q/o 16.1 -> 14.4 / 52.2 -> 47.5,
  # down 23.5 -> 24.0 / 126.3 -> 118.0 (results/v39_h200/call1/, benchmarks/NOTES.md "v33").
  ("hopper", 2, "wide_short"): BlockConfig(dx_n=128, dx_stages=4, dx_split=2),
  # "vocab": at least _IN_PLACE_COLUMNS output columns (LLaMA-3's tied LM head), read in place.
  # With ~80 kept rows its dX has 48 tiles, each streaming 128,256 columns of W alone: 1.62 ms.
  # Split 8 ways at up to two working programs per SM (264 on a 132-SM H100/H200, as
  # with_dx_programs sizes these tiles) it takes 0.48 ms, and the layer's backward 2.34 -> 1.63
  # ms (results/v8_h100/tune_v8_head_h100.json). Its dW, 24,048 tiles of 128 x 128 at LLaMA-3B's
  # few dozen kept rows, each one or two row blocks then a 32 KB store, runs 34-40 % faster on 4
  # warps than on 8: 0.84 -> 0.56 ms at 1.6 % kept rows (b1), 1.48 -> 0.93 (b4), 3.93 -> 2.34 at
  # 5.5 % (b4); wider tiles lost (results/v38_h200/call8/, benchmarks/NOTES.md "v32").
  ("hopper", 2, "vocab"): BlockConfig(dx_split=8, dw_warps=4),
  # float32: one entry for every class (not re-tuned for v5).
  **{("hopper", 4, shape_class): BlockConfig(dx_n=32, dw_m=32, dw_k=64, dw_n=128, dw_warps=4)
     for shape_class in ("small", "narrow", "wide", "wide_short", "vocab")},
}
_SMALL_WEIGHT = 1024 * 1024
_WIDE_WEIGHT = 3072 * 3072
_WIDE_ROWS = 16384
# Layers with at least this many output columns (a vocabulary: LLaMA-3's 128,256, BERT's 30,522)
# are not compacted: their GEMMs read the kept rows in place. With few kept rows the copy saves
# those GEMMs little, and it would hold a `dy`-sized buffer at the peak of the step (LLaMA-3.2-3B
# at batch 1: +1.5 GB, +4 % of dense's peak, results/einsum_h100/llama_b1_einsum_h100.md).
_IN_PLACE_COLUMNS = 16384
_DEFAULT_CONFIG = BlockConfig()
# Triton's dot needs every operand dim to be at least 16.
_MIN_BLOCK = 16
# The most programs :func:`with_dw_split` lets share one dW tile. Each part stores a float32
# partial tile that the last part reads back; while XLA summed every part's whole partial dW in
# a pass of its own, past 4 parts that pass cost more than the idle SMs they filled (v9). The
# fix-up in the kernel reads only the tail's tiles, and only where `count` gives each part
# `dw_min_part` row blocks: BERT-base's FFN (144 tiles on 132 SMs) splits its 12 tail tiles 8 ways.
_MAX_DW_SPLIT = 8
# Sibling products' dW in one launch (dw_siblings_pallas) instead of one launch each: BERT's
# q/k/v dW fill the GPU together where each alone runs on 72 of 132 SMs (-0.16 ms of a 7.2 ms
# backward at 12.5 % real; benchmarks/NOTES.md, "v37 measured"). False gives the launch per
# sibling, which the tests compare it with bitwise.
_SIBLINGS_DW_ONE_LAUNCH = True
# Sibling products' dX in one launch (dx_pallas of every sibling: each tile's loop runs through
# their N in turn) where their dX tiles are alike, instead of a launch each, the later ones
# adding into the first one's dx: BERT's q/k/v, a 36-step chain a tile instead of three 12-step
# ones and two launch tails fewer (-0.07 to -0.09 ms of BERT-base b32's backward GPU time,
# benchmarks/NOTES.md "v39 measured"). False gives the launch per sibling: the model benchmarks'
# reverse A/B variant `jax-sebp-pallas-plan-nocond-dx-per-sibling`.
_SIBLINGS_DX_ONE_LAUNCH = True
# The fields of a BlockConfig that make a dX launch: siblings with equal ones can share one.
_DX_FIELDS = ("dx_m", "dx_k", "dx_n", "dx_warps", "dx_stages", "dx_group", "dx_split",
              "dx_programs", "compact", "fused")
# Shared memory one Hopper SM gives its programs (227 KB of its 228).
_SHARED_MEMORY = 227 * 1024


def _default_device():
  """The default backend's first device, or ``None`` where it has none."""
  try:
    return jax.devices()[0]
  except RuntimeError:
    return None


def _gpu_generation() -> str:
  device = _default_device()
  if device is None:
    return "unknown"
  kind = device.device_kind.lower()
  for marker, generation in (("h100", "hopper"), ("h200", "hopper"), ("h800", "hopper"),
                             ("gh200", "hopper"), ("a100", "ampere"), ("a10", "ampere")):
    if marker in kind:
      return generation
  return "unknown"


def _sm_count() -> int | None:
  """Streaming multiprocessors of the default device, or ``None`` off GPU."""
  device = _default_device()
  if device is None or device.platform != "gpu":
    return None
  return getattr(device, "core_count", None)


def _fit(block: int, dim: int) -> int:
  """``block`` shrunk to the smallest power of two >= ``dim`` (never below ``_MIN_BLOCK``)."""
  return max(_MIN_BLOCK, min(block, pl.next_power_of_2(dim)))


def block_config(num_rows: int, in_features: int, out_features: int, dtype) -> BlockConfig:
  """Tile sizes for an ``(M, K) x (K, N)`` layer: the table's entry for this GPU, dtype and
  weight size, shrunk to small shapes.

  dW's tiles of a last, partial wave (all of them where they are fewer than the GPU's SMs) are
  split over rows by up to :data:`_MAX_DW_SPLIT` programs (:func:`with_dw_split`).
  """
  if out_features >= _IN_PLACE_COLUMNS:
    shape_class = "vocab"
  elif in_features * out_features >= _WIDE_WEIGHT:
    shape_class = "wide" if num_rows >= _WIDE_ROWS else "wide_short"
  elif in_features * out_features <= _SMALL_WEIGHT:
    shape_class = "small"
  else:
    shape_class = "narrow"
  base = _BLOCK_TABLE.get((_gpu_generation(), jnp.dtype(dtype).itemsize, shape_class),
                          _DEFAULT_CONFIG)
  config = dataclasses.replace(
    base,
    dx_m=_fit(base.dx_m, num_rows), dx_k=_fit(base.dx_k, in_features),
    dx_n=_fit(base.dx_n, out_features),
    dw_m=_fit(base.dw_m, num_rows), dw_k=_fit(base.dw_k, in_features),
    dw_n=_fit(base.dw_n, out_features), compact=out_features < _IN_PLACE_COLUMNS,
  )
  return sized_for_gpu(config, in_features, out_features, dtype)


def sized_for_gpu(config: BlockConfig, in_features: int, out_features: int,
                  dtype) -> BlockConfig:
  """``config`` sized for this GPU and a layer of ``in_features x out_features`` in ``dtype``
  (:func:`with_dw_split`, :func:`with_dx_programs`), as :func:`block_config` hands its table
  entries to a layer."""
  return with_dx_programs(with_dw_split(config, in_features, out_features), dtype)


def with_dw_split(config: BlockConfig, in_features: int, out_features: int) -> BlockConfig:
  """``config`` with ``dw_slots`` the dW programs this GPU runs at once, one per SM (the 128 x
  128 tile's ~150 registers a thread at 8 warps leave room for no second, benchmarks/NOTES.md
  "Launch resources"), and ``dw_split`` filling them with the parts of the tail's tiles
  (:func:`_dw_tail`): BERT-base's FFN, 144 tiles, runs 132 whole and its last 12 in up to 8
  parts each, instead of a second wave of 12 programs on 132 SMs. Unchanged off GPU."""
  sms = _sm_count()
  if not sms:
    return config
  tiles = pl.cdiv(in_features, config.dw_k) * pl.cdiv(out_features, config.dw_n)
  tail = _last_wave(tiles, sms)
  split = max(1, min(_MAX_DW_SPLIT, sms // tail)) if tail else 1
  return dataclasses.replace(config, dw_split=split, dw_slots=sms)


def _last_wave(tiles: int, slots: int) -> int:
  """Tiles of the last, partial wave when ``slots`` programs run at once: all of them where
  they are no more than ``slots`` (or ``slots`` is unknown, ``0``), none where they fill whole
  waves."""
  return tiles % slots if slots and tiles > slots else tiles


def with_dx_programs(config: BlockConfig, dtype) -> BlockConfig:
  """``config`` with ``dx_programs`` (unless it sets them) this GPU's SMs times the dX programs
  one SM holds: two where two tiles' pipelines (``dx_stages`` steps of a ``dy`` and a weight
  tile) fit in its shared memory, else one. Unchanged off GPU (one program per tile)."""
  sms = _sm_count()
  if config.dx_programs or not sms:
    return config
  pipeline = config.dx_stages * (config.dx_m + config.dx_k) * config.dx_n * jnp.dtype(
    dtype).itemsize
  per_sm = 2 if 2 * pipeline <= _SHARED_MEMORY else 1
  return dataclasses.replace(config, dx_programs=sms * per_sm)


def _round_up(value: int, multiple: int) -> int:
  return -(-value // multiple) * multiple


def _pad_to(array: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Zero-pad ``array`` at the end of each dim to ``shape`` (no copy when already that shape)."""
  if array.shape == shape:
    return array
  return jnp.pad(array, [(0, s - d) for s, d in zip(shape, array.shape)])


def _launch(body, out_shape, *, grid, warps: int, stages: int, interpret: bool, name: str,
            input_output_aliases: dict[int, int] | None = None):
  """``pl.pallas_call`` of ``body`` on whole refs (the kernels index them), Triton-compiled.

  ``input_output_aliases`` (operand index -> output index): that output is the operand's buffer,
  updated in place where the kernel writes it.

  Inside ``jax.shard_map(check_vma=True)`` every operand is the device's own and so are the
  outputs: they vary over every manual mesh axis some operand varies over. ``pallas_call``
  needs ``out_shape`` to say how they vary; it is declared invariant, which the Pallas
  interpreter requires (in jax 0.10 it carries the kernel's invariant values in a loop whose
  carry must keep its type), and the outputs are cast to varying afterwards. An aliased output
  has its operand's type already, and is cast only over the axes that it lacks.
  """

  def call(*operands):
    varying = frozenset().union(*(jax.typeof(a).mat.varying for a in operands))
    invariant = jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                     manual_axis_type=jax.sharding.ManualAxisType()), out_shape)
    outputs = pl.pallas_call(
      body, out_shape=invariant, grid=grid,
      compiler_params=pl_triton.CompilerParams(num_warps=warps, num_stages=stages),
      input_output_aliases=input_output_aliases or {}, interpret=interpret, name=name)(*operands)

    def to_varying(output):
      axes = tuple(sorted(varying - jax.typeof(output).mat.varying))
      return lax.pcast(output, axes, to="varying") if axes else output

    return jax.tree.map(to_varying, outputs)

  return call


def _grouped_tile(program, row_blocks: int, col_blocks: int, group: int):
  """``(row_block, col_block)`` of tile number ``program`` in grouped order: ``group`` row blocks
  at a time, all their column blocks before the next group's, so that the tiles in flight
  together read a few row blocks and a few column blocks instead of one of one and all of the
  other (the operand rows then come from L2 once they are loaded)."""
  per_group = group * col_blocks
  first_row = (program // per_group) * group
  group_rows = jnp.minimum(row_blocks - first_row, group)
  within = program % per_group
  return first_row + within % group_rows, within // group_rows


# Rows one partition program places (one scan of this many flags), and its warps.
_PARTITION_CHUNK = 1024
_PARTITION_WARPS = 4


def _partition_kernel(keep_ref, perm_ref, count_ref, *, chunk: int):
  """Places one chunk of rows in the active-first permutation: a stable partition by prefix sums.

  Every program sums the flags before its chunk (for its kept rows' first slot) and after it (for
  the total, where the dropped rows start) itself: a few KB of flags read from L2, cheaper than a
  second launch that would carry the offsets from one program to the next.
  """
  program = pl.program_id(0)
  steps = keep_ref.shape[0] // chunk

  def add_chunk(i, total):
    return total + jnp.sum(keep_ref[pl.ds(i * chunk, chunk)])

  kept_before = lax.fori_loop(0, program, add_chunk, jnp.int32(0))
  count = lax.fori_loop(program, steps, add_chunk, kept_before)
  flags = keep_ref[pl.ds(program * chunk, chunk)]
  kept = kept_before + jnp.cumsum(flags)  # kept rows in [0, row]
  row = program * chunk + jnp.arange(chunk, dtype=jnp.int32)
  # Kept row -> slot kept-1; dropped row -> after every kept row, in row order.
  perm_ref[jnp.where(flags > 0, kept - 1, count + row - kept)] = row
  # Every program stores the same total: no branch (a `pl.when` costs a conditional), no race
  # that matters.
  count_ref[...] = jnp.broadcast_to(count, (1,))


def partition_pallas(keep: jax.Array, *, interpret: bool = False):
  """``(perm, count)`` of :func:`sebp_jax.policy.active_first_permutation`, by one Pallas kernel.

  Args:
    keep: ``(M,)`` bool.

  Returns:
    ``perm``: ``(M',)`` int32 with ``M' >= M`` a whole number of chunks: the kept rows, then the
    dropped ones, then the padding rows ``M .. M'-1``, each in increasing order. ``count``:
    ``(1,)`` int32, the number of kept rows.
  """
  num_rows = keep.shape[0]
  chunk = min(_PARTITION_CHUNK, pl.next_power_of_2(num_rows))
  flags = _pad_to(keep.astype(jnp.int32), (_round_up(num_rows, chunk),))
  return _launch(functools.partial(_partition_kernel, chunk=chunk),
                 (jax.ShapeDtypeStruct(flags.shape, jnp.int32),
                  jax.ShapeDtypeStruct((1,), jnp.int32)),
                 grid=(flags.shape[0] // chunk,), warps=_PARTITION_WARPS, stages=1,
                 interpret=interpret, name="sebp_partition")(flags)


# Columns the gather kernel copies per step, its warps, and the programs per SM its grid holds.
_GATHER_COLS = 256
_GATHER_WARPS = 4
_GATHER_WAVE = 4


def _strided_trips(items, first, stride):
  """How many of the items ``first, first + stride, ...`` lie below ``items``: the trip count of a
  persistent program that takes every ``stride``-th item from ``first`` (none from past it)."""
  return pl.cdiv(jnp.maximum(items - first, 0), stride)


def _kept_rows(perm_ref, count, start, block_m: int, *, compact: bool):
  """Reader of the kept rows at compacted positions ``start .. start + block_m - 1``: ``ref ->
  load(ref, cols)``. Compacted operands hold them as contiguous rows (zero past ``count``); in
  place, they are rows ``perm[positions]`` of the original, masked past ``count``."""
  if compact:
    return lambda ref, cols: ref[pl.ds(start, block_m), cols]
  rows = perm_ref[pl.ds(start, block_m)]
  valid = (start + jnp.arange(block_m) < count)[:, None]

  def load(ref, cols):
    tile = ref[rows, cols]
    return jnp.where(valid, tile, jnp.zeros((), tile.dtype))

  return load


def _gather_kernel(count_ref, perm_ref, *refs, block_m: int, block_cols: tuple[int, ...],
                   chunks: tuple[int, ...], programs: int, summed: tuple[int, ...]):
  """Program ``(p, c)``: column chunk ``c`` of row blocks ``p, p + programs, ...`` that hold kept
  rows, each block's rows ``perm[block]`` copied to its contiguous rows of a copy. Chunks are
  numbered across the sources, first to last, so each program copies one chunk of one source;
  rows at or past ``count`` as zeros (the one block that straddles it), nothing in the blocks past
  it. For each source in ``summed``, the program also stores the float32 sum of the rows it
  copied, row ``p`` of that source's ``(programs, width)`` partial sums (zeros for no trips)."""
  num_sources = len(block_cols)
  sources, copies = refs[:num_sources], refs[num_sources:2 * num_sources]
  sums = dict(zip(summed, refs[2 * num_sources:2 * num_sources + len(summed)]))
  program = pl.program_id(0)
  chunk = pl.program_id(1)
  for counters in refs[2 * num_sources + len(summed):]:  # gather_pallas's `zeroed`
    @pl.when((program == 0) & (chunk == 0))
    def _(counters=counters):
      counters[...] = jnp.zeros(counters.shape, counters.dtype)
  count = count_ref[0]
  # Blocks program, program + programs, ... below the last block that holds a kept row.
  trips = _strided_trips(pl.cdiv(count, block_m), program, programs)
  first = 0
  for index, (source, copy, cols, own_chunks) in enumerate(
      zip(sources, copies, block_cols, chunks)):
    local = chunk - first
    mine = ((local >= 0) & (local < own_chunks)).astype(jnp.int32)
    span = pl.ds(local * cols, cols)

    def step(j, total, source=source, copy=copy, span=span, summing=index in sums):
      start = (program + j * programs) * block_m
      load = _kept_rows(perm_ref, count, start, block_m, compact=False)
      tile = load(source, span)
      copy[pl.ds(start, block_m), span] = tile
      return (total + jnp.sum(tile.astype(jnp.float32), axis=0)) if summing else total

    # No trips for another source's chunk: an integer product, not a select (see _dx_kernel).
    total = lax.fori_loop(0, mine * trips, step, jnp.zeros((cols,), jnp.float32))
    if index in sums:
      @pl.when(mine == 1)
      def _(total=total, out=sums[index], span=span):
        out[program, span] = total
    first += own_chunks


def _gather_programs(row_blocks: int, chunks: int) -> int:
  """Programs per column chunk of the gather: one per row block, or, on a GPU, as many as make
  ``_GATHER_WAVE`` programs per SM over all chunks if that is fewer."""
  sms = _sm_count()
  if not sms:
    return row_blocks
  return max(1, min(row_blocks, -(-_GATHER_WAVE * sms // chunks)))


def gather_pallas(sources, perm, count, *, block_m: int, interpret: bool = False,
                  programs: int | None = None, summed: Sequence[int] = (),
                  zeroed: Sequence[int] = ()):
  """Contiguous copies of the kept rows of each ``(M, width)`` array of ``sources``, the float32
  column sums of those rows for the sources indexed by ``summed``, and zeroed arrival counters
  for the split GEMMs that read the copies: ``(copies, sums, counters)``.

  Row ``i < count`` of a copy is row ``perm[i]`` of its source; rows ``count ..
  round_up(count, block_m) - 1`` are zero; the rows past those are never written (whatever the
  allocator left there: readers stop at that block). ``M`` must be a multiple of ``block_m``.
  ``sums[j]`` is the ``(width,)`` sum over kept rows of ``sources[summed[j]]``: where the dropped
  rows are zero (the exact policy, a row plan), its whole column sum, a bias gradient, read from
  the rows the copy reads anyway. ``counters[j]`` is :func:`_counters`' buffer of ``zeroed[j]``
  slots (``None`` for 0: a launch that splits nothing), zeroed by the launch's first program
  instead of a copy launch of their own before each split dX and dW launch (167 of a LLaMA-3B
  b1 step's, 0.15 ms of GPU time; benchmarks/NOTES.md "v36 measured").

  The grid is ``programs`` (default :func:`_gather_programs`) times column chunks of every
  source, each program looping over its row blocks up to ``count``'s. Column chunks: with few
  kept rows (LLaMA-3B at batch 1: ~80 of 4096, two row blocks) a grid over row blocks alone left
  two programs to copy 11,264 columns each, one chunk after another: 0.048 ms for a layer whose
  whole backward is 0.18 ms (results/v8_h100/tune_fewrows_h100.json). A loop over row blocks:
  one program per row block and chunk was thousands of programs for a few live ones (3,840 for
  BERT's FFN up), ~8 µs a launch for ~1 µs of bytes (benchmarks/NOTES.md, "v30"). Each summing
  program stores one partial row, which XLA adds up (a few dozen rows).
  """
  num_rows = sources[0].shape[0]
  summed = tuple(summed)
  # The widest power of two up to _GATHER_COLS that divides the width (widths are whole tiles).
  block_cols = tuple(math.gcd(_GATHER_COLS, s.shape[1]) for s in sources)
  for source, cols in zip(sources, block_cols):
    assert source.shape[0] == num_rows and source.shape[1] % cols == 0, (source.shape, cols)
  chunks = tuple(s.shape[1] // cols for s, cols in zip(sources, block_cols))
  if programs is None:
    programs = _gather_programs(num_rows // block_m, sum(chunks))
  body = functools.partial(_gather_kernel, block_m=block_m, block_cols=block_cols, chunks=chunks,
                           programs=programs, summed=summed)
  outputs = _launch(
    body, tuple(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in sources)
    + tuple(jax.ShapeDtypeStruct((programs, sources[i].shape[1]), jnp.float32) for i in summed)
    + tuple(_counters(slots) for slots in zeroed if slots),
    grid=(programs, sum(chunks)), warps=_GATHER_WARPS, stages=2, interpret=interpret,
    name="sebp_gather")(count, perm, *sources)
  copies, partials = outputs[:len(sources)], outputs[len(sources):len(sources) + len(summed)]
  counters = iter(outputs[len(sources) + len(summed):])
  return (list(copies), [jnp.sum(p, axis=0) for p in partials],
          [next(counters) if slots else None for slots in zeroed])


def _split_share(total, split, part):
  """``(first, steps)``: program ``part``'s share, the ``part``-th of ``split`` contiguous runs,
  of a loop of ``total`` steps; the last runs may be shorter or empty."""
  per_part = pl.cdiv(total, split)
  first = part * per_part
  return first, jnp.maximum(jnp.minimum(total - first, per_part), 0)


def _sum_parts(partials_ref, arrivals_ref, slot, part, parts, acc, store, *, barrier: bool):
  """A split tile's fix-up, in the launch that computes it: part ``part`` of ``parts`` stores its
  float32 partial ``acc`` to ``partials[part, slot]`` and counts its arrival on ``slot`` (an
  atomic on a counter zeroed before the launch); the last to arrive sums the parts in part order
  (so the result does not depend on which part that is) and hands the sum to ``store``. No
  second launch, as stream-K GEMMs fix up their split tiles. ``barrier``: order every thread's
  partial store before the (one-thread) arrival; off in the interpreter, which runs one program
  at a time and has no barrier."""
  partials_ref[part, slot] = acc
  if barrier:
    pl_triton.debug_barrier()
  arrived = pl_triton.atomic_add(arrivals_ref, (slot,), jnp.int32(1))

  @pl.when(arrived == parts - 1)
  def _():
    # Volatile: read where the other parts' stores are (L2), never a copy in this SM's L1.
    total = lax.fori_loop(
      0, parts, lambda p, total: total + pl_triton.load(partials_ref.at[p, slot], volatile=True),
      jnp.zeros(acc.shape, jnp.float32))
    store(total)


def _counters(slots: int) -> jax.ShapeDtypeStruct:
  """The arrival counters of ``slots`` split tiles (:func:`_sum_parts`): int32, a power of two
  long (a Triton tensor's length), so that :func:`gather_pallas` can zero them in one store."""
  return jax.ShapeDtypeStruct((pl.next_power_of_2(slots),), jnp.int32)


def _sum_parts_buffers(split: int, slots: int, tile: tuple[int, int], arrivals=None):
  """What a launch hands :func:`_sum_parts` for ``slots`` split tiles of ``tile`` shape and up to
  ``split`` parts each: the zeroed arrival counters (an input, aliased to the first of the two
  outputs: ``arrivals`` if given, zeroed by :func:`gather_pallas`, else zeros of XLA's), and the
  shapes of those two outputs: the counters and the float32 partial tiles."""
  counters = _counters(slots)
  if arrivals is None:
    arrivals = jnp.zeros(counters.shape, counters.dtype)
  elif (arrivals.shape, arrivals.dtype) != (counters.shape, counters.dtype):
    raise ValueError(f"`arrivals` must be {counters.dtype}{list(counters.shape)} for {slots} split "
                     f"tiles, got {arrivals.dtype}{list(arrivals.shape)}.")
  return arrivals, (counters, jax.ShapeDtypeStruct((split, slots, *tile), jnp.float32))


def _dx_parts(count, *, block_m: int, col_blocks: int, programs: int, split: int):
  """Programs that share each dX tile's loop over ``N`` for ``count`` kept rows: enough for the
  tiles that have kept rows to occupy the launch's ``programs``, between 1 and ``split``."""
  live_tiles = pl.cdiv(count, block_m) * col_blocks
  return jnp.minimum(jnp.maximum(programs // jnp.maximum(live_tiles, 1), 1), split)


def _dx_kernel(count_ref, perm_ref, dyc_ref, kernel_ref, *refs,
               block_m: int, block_k: int, block_n: int, group: int, precision,
               programs: int, split: int, barrier: bool = True, compact: bool = True,
               kernel_nk: bool = False, accumulate: bool = False, zero_rows: bool = True,
               siblings: int = 1, program=None):
  """One persistent program of the dX GEMM: it works through its share of the launch's
  *items* (the GEMM's ``program, program + programs, ...`` below their runtime number, then its
  zero items), then exits.

  The items are the GEMM's, then the zeros'. A GEMM item is one ``part`` of one live tile, a
  ``(block_m, block_k)`` tile of ``dx`` whose rows hold kept rows. With ``split == 1`` every such
  tile is one item over all of ``N``, stored to rows ``perm[block]`` of ``dx``. Otherwise each
  live tile's loop over ``N`` is shared by ``parts`` items (:func:`_dx_parts`); at ``parts > 1``
  the last of them to finish sums their float32 partial tiles and stores the tile
  (:func:`_sum_parts`; every part arrives, even with an empty share of ``N``, since the sum
  waits for all of them). GEMM items are numbered part-major, grouped tile order within, so
  the programs running together share operand rows in L2. A zero item is a tile past the live
  ones: it stores zeros to rows ``perm[block]``, reading nothing. They go to the programs that
  the GEMM leaves idle where those can store them all while a GEMM item runs, else to every
  program after its GEMM items; every row of ``dx`` is written exactly once.

  ``dyc``: the compacted ``dy``, or ``dy`` itself when not ``compact``. ``kernel``: ``(K, N)``,
  or ``(N, K)`` with ``kernel_nk``.

  ``refs``: ``dx``; with ``accumulate`` the accumulator first (below); with ``split > 1`` the
  arrival counters as passed in before the outputs, and after ``dx`` the counters (aliased) and
  the partial tiles ``(split, split tiles, block_m, block_k)``, one slot per tile of the rows
  where a split can happen. ``barrier``: as in :func:`_sum_parts`.

  With ``accumulate``, ``refs`` starts with the accumulator, an input whose buffer ``dx`` is
  (``input_output_aliases``): each live tile's product is added to the rows it holds there, and
  no zero item runs, so the dropped rows keep what they held. A sibling projection of the same
  input (q, k and v; gate and up) adds its ``dx`` to the first one's that way, instead of writing
  a whole ``dx`` of its own for XLA to sum.

  Without ``zero_rows`` no zero item runs: the rows past the live tiles are never written, and
  hold whatever the buffer held (see :func:`dx_pallas`).

  ``siblings``: products of one input whose ``dx`` add up (q, k and v; gate and up), in one
  loop: ``refs`` starts with the other ``siblings - 1`` pairs of ``dyc`` and ``kernel``, and each
  tile's loop over ``N`` runs through every sibling's ``N`` in turn (their steps numbered one
  after another, so a split shares them as one loop), instead of a launch per sibling, each
  after the first adding its kept rows into the first one's ``dx``.

  ``program``: this program's number among the launch's dX programs (default: its program id;
  :func:`_grads_kernel` passes it).
  """
  pairs = ((dyc_ref, kernel_ref),) + tuple(
    (refs[2 * i], refs[2 * i + 1]) for i in range(siblings - 1))
  refs = refs[2 * (siblings - 1) + accumulate + (split > 1):]  # past the inputs
  dx_ref, arrivals_ref, partials_ref = refs if split > 1 else (*refs, None, None)
  col_blocks = kernel_ref.shape[1 if kernel_nk else 0] // block_k
  own_steps = [dyc.shape[1] // block_n for dyc, _ in pairs]
  total = sum(own_steps)
  count = count_ref[0]
  live_blocks = pl.cdiv(count, block_m)
  live_tiles = live_blocks * col_blocks
  parts = 1
  if split > 1:
    parts = _dx_parts(count, block_m=block_m, col_blocks=col_blocks, programs=programs,
                      split=split)
  program = pl.program_id(0) if program is None else program
  gemm_items = live_tiles * parts
  zero_items = 0 if accumulate or not zero_rows else (
    (dx_ref.shape[0] // block_m - live_blocks) * col_blocks)
  trips = _strided_trips(gemm_items, program, programs)
  # The zero items go to the programs the GEMM leaves idle where those can store them all in
  # the time of one GEMM item (counted in bytes moved: a step loads a `dy` and a weight tile, a
  # zero tile is one store), so the GEMM's programs finish no later for them; else every
  # program's own run continues past the GEMM's items (a few spare programs would otherwise
  # store thousands of tiles each: LLaMA-3B's MLP down at 80 kept rows, 128 GEMM items for 132
  # programs, 3968 zero tiles, NOTES "v13"). Integer flags times values, not `jnp.where`:
  # Pallas-Triton in jax 0.11 types a select of literals as i1.
  step_bytes, zero_bytes = block_n * (block_m + block_k), block_m * block_k
  unit = math.gcd(step_bytes, zero_bytes)  # small integers: no int32 overflow below
  spare = jnp.maximum(programs - gemm_items, 0)
  has_spare = ((spare > 0) & (spare * pl.cdiv(total, parts) * (step_bytes // unit)
                              >= zero_items * (zero_bytes // unit))).astype(jnp.int32)
  zero_stride = has_spare * spare + (1 - has_spare) * programs
  first_zero = program + (1 - has_spare) * trips * programs - gemm_items
  zero_trips = _strided_trips(zero_items, first_zero, zero_stride) * (
    first_zero >= 0).astype(jnp.int32)

  def item(i, carry):
    index = program + i * programs
    # (No item at all when nothing is live: the guards only keep the divisions defined.)
    part, tile = index // jnp.maximum(live_tiles, 1), index % jnp.maximum(live_tiles, 1)
    row_block, col_block = _grouped_tile(tile, jnp.maximum(live_blocks, 1), col_blocks, group)
    start = row_block * block_m
    cols = pl.ds(col_block * block_k, block_k)
    load_dy = _kept_rows(perm_ref, count, start, block_m, compact=compact)

    def product(first_step, steps):
      def steps_of(dyc, kernel, first, trips, acc):
        def step(n, acc):
          span = pl.ds((first + n) * block_n, block_n)
          weights = kernel[span, cols] if kernel_nk else kernel[cols, span]
          return acc + lax.dot_general(load_dy(dyc, span), weights,
                                       DX_NK_DIMS if kernel_nk else DX_DIMS, precision=precision,
                                       preferred_element_type=jnp.float32)

        # A trip count, not a branch, so the loop stays a plain pipelined loop, and compacted
        # tiles go to the dot untouched (rows of the last block past `count` are zero in `dyc`).
        return lax.fori_loop(0, trips, step, acc)

      acc = jnp.zeros((block_m, block_k), jnp.float32)
      if siblings == 1:
        return steps_of(dyc_ref, kernel_ref, first_step, steps, acc)
      # Steps first_step .. first_step + steps - 1 of the siblings' steps numbered in turn: each
      # sibling's own that fall in that run (static where the run is: the unsplit loop).
      clip = ((lambda v, hi: min(max(v, 0), hi)) if isinstance(first_step + steps, int)
              else (lambda v, hi: jnp.clip(v, 0, hi)))
      for (dyc, kernel), offset, own in zip(pairs, itertools.accumulate([0] + own_steps),
                                            own_steps):
        first = clip(first_step - offset, own)
        acc = steps_of(dyc, kernel, first, clip(first_step + steps - offset, own) - first, acc)
      return acc

    def store_rows(total):
      rows = perm_ref[pl.ds(start, block_m)]
      if accumulate:
        total = total + dx_ref[rows, cols].astype(jnp.float32)
      dx_ref[rows, cols] = total.astype(dx_ref.dtype)

    if split == 1:
      store_rows(product(0, total))
      return carry
    # One part (every count past the split rows): the loop of an unsplit launch, whole `N` in a
    # trip count known at compile time, its own branch, so that compiling the split in costs
    # those tiles nothing (a shared loop of runtime length cost LLaMA-3B b4's up dX +11 % at
    # 24 % kept rows, benchmarks/NOTES.md "v34").
    pl.when(parts == 1)(lambda: store_rows(product(0, total)))

    @pl.when(parts > 1)
    def _():
      first_step, share = _split_share(total, parts, part)
      slot = row_block * col_blocks + col_block  # row_block is below the split rows
      _sum_parts(partials_ref, arrivals_ref, slot, part, parts, product(first_step, share),
                 store_rows, barrier=barrier)

    return carry

  def zero_item(i, carry):
    zero = first_zero + i * zero_stride
    start = (live_blocks + zero // col_blocks) * block_m
    cols = pl.ds(zero % col_blocks * block_k, block_k)
    dx_ref[perm_ref[pl.ds(start, block_m)], cols] = jnp.zeros((block_m, block_k), dx_ref.dtype)
    return carry

  lax.fori_loop(0, trips, item, jnp.int32(0))
  lax.fori_loop(0, zero_trips, zero_item, jnp.int32(0))


def _dw_kernel(count_ref, perm_ref, xc_ref, dyc_ref, *refs,
               block_m: int, block_k: int, block_n: int, group: int, programs: int,
               whole_tiles: int, split: int, min_part: int, precision, barrier: bool,
               compact: bool = True, program=None):
  """One program of the dW GEMM: ``(block_k, block_n)`` tiles of ``dw``, each summed over the
  kept rows only, tiles numbered in grouped order.

  The launch's first ``programs`` programs compute the first ``whole_tiles`` tiles whole (tiles
  ``program, program + programs, ...``: one each when ``programs`` is that count). The other
  tiles, the *tail* (fewer than the GPU runs at once: the part of the last wave that would
  leave most SMs idle), have ``split`` programs each, part-major after them: ``parts`` of them,
  chosen at run time from ``count`` (at least ``min_part`` row blocks each, at most ``split``),
  share the tile's rows, and the rest return at once. A lone part stores its tile; otherwise
  the last part to arrive sums the parts' float32 partial tiles and stores it
  (:func:`_sum_parts`).

  ``xc``, ``dyc``: the compacted ``x`` and ``dy``, or the originals when not ``compact``.
  ``refs``: ``dw``; with ``split > 1`` first the arrival counters as passed in, then ``dw``, the
  counters (aliased) and the partial tiles ``(split, tail tiles, block_k, block_n)``.
  ``barrier``: as in :func:`_sum_parts`. ``program``: this program's number among
  the launch's dW programs (default: its program id; :func:`_grads_kernel` passes it).
  """
  if split > 1:
    _, dw_ref, arrivals_ref, partials_ref = refs
  else:
    (dw_ref,) = refs
  k_blocks, n_blocks = xc_ref.shape[1] // block_k, dyc_ref.shape[1] // block_n
  tail_tiles = k_blocks * n_blocks - whole_tiles
  count = count_ref[0]
  blocks = pl.cdiv(count, block_m)  # runtime trip count: the cost follows the kept rows
  if program is None:
    program = pl.program_id(0)

  def product(tile, first, steps):
    """The tile's sum over row blocks ``first .. first + steps - 1``, and where it goes."""
    k_block, n_block = _grouped_tile(tile, k_blocks, n_blocks, group)
    k_span = pl.ds(k_block * block_k, block_k)
    n_span = pl.ds(n_block * block_n, block_n)

    def step(t, acc):
      load = _kept_rows(perm_ref, count, (first + t) * block_m, block_m, compact=compact)
      return acc + lax.dot_general(load(xc_ref, k_span), load(dyc_ref, n_span), DW_DIMS,
                                   precision=precision, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, steps, step, jnp.zeros((block_k, block_n), jnp.float32))
    return acc, (k_span, n_span)

  def whole_tile(i, carry):
    acc, span = product(program + i * programs, 0, blocks)
    dw_ref[span] = acc.astype(dw_ref.dtype)
    return carry

  def tail_part():
    index = program - programs
    tail, part = index % tail_tiles, index // tail_tiles
    parts = jnp.minimum(jnp.maximum(blocks // min_part, 1), split)

    @pl.when(part < parts)
    def _():
      first, steps = _split_share(blocks, parts, part)
      acc, span = product(whole_tiles + tail, first, steps)

      @pl.when(parts == 1)
      def _():
        dw_ref[span] = acc.astype(dw_ref.dtype)

      def store(total):
        dw_ref[span] = total.astype(dw_ref.dtype)

      pl.when(parts > 1)(lambda: _sum_parts(partials_ref, arrivals_ref, tail, part, parts, acc,
                                            store, barrier=barrier))

  def program_whole_tiles():
    if programs == whole_tiles:  # one tile per program: no loop around it at all
      whole_tile(0, None)
    else:
      lax.fori_loop(0, _strided_trips(whole_tiles, program, programs), whole_tile,
                    jnp.int32(0))

  if not tail_tiles:
    program_whole_tiles()
  elif not whole_tiles:
    tail_part()
  else:
    pl.when(program < programs)(program_whole_tiles)
    pl.when(program >= programs)(tail_part)


def _grads_kernel(count_ref, perm_ref, dy_ref, kernel_ref, x_ref, *refs, dx_programs: int,
                  dx_body, dw_body, dw_nk: bool, accumulate: bool, dw_tail: bool):
  """Both GEMMs in one launch: programs ``0 .. dx_programs - 1`` run ``dx_body`` (a
  :func:`_dx_kernel`), the programs after them ``dw_body`` (a :func:`_dw_kernel`), each reading
  the kept rows of ``dy`` and ``x`` as its body does (compacted or in place). ``refs``: the
  inputs after ``x`` (dX's accumulator with ``accumulate``, dW's arrival counters where it
  splits a tail: ``dw_tail``), then the outputs: ``dx``, ``dw`` and, with a tail, dW's counters and
  partial tiles. ``dw_nk``: dW in the ``(N, K)`` layout, its GEMM's operands swapped."""
  inputs, (dx_ref, *dw_refs) = refs[:accumulate + dw_tail], refs[accumulate + dw_tail:]
  dx_refs = (*inputs[:accumulate], dx_ref)
  dw_refs = (*inputs[accumulate:], *dw_refs)
  program = pl.program_id(0)

  @pl.when(program < dx_programs)
  def _():
    dx_body(count_ref, perm_ref, dy_ref, kernel_ref, *dx_refs, program=program)

  @pl.when(program >= dx_programs)
  def _():
    lhs, rhs = (dy_ref, x_ref) if dw_nk else (x_ref, dy_ref)
    dw_body(count_ref, perm_ref, lhs, rhs, *dw_refs, program=program - dx_programs)


def _dx_launch(num_rows: int, in_features: int, out_steps: int,
               config: BlockConfig) -> tuple[int, int, int]:
  """``(programs, split, split_rows)`` of :func:`dx_pallas` for ``num_rows`` compacted rows, ``K
  = in_features`` and an ``N`` loop of ``out_steps`` steps: the launch's programs (at most one
  per item it can have), the most parts of a tile's ``N`` loop (1: no split) and the rows below
  which a split can happen (where at most ``programs // 2`` tiles are live)."""
  if config.dx_split < 1:
    raise ValueError(f"`dx_split` must be >= 1, got {config.dx_split}")
  if config.dx_programs < 0:
    raise ValueError(f"`dx_programs` must be >= 0 (0: one per tile), got {config.dx_programs}")
  col_blocks = in_features // config.dx_k
  tiles = num_rows // config.dx_m * col_blocks
  split = min(config.dx_split, out_steps)  # more parts than steps would only add empty ones
  programs = min(config.dx_programs or tiles, tiles * split)
  split_rows = min(programs // 2 // col_blocks * config.dx_m, num_rows)
  if split <= 1 or not split_rows:
    return min(programs, tiles), 1, 0
  return programs, split, split_rows


def _dx_plan(dycs, kernels, config: BlockConfig, precision, kernel_nk: bool, accumulator,
             zero_rows: bool, interpret: bool):
  """``(programs, split, split_rows, body, dx_shape)`` of the dX GEMM (:func:`dx_pallas`) of the
  products of ``dycs`` and ``kernels`` (one of each per sibling)."""
  num_rows = dycs[0].shape[0]
  in_features = kernels[0].shape[1 if kernel_nk else 0]
  if len(dycs) != len(kernels) or any(
      dyc.shape[0] != num_rows or kernel.shape[1 if kernel_nk else 0] != in_features
      or kernel.dtype != kernels[0].dtype for dyc, kernel in zip(dycs, kernels)):
    raise ValueError("dx_pallas: one `kernel` per `dyc`, every `dyc` of the same rows and every "
                     "kernel of the same input features and dtype, got "
                     f"{[d.shape for d in dycs]} and {[(k.shape, k.dtype) for k in kernels]}.")
  out_steps = sum(dyc.shape[1] for dyc in dycs) // config.dx_n
  programs, split, split_rows = _dx_launch(num_rows, in_features, out_steps, config)
  body = functools.partial(_dx_kernel, block_m=config.dx_m, block_k=config.dx_k,
                           block_n=config.dx_n, group=config.dx_group, precision=precision,
                           programs=programs, split=split, barrier=not interpret,
                           compact=config.compact, kernel_nk=kernel_nk,
                           accumulate=accumulator is not None, zero_rows=zero_rows,
                           siblings=len(dycs))
  dx_shape = jax.ShapeDtypeStruct((num_rows, in_features), kernels[0].dtype)
  if accumulator is not None and (accumulator.shape, accumulator.dtype) != (dx_shape.shape,
                                                                           dx_shape.dtype):
    raise ValueError(f"dx_pallas: `accumulator` must be {dx_shape.dtype}{list(dx_shape.shape)}, "
                     f"got {accumulator.dtype}{list(accumulator.shape)}.")
  return programs, split, split_rows, body, dx_shape


def dx_pallas(dyc, kernel, perm, count, *, config: BlockConfig, precision=None,
              interpret: bool = False, kernel_nk: bool = False,
              accumulator: jax.Array | None = None, zero_rows: bool = True,
              arrivals: jax.Array | None = None) -> jax.Array:
  """``dx = (dy * keep) @ kernelᵀ`` from the compacted gradient ``dyc``; of sibling products
  of one input (sequences ``dyc`` and ``kernel``), the sum of theirs.

  One GEMM launch (``sebp_dx``), which also writes the zeros of the dropped rows (with
  ``zero_rows``) and, with ``config.dx_split > 1``, sums the split tiles' float32 partials
  (:func:`_sum_parts`: one zeroed arrival counter per tile of the split rows, aliased).
  Siblings' products add up inside each tile's loop, which runs through every sibling's ``N``
  in turn (:func:`_dx_kernel`'s ``siblings``).

  Args:
    dyc: ``(M, N)``, the kept rows of ``dy`` first (:func:`gather_pallas`), or ``dy`` itself
      when ``config.compact`` is off; ``M % dx_m == 0`` and ``N % dx_n == 0``. Or a sequence of
      such ``(M, N_i)``, one per sibling.
    kernel: ``(K, N)`` with ``K % dx_k == 0``; ``(N, K)`` with ``kernel_nk``. Or a sequence of
      such ``(K, N_i)``, one per ``dyc``.
    perm: ``(M' >= M,)`` int32 active-first permutation; ``count``: ``(1,)`` int32.
    accumulator: ``(M, K)`` in ``kernel.dtype`` or ``None``: the result is ``accumulator + dx``,
      written into the accumulator's buffer (donated), and no zero row is written.
    zero_rows: write the dropped rows' zeros. Without, the rows past the live tiles hold
      whatever the buffer held (NaN in the interpreter): for a caller that zeroes them itself,
      as a select XLA fuses into ``dx``'s consumers (:func:`_zero_dropped_rows`).
    arrivals: where the launch splits tiles (:func:`_dx_counter_slots` of them), their zeroed
      arrival counters (:func:`gather_pallas`' ``zeroed``), donated; ``None``: zeros of XLA's.

  Returns:
    ``(M, K)`` in ``kernel.dtype``.
  """
  dycs = tuple(dyc) if isinstance(dyc, (tuple, list)) else (dyc,)
  kernels = tuple(kernel) if isinstance(kernel, (tuple, list)) else (kernel,)
  programs, split, split_rows, body, dx_shape = _dx_plan(dycs, kernels, config, precision,
                                                         kernel_nk, accumulator, zero_rows,
                                                         interpret)
  operands = (count, perm, *(a for pair in zip(dycs, kernels) for a in pair)) + (
    () if accumulator is None else (accumulator,))
  aliases = {} if accumulator is None else {len(operands) - 1: 0}
  out_shape = dx_shape
  if arrivals is not None and split == 1:
    raise ValueError("dx_pallas: `arrivals` given to a launch that splits no tile.")
  if split > 1:
    split_tiles = _dx_counter_slots(dycs[0].shape[0], dx_shape.shape[1],
                                    sum(d.shape[1] for d in dycs), config)
    arrivals, split_shapes = _sum_parts_buffers(split, split_tiles, (config.dx_m, config.dx_k),
                                                arrivals)
    aliases[len(operands)] = 1
    operands += (arrivals,)
    out_shape = (dx_shape, *split_shapes)
  outputs = _launch(body, out_shape, grid=(programs,), warps=config.dx_warps,
                    stages=config.dx_stages, interpret=interpret, name="sebp_dx",
                    input_output_aliases=aliases or None)(*operands)
  return outputs if split == 1 else outputs[0]


def dw_pallas(xc, dyc, perm, count, *, config: BlockConfig, precision=None,
              interpret: bool = False, arrivals: jax.Array | None = None) -> jax.Array:
  """``dw = xᵀ @ (dy * keep)`` over the kept rows only, in one launch (``sebp_dw``).

  Args:
    xc: ``(M, K)``, the kept rows of ``x`` first (:func:`gather_pallas`), or ``x`` itself when
      ``config.compact`` is off; ``M % dw_m == 0`` and ``K % dw_k == 0``.
    dyc: ``(M, N)``, the kept rows of ``dy`` first, or ``dy``; ``N % dw_n == 0``.
    perm: ``(M' >= M,)`` int32 active-first permutation; ``count``: ``(1,)`` int32.
    arrivals: where the launch splits tiles (:func:`_dw_counter_slots` of them), their zeroed
      arrival counters (:func:`gather_pallas`' ``zeroed``), donated; ``None``: zeros of XLA's.

  Returns:
    ``(K, N)`` in ``xc.dtype``.
  """
  launch = _dw_plan(xc, dyc, config, precision, interpret, arrivals)
  outputs = _launch(launch.body, launch.out_shape, grid=(launch.programs,), warps=config.dw_warps,
                    stages=config.dw_stages, interpret=interpret, name="sebp_dw",
                    input_output_aliases={4: 1} if launch.arrivals is not None else None)(
    count, perm, xc, dyc, *launch.operands)
  return outputs[0]


@dataclasses.dataclass(frozen=True)
class _DwLaunch:
  """The dW GEMM's part of a launch (:func:`_dw_plan`): its ``programs``, its ``body`` (a
  :func:`_dw_kernel`), the shapes of its outputs (``dw``; with a split tail also the arrival
  counters and the partial tiles) and ``arrivals``, the zeroed counters it takes as an input
  (aliased to its second output) where it splits a tail, else ``None``."""

  programs: int
  body: object
  out_shape: tuple
  arrivals: jax.Array | None

  @property
  def operands(self) -> tuple:
    return () if self.arrivals is None else (self.arrivals,)


def _dw_tail(tiles: int, config: BlockConfig) -> int:
  """dW tiles that ``config`` splits over rows: none unsplit; past ``dw_slots`` (the programs
  that run at once) the last wave's tiles, which would leave most of the GPU idle; else all."""
  return 0 if config.dw_split == 1 else _last_wave(tiles, config.dw_slots)


def _dw_counter_slots(in_features: int, out_features: int, config: BlockConfig) -> int:
  """Split tiles (arrival counters) of :func:`dw_pallas` on ``(M, in_features)`` and ``(M,
  out_features)`` operands; 0: no split."""
  return _dw_tail((in_features // config.dw_k) * (out_features // config.dw_n), config)


def _dx_counter_slots(num_rows: int, in_features: int, out_features: int,
                      config: BlockConfig) -> int:
  """Split tiles (arrival counters) of :func:`dx_pallas` on a ``(num_rows, out_features)``
  ``dyc`` and ``K = in_features``; 0: no split."""
  _, split, split_rows = _dx_launch(num_rows, in_features, out_features // config.dx_n, config)
  return split_rows // config.dx_m * (in_features // config.dx_k) if split > 1 else 0


def _dw_plan(xc, dyc, config: BlockConfig, precision, interpret: bool,
             arrivals: jax.Array | None = None) -> _DwLaunch:
  """The dW GEMM's launch (:func:`dw_pallas`): ``dw_programs`` (or one per tile) over the
  whole tiles, then ``dw_split`` programs per tail tile (:func:`_dw_tail`), with ``arrivals``
  as :func:`dw_pallas` takes them."""
  in_features, out_features = xc.shape[1], dyc.shape[1]
  for name in ("dw_split", "dw_min_part"):
    if getattr(config, name) < 1:
      raise ValueError(f"`{name}` must be >= 1, got {getattr(config, name)}")
  if config.dw_programs < 0:
    raise ValueError(f"`dw_programs` must be >= 0 (0: one per tile), got {config.dw_programs}")
  tiles = (in_features // config.dw_k) * (out_features // config.dw_n)
  tail = _dw_counter_slots(in_features, out_features, config)
  whole = tiles - tail
  programs = min(config.dw_programs or whole, whole)
  split = config.dw_split if tail else 1
  body = functools.partial(_dw_kernel, block_m=config.dw_m, block_k=config.dw_k,
                           block_n=config.dw_n, group=config.dw_group, programs=programs,
                           whole_tiles=whole, split=split, min_part=config.dw_min_part,
                           precision=precision, barrier=not interpret, compact=config.compact)
  dw_shape = jax.ShapeDtypeStruct((in_features, out_features), xc.dtype)
  if not tail:
    if arrivals is not None:
      raise ValueError("dw_pallas: `arrivals` given to a launch that splits no tile.")
    return _DwLaunch(programs, body, (dw_shape,), None)
  arrivals, split_shapes = _sum_parts_buffers(split, tail, (config.dw_k, config.dw_n), arrivals)
  return _DwLaunch(programs + tail * split, body, (dw_shape, *split_shapes), arrivals)


def grads_pallas(xc, dyc, kernel, perm, count, *, config: BlockConfig, dw_config: BlockConfig,
                 precision=None, interpret: bool = False, kernel_nk: bool = False,
                 accumulator: jax.Array | None = None, zero_rows: bool = True,
                 dw_arrivals: jax.Array | None = None):
  """``(dx, dw)`` in one launch (``sebp_grads``): :func:`dx_pallas`'s programs, then
  :func:`dw_pallas`'s, reading ``xc`` and ``dyc`` as those do (``config.fused``). ``dw_config``:
  the dW GEMM's tiles (the sides of ``config``'s swapped with ``kernel_nk``, as
  :func:`_products` hands them); ``dw_arrivals``: :func:`dw_pallas`'s ``arrivals``; the other
  arguments as :func:`dx_pallas`'s."""
  if config.dx_split > 1:  # its arrival counters and partial tiles are dx_pallas's alone
    raise ValueError(f"grads_pallas: needs dx_split=1, got dx_split={config.dx_split}.")
  dx_programs, _, _, dx_body, dx_shape = _dx_plan((dyc,), (kernel,), config, precision,
                                                  kernel_nk, accumulator, zero_rows, interpret)
  lhs, rhs = (dyc, xc) if kernel_nk else (xc, dyc)
  dw = _dw_plan(lhs, rhs, dw_config, precision, interpret, dw_arrivals)
  accumulate = accumulator is not None
  body = functools.partial(_grads_kernel, dx_programs=dx_programs, dx_body=dx_body,
                           dw_body=dw.body, dw_nk=kernel_nk, accumulate=accumulate,
                           dw_tail=dw.arrivals is not None)
  operands = (count, perm, dyc, kernel, xc) + ((accumulator,) if accumulate else ()) + dw.operands
  aliases = {5: 0} if accumulate else {}
  if dw.arrivals is not None:
    aliases[5 + accumulate] = 2
  outputs = _launch(body, (dx_shape, *dw.out_shape), grid=(dx_programs + dw.programs,),
                    warps=max(config.dx_warps, config.dw_warps),
                    stages=max(config.dx_stages, config.dw_stages), interpret=interpret,
                    name="sebp_grads", input_output_aliases=aliases)(*operands)
  return outputs[0], outputs[1]


def _dw_siblings_kernel(count_ref, perm_ref, xc_ref, *refs, bodies: tuple,
                        programs: tuple[int, ...], tails: tuple[bool, ...]):
  """Sibling products' dW GEMMs in one launch: sibling ``i``'s programs (``programs[i]``, its
  :func:`_dw_plan`'s) follow the ones before it and run its ``bodies[i]`` (a :func:`_dw_kernel`)
  on ``xc`` and its own ``dyc``. ``refs``: the siblings' ``dyc``, their arrival counters (one
  input for each sibling that splits a tail: ``tails``), then each sibling's outputs in turn
  (``dw``; with a tail also its counters and partial tiles)."""
  dycs, refs = refs[:len(bodies)], refs[len(bodies):]
  arrivals, outputs = iter(refs[:sum(tails)]), iter(refs[sum(tails):])
  program = pl.program_id(0)
  first = 0
  for dyc, body, own, tail in zip(dycs, bodies, programs, tails):
    # _dw_kernel's refs: its counters in, then dw (and with a tail, its counters and partials).
    own_refs = ((next(arrivals),) if tail else ()) + tuple(
      next(outputs) for _ in range(1 + 2 * tail))

    @pl.when((program >= first) & (program < first + own))
    def _(dyc=dyc, body=body, own_refs=own_refs, first=first):
      body(count_ref, perm_ref, xc_ref, dyc, *own_refs, program=program - first)

    first += own


def dw_siblings_pallas(xc, dycs, perm, count, *, configs: Sequence[BlockConfig], precision=None,
                       interpret: bool = False,
                       arrivals: Sequence[jax.Array | None] | None = None) -> list[jax.Array]:
  """``dw_i = xᵀ @ (dy_i * keep)`` of sibling products of one input in one launch
  (``sebp_dw_siblings``): each sibling's :func:`dw_pallas` programs, one sibling's after the
  other's, so that the GPU runs them together. BERT-base's q, k and v dW are 72 tiles each
  (the ``small`` class), each launch alone holding 72 of 132 SMs; one launch holds 216 programs,
  which fit two or three a SM.

  Args:
    xc: ``(M, K)``, the kept rows of ``x`` first (:func:`gather_pallas`).
    dycs: ``(M, N_i)``, the kept rows of each ``dy`` first; each a whole number of its tiles.
    perm, count: as in :func:`dw_pallas`.
    configs: each sibling's tiles (its ``dw_*``); the launch runs the most warps and pipeline
      stages of any.
    arrivals: each sibling's :func:`dw_pallas` ``arrivals`` (``None``: zeros of XLA's).

  Returns:
    The ``(K, N_i)`` dW of each sibling, in ``xc.dtype``.
  """
  if arrivals is None:
    arrivals = [None] * len(dycs)
  if not len(dycs) == len(configs) == len(arrivals):
    raise ValueError(f"dw_siblings_pallas: {len(dycs)} `dycs`, {len(configs)} `configs` and "
                     f"{len(arrivals)} `arrivals`: one each per sibling.")
  launches = [_dw_plan(xc, dyc, config, precision, interpret, counters)
              for dyc, config, counters in zip(dycs, configs, arrivals)]
  tails = tuple(launch.arrivals is not None for launch in launches)
  body = functools.partial(_dw_siblings_kernel, bodies=tuple(launch.body for launch in launches),
                           programs=tuple(launch.programs for launch in launches), tails=tails)
  operands = (count, perm, xc, *dycs, *(a for launch in launches for a in launch.operands))
  # Each split tail's counters (an input after the dycs) are its launch's second output.
  aliases, output = {}, 0
  for launch in launches:
    if launch.arrivals is not None:
      aliases[3 + len(dycs) + len(aliases)] = output + 1
    output += len(launch.out_shape)
  outputs = _launch(body, tuple(shape for launch in launches for shape in launch.out_shape),
                    grid=(sum(launch.programs for launch in launches),),
                    warps=max(config.dw_warps for config in configs),
                    stages=max(config.dw_stages for config in configs), interpret=interpret,
                    name="sebp_dw_siblings", input_output_aliases=aliases or None)(*operands)
  firsts = itertools.accumulate((len(launch.out_shape) for launch in launches[:-1]), initial=0)
  return [outputs[first] for first in firsts]


def _in_features(x, kernel, kernel_nk: bool) -> int:
  return kernel.shape[1 if kernel_nk else 0] if kernel is not None else x.shape[1]


def _row_block(config: BlockConfig) -> int:
  """Rows of the gather kernel's blocks: a whole number of both GEMMs' row tiles."""
  return max(config.dx_m, config.dw_m)


def _k_pad(in_features: int, config: BlockConfig) -> int:
  return _round_up(in_features, max(config.dx_k, config.dw_k))


def _n_pad(out_features: int, config: BlockConfig) -> int:
  return _round_up(out_features, max(config.dx_n, config.dw_n))


def _dw_config(config: BlockConfig, kernel_nk: bool) -> BlockConfig:
  """dW's tiles in the kernel's layout: for an ``(N, K)`` kernel, the same GEMM with its operands
  swapped, its tile's two sides too (operands are padded by tile side, so they still fit)."""
  return dataclasses.replace(config, dw_k=config.dw_n, dw_n=config.dw_k) if kernel_nk else config


def _products_counter_slots(m_pad: int, k_pad: int, n_pad: int, *, config: BlockConfig,
                            has_dx: bool, has_dw: bool, kernel_nk: bool) -> tuple[int, int]:
  """``(dx, dw)``: the split tiles, so the arrival counters, of the dX and dW launches that
  :func:`_products` runs on operands padded to ``(m_pad, k_pad)`` and ``(m_pad, n_pad)``; 0
  where a launch splits none or does not run."""
  fused = config.fused and has_dx and has_dw  # one launch, whose dX splits nothing
  dw_sides = (n_pad, k_pad) if kernel_nk else (k_pad, n_pad)
  return (_dx_counter_slots(m_pad, k_pad, n_pad, config) if has_dx and not fused else 0,
          _dw_counter_slots(*dw_sides, _dw_config(config, kernel_nk)) if has_dw else 0)


def _products(xc, dyc, kernel, perm, count, *, num_rows: int, in_features: int,
              out_features: int, config: BlockConfig, precision, interpret: bool,
              kernel_nk: bool, dx_into, zero_rows: bool = True, counters=(None, None),
              with_dw: bool = True):
  """dX and dW of one layer from its (compacted or in-place) rows: ``xc`` (or ``None``) and
  ``dyc`` padded to whole tiles, ``(m_pad, k_pad)`` and ``(m_pad, n_pad)``: one launch each, or
  one for both (``config.fused``). ``zero_rows``: as in :func:`dx_pallas`. ``counters``: the
  dX and dW launches' zeroed arrival counters (:func:`_products_counter_slots` of each, from
  :func:`gather_pallas`), or ``None`` for zeros of XLA's. Without ``with_dw`` only dX runs
  (``dw`` is ``None``): a caller that runs dW elsewhere (:func:`dw_siblings_pallas`)."""
  _check_fused(config)
  m_pad, n_pad = dyc.shape
  k_pad = _k_pad(in_features, config) if xc is None else xc.shape[1]
  padded_kernel = None if kernel is None else _pad_to(
    kernel, (n_pad, k_pad) if kernel_nk else (k_pad, n_pad))
  accumulator = None if dx_into is None else _pad_to(dx_into, (m_pad, k_pad))
  dw_config = _dw_config(config, kernel_nk)
  dw_shape = (out_features, in_features) if kernel_nk else (in_features, out_features)
  dx_arrivals, dw_arrivals = counters
  dx = dw = None
  if not with_dw:
    xc = None
  if config.fused and kernel is not None and xc is not None:
    dx, dw = grads_pallas(xc, dyc, padded_kernel, perm, count, config=config,
                          dw_config=dw_config, precision=precision, interpret=interpret,
                          kernel_nk=kernel_nk, accumulator=accumulator, zero_rows=zero_rows,
                          dw_arrivals=dw_arrivals)
  else:
    if kernel is not None:
      dx = dx_pallas(dyc, padded_kernel, perm, count, config=config, precision=precision,
                     interpret=interpret, kernel_nk=kernel_nk, accumulator=accumulator,
                     zero_rows=zero_rows, arrivals=dx_arrivals)
    if xc is not None:
      lhs, rhs = (dyc, xc) if kernel_nk else (xc, dyc)
      dw = dw_pallas(lhs, rhs, perm, count, config=dw_config, precision=precision,
                     interpret=interpret, arrivals=dw_arrivals)
  return (None if dx is None else _cropped(dx, (num_rows, in_features)),
          None if dw is None else _cropped(dw, dw_shape))


def _cropped(padded, shape):
  """``padded`` (a result on operands padded to whole tiles) cut back to ``shape``."""
  return padded if padded.shape == shape else padded[:shape[0], :shape[1]]


def _check_fused(config: BlockConfig) -> None:
  if config.fused and config.dx_split > 1:
    raise ValueError("`fused` (dX and dW in one launch) splits no dX tile: it needs dx_split=1, "
                     f"got dx_split={config.dx_split}.")


def sparse_backward(x, kernel, dy, perm, count, *, config: BlockConfig, precision=None,
                    interpret: bool = False, kernel_nk: bool = False, dx_into=None,
                    keep: jax.Array | None = None):
  """Compact the kept rows (unless ``config.compact`` is off), then both products, on a ready
  partition ``(perm, count)``; operands padded to whole tiles where needed. ``kernel_nk`` and
  ``dx_into``: as in :func:`backward`. With ``keep`` (``(M,)`` bool, the partition's rows),
  the dX kernel leaves the dropped rows unwritten and :func:`_zero_dropped_rows` zeroes them;
  without it the kernel writes their zeros."""
  num_rows, out_features = dy.shape
  in_features = _in_features(x, kernel, kernel_nk)
  m_pad = _round_up(num_rows, _row_block(config))
  n_pad, k_pad = _n_pad(out_features, config), _k_pad(in_features, config)
  sources = [_pad_to(dy, (m_pad, n_pad))]
  if x is not None:
    sources.append(_pad_to(x, (m_pad, k_pad)))
  counters = (None, None)
  if config.compact:
    slots = _products_counter_slots(m_pad, k_pad, n_pad, config=config,
                                    has_dx=kernel is not None, has_dw=x is not None,
                                    kernel_nk=kernel_nk)
    sources, _, counters = gather_pallas(sources, perm, count, block_m=_row_block(config),
                                         interpret=interpret, zeroed=slots)
  dyc, *xc = sources
  masked = keep is not None and dx_into is None
  dx, dw = _products(xc[0] if xc else None, dyc, kernel, perm, count, num_rows=num_rows,
                     in_features=in_features, out_features=out_features, config=config,
                     precision=precision, interpret=interpret, kernel_nk=kernel_nk,
                     dx_into=dx_into, zero_rows=not masked, counters=counters)
  if masked and dx is not None:
    dx = _zero_dropped_rows(dx, keep)
  return dx, dw


def _zero_dropped_rows(dx, keep):
  """``dx`` ``(M, K)`` with every row outside ``keep`` zero, whatever it held: the dX kernel left
  those rows unwritten (``dx_pallas(zero_rows=False)``). A select on a row predicate, which XLA
  can fuse into the ops that read ``dx`` (a norm's or an activation's backward, a bias gradient's
  row sum) at the cost of one predicate per element, so no kernel stores the dropped rows' zeros;
  where XLA does not fuse it (one select in LLaMA's MLP), it runs as a pass of its own
  (``benchmarks/NOTES.md``, "v21", "v21 on an H200")."""
  return jnp.where(keep[:, None], dx, jnp.zeros((), dx.dtype))


def siblings_backward(x, kernels, dys, *, policy: RowPolicy, precision=None,
                      interpret: bool = False, crossover: float | None = None,
                      plan: RowPlan | None = None, column_sums: bool = False,
                      with_dw: Sequence[bool] | None = None):
  """SEBP backward of sibling products ``y_i = x @ kernels[i]`` of one input: ``(dx, dws, dbs)``,
  ``dx`` the sum of every sibling's.

  Where the siblings may share one set of kept rows, they do: a row plan's, or under the exact
  policy the union of each sibling's kept rows (a row that is zero in one sibling's ``dy`` adds
  nothing to its products, so the union is exact). Then one partition (none under a plan), one
  gather launch that copies the kept rows of ``x`` and of every ``dys[i]``, each sibling's
  products on those copies, its dX adding into the first sibling's in place (or, with
  ``_SIBLINGS_DX_ONE_LAUNCH`` and alike dX tiles, every sibling's dX in one launch), and at
  most one crossover conditional for the group. Otherwise (a threshold or Top-N policy, a layer
  whose tiles read rows in place) each sibling runs :func:`backward` on its own rows, adding
  its ``dx`` into the running sum (``dx_into``).

  Args:
    x: ``(M, K)`` input.
    kernels: ``(K, N_i)`` weights.
    dys: ``(M, N_i)`` output gradients, one per kernel.
    policy, precision, interpret, crossover, plan: as in :func:`backward`.
    column_sums: also return each ``dy``'s float32 column sum (the siblings' bias gradients,
      over every row whatever the policy keeps); ``dbs`` is ``None`` without. Where the group
      shares one gather, that launch sums the rows it copies, whose dropped rows are zero (the
      exact policy, a plan), so no reduction reads ``dy`` again: BERT's q/k/v bias sums were 36
      lone reductions of ``dy`` a step, ~0.38 ms on an H200 (``benchmarks/NOTES.md``, "Next
      lead ... bias gradients").
    with_dw: which siblings' ``dW`` to compute (default: every one's); the others' are
      ``None``. ``x`` may be ``None`` (no ``dW`` at all, and no copy of its rows) and
      ``kernels`` all ``None`` (no ``dx``: it is ``None``), as :func:`backward` takes them: the
      products that autodiff does not ask for (a frozen kernel, an input without gradient) do
      not run.
  """
  num_rows = dys[0].shape[0]
  has_dx = kernels[0] is not None
  with_dw = [x is not None and bool(wanted)
             for wanted in ([True] * len(dys) if with_dw is None else with_dw)]
  in_features = x.shape[1] if x is not None else kernels[0].shape[0]
  configs = [block_config(num_rows, in_features, dy.shape[1], dy.dtype) for dy in dys]
  if crossover is not None:
    configs = [dataclasses.replace(config, crossover=crossover) for config in configs]
  if not all(config.compact for config in configs) or (plan is None and not policy.is_exact):
    return accumulate_siblings(backward, x, kernels, dys, policy=policy, precision=precision,
                               interpret=interpret, crossover=crossover, plan=plan,
                               column_sums=column_sums, with_dw=with_dw)
  # Row blocks and column padding that fit every sibling's tiles (all powers of two).
  block_m = max(_row_block(config) for config in configs)
  m_pad = _round_up(num_rows, block_m)
  if plan is None:
    keep = functools.reduce(jnp.logical_or, [keep_mask(dy, policy) for dy in dys])
    perm, count = partition_pallas(_pad_to(keep, (m_pad,)), interpret=interpret)
  else:
    keep, perm, count = plan.keep, plan.perm, plan.count
    assert perm.shape[0] >= m_pad, (perm.shape, m_pad)  # RowPlan pads to whole row blocks
  k_pad = max(_k_pad(in_features, config) for config in configs)

  one_dw = _SIBLINGS_DW_ONE_LAUNCH and not any(config.fused for config in configs)
  one_dx = (_SIBLINGS_DX_ONE_LAUNCH and has_dx and not configs[0].fused and len(
    {tuple(getattr(config, field) for field in _DX_FIELDS) for config in configs}) == 1)
  dw_siblings = [i for i, wanted in enumerate(with_dw) if wanted]

  def sparse():
    n_pads = [_n_pad(dy.shape[1], config) for dy, config in zip(dys, configs)]
    # The arrival counters: the one dX launch's first, then each sibling's dX (unless the one
    # launch runs them) and dW launches'.
    dx_slots = [_dx_counter_slots(m_pad, k_pad, sum(n_pads), configs[0])] if one_dx else []
    slots = [_products_counter_slots(m_pad, k_pad, n_pad, config=config,
                                     has_dx=has_dx and not one_dx, has_dw=wanted,
                                     kernel_nk=False)
             for n_pad, config, wanted in zip(n_pads, configs, with_dw)]
    sources = ([_pad_to(x, (m_pad, k_pad))] if dw_siblings else []) + [
      _pad_to(dy, (m_pad, n_pad)) for dy, n_pad in zip(dys, n_pads)]
    first_dy = len(sources) - len(dys)  # x's copy first, where a dW reads it
    copies, sums, counters = gather_pallas(
      sources, perm, count, block_m=block_m, interpret=interpret,
      summed=range(first_dy, len(sources)) if column_sums else (),
      zeroed=dx_slots + [n for pair in slots for n in pair])
    xc, dycs = (copies[0] if dw_siblings else None), copies[first_dy:]
    dx, dws = None, [None] * len(dys)
    if one_dx:
      dx = _cropped(dx_pallas(dycs, [_pad_to(kernel, (k_pad, n_pad))
                                     for kernel, n_pad in zip(kernels, n_pads)],
                              perm, count, config=configs[0], precision=precision,
                              interpret=interpret, zero_rows=plan is None, arrivals=counters[0]),
                    (num_rows, in_features))
      counters = counters[1:]
    for i, (kernel, dy, dyc, config) in enumerate(zip(kernels, dys, dycs, configs)):
      run_dx, run_dw = has_dx and not one_dx, with_dw[i] and not one_dw
      if not (run_dx or run_dw):
        continue
      dx_i, dw = _products(xc if run_dw else None, dyc, kernel if run_dx else None, perm, count,
                           num_rows=num_rows, in_features=in_features,
                           out_features=dy.shape[1], config=config, precision=precision,
                           interpret=interpret, kernel_nk=False,
                           dx_into=dx if run_dx else None,
                           zero_rows=plan is None,  # a plan's select, as in `backward`
                           counters=counters[2 * i:2 * i + 2], with_dw=run_dw)
      dx = dx_i if run_dx else dx
      dws[i] = dw
    if one_dw and dw_siblings:
      for i, dw in zip(dw_siblings, dw_siblings_pallas(
          xc, [dycs[i] for i in dw_siblings], perm, count,
          configs=[configs[i] for i in dw_siblings], precision=precision, interpret=interpret,
          arrivals=[counters[2 * i + 1] for i in dw_siblings])):
        dws[i] = _cropped(dw, (in_features, dys[i].shape[1]))
    dbs = [total[:dy.shape[1]] for total, dy in zip(sums, dys)] if column_sums else None
    return (dx if dx is None or plan is None else _zero_dropped_rows(dx, keep)), dws, dbs

  def dense():
    parts = [dense_backward(x if wanted else None, kernel, dy, keep=keep, policy=policy,
                            precision=precision, planned=plan is not None)
             for kernel, dy, wanted in zip(kernels, dys, with_dw)]
    return (functools.reduce(jnp.add, [dx for dx, _ in parts]) if has_dx else None,
            [dw for _, dw in parts], full_column_sums(dys) if column_sums else None)

  threshold = min(config.crossover for config in configs)
  if threshold >= 1.0:  # no dense branch: no conditional at all
    return sparse()
  return lax.cond(count[0] > int(threshold * num_rows), dense, sparse)


def backward(x, kernel, dy, *, policy: RowPolicy, precision=None, interpret: bool = False,
             config: BlockConfig | None = None, crossover: float | None = None,
             plan: RowPlan | None = None, kernel_nk: bool = False, dx_into=None):
  """SEBP backward of ``y = x @ kernel`` through the Pallas kernels.

  Args:
    x: ``(M, K)`` input, or ``None`` when ``dW`` is not needed.
    kernel: ``(K, N)`` weight, or ``None`` when ``dX`` is not needed.
    dy: ``(M, N)`` output gradient.
    policy: which rows to keep.
    precision: ``lax.Precision`` of the products.
    interpret: run the kernels in the Pallas interpreter (any backend; how CI tests them).
    config: tile sizes; by default from the table for this GPU, dtype and shape.
    crossover: overrides ``config.crossover`` (see :func:`sebp_jax.sebp_matmul`).
    plan: the kept rows, decided once per step (:class:`sebp_jax.plan.RowPlan`): no score read
      and no partition here. ``policy`` must then be the exact one.
    kernel_nk: the weight is stored ``(N, K)`` (see :func:`sebp_jax.backends.xla.backward`):
      dX reads it in that layout and dW is written in it.
    dx_into: ``(M, K)`` or ``None``: ``dx`` comes back as ``dx_into + dx``, the sparse branch
      adding its kept rows into ``dx_into``'s buffer in place (:func:`dx_pallas`'s
      ``accumulator``), with no zero row written; needs ``kernel``.

  Returns:
    ``(dx, dw)`` as :func:`sebp_jax.backends.xla.backward` does.
  """
  if dx_into is not None and kernel is None:
    raise ValueError("backward: `dx_into` needs `kernel` (there is no dx to add to it).")
  num_rows, out_features = dy.shape
  if config is None:
    config = block_config(num_rows, _in_features(x, kernel, kernel_nk), out_features, dy.dtype)
  if crossover is not None:
    config = dataclasses.replace(config, crossover=crossover)
  m_pad = _round_up(num_rows, _row_block(config))
  if plan is None:
    keep = keep_mask(dy, policy)
    # Padding rows (of `dy` padded to whole tiles) come last in `perm`: dropped, never gathered
    # as kept; positions below the padded row count only ever name rows below it.
    perm, count = partition_pallas(_pad_to(keep, (m_pad,)), interpret=interpret)
  else:
    keep, perm, count = plan.keep, plan.perm, plan.count
    assert perm.shape[0] >= m_pad, (perm.shape, m_pad)  # RowPlan pads to whole row blocks
  # Only a plan's rows are zeroed by a select: scored per layer, the select of each layer's own
  # `keep` cost BERT 0.9 ms a step more than the kernel's zero rows (benchmarks/NOTES.md, "v21
  # on an H200").
  sparse = functools.partial(sparse_backward, config=config, precision=precision,
                             interpret=interpret, kernel_nk=kernel_nk, dx_into=dx_into,
                             keep=None if plan is None else keep)

  def dense():
    dx, dw = dense_backward(x, kernel, dy, keep=keep, policy=policy, precision=precision,
                            planned=plan is not None, kernel_nk=kernel_nk)
    return (dx if dx_into is None else dx_into + dx), dw

  if config.crossover >= 1.0:  # no dense branch: no conditional (and no host round trip) at all
    return sparse(x, kernel, dy, perm, count)
  # Past the crossover the compact products save less than the gather costs.
  use_dense = count[0] > int(config.crossover * num_rows)
  return lax.cond(use_dense, dense, lambda: sparse(x, kernel, dy, perm, count))
