"""SEBP backward as Pallas kernels lowered through Triton (GPU), or run by the Pallas interpreter.

The plan (DESIGN §5, v5: compact first):

* **selection** (XLA, memory-bound): the keep mask (:mod:`sebp_jax.policy`), or a
  :class:`~sebp_jax.plan.RowPlan` handed in once per step;
* **partition kernel**: the active-first permutation ``perm`` of all rows and the runtime
  ``count``, one program per chunk of rows (each sums the flags before its chunk itself, so no
  second launch carries offsets between programs);
* **gather kernel**: copies the kept rows of ``x`` and ``dy`` into contiguous buffers ``xc`` and
  ``dyc`` (row ``i`` of ``dyc`` is row ``perm[i]`` of ``dy``). Programs past ``count`` copy
  nothing; the one that straddles ``count`` writes zeros past it, so the GEMMs below never mask;
* **dX kernel**: a GEMM over the compacted prefix. Each ``(dx_m, dx_k)`` tile multiplies
  contiguous rows of ``dyc`` by ``kernelᵀ`` and stores to rows ``perm[tile]`` of ``dx``; a tile
  past ``count`` stores zeros there, without reading anything. Every row of ``dx`` is written
  exactly once. With ``dx_split`` (opt-in), the first kept rows' tiles share their loop over
  ``N`` among several programs, whose float32 partial tiles XLA sums and scatters;
* **dW kernel**: a GEMM over the contiguous prefix of ``xc`` and ``dyc``, with the runtime trip
  count ``cdiv(count, dw_m)``; where the output tiles are fewer than the GPU's SMs, ``dw_split``
  programs share a tile's rows and XLA sums their float32 partial tiles;
* **crossover**: above a measured fraction of kept rows ``lax.cond`` runs the dense backward.

Both GEMMs walk their tiles in grouped order (``dx_group`` / ``dw_group`` row blocks at a time,
every column block of a group before the next group), so the tiles that run at once share their
operand rows in L2 instead of each streaming them from memory.

Every Pallas detail of the project lives in this file.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from sebp_jax.backends.xla import DW_DIMS, DX_DIMS, dense_backward
from sebp_jax.plan import RowPlan
from sebp_jax.policy import RowPolicy, keep_mask

__all__ = ["BlockConfig", "block_config", "with_dw_split", "backward", "partition_pallas", "gather_pallas",
           "dx_pallas", "dw_pallas"]


@dataclasses.dataclass(frozen=True)
class BlockConfig:
  """Tile sizes and launch parameters of the kernels.

  ``dx_*``: the dX kernel's tile is ``dx_m`` rows x ``dx_k`` columns, looping over ``N`` in steps
  of ``dx_n``. ``dw_*``: the dW kernel's tile is ``dw_k x dw_n``, looping over kept rows in steps
  of ``dw_m``; ``dw_split`` programs share each tile's rows (split-K over rows), their float32
  partial tiles summed afterwards. ``dx_group`` / ``dw_group``: row (``K``) blocks per group of
  the grouped tile order. ``dx_split > 1``: the dX tiles of the first ``dx_split_rows`` kept rows
  are computed by ``dx_split`` programs each, sharing the loop over ``N`` (their float32 partial
  tiles summed by XLA and scattered to the rows): with few kept rows only a few row blocks have
  work, and each would otherwise stream its whole ``N`` alone. ``crossover``: the kept-row
  fraction above which the dense backward runs instead.
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
  dx_split: int = 1
  dx_split_rows: int = 128
  crossover: float = 0.4


# Measured tile choices, keyed by (GPU generation, dtype width in bytes, shape class). Tuned with
# benchmarks/tune_blocks.py on an H100 (results/tune_h100_v5.json; benchmarks/NOTES.md, "v5").
# "wide": weights of at least _WIDE_WEIGHT entries (LLaMA-3B's 3072 x 8192 MLP), where 128 x 256
# tiles in both GEMMs run 1.25x (23 % kept rows) to 1.44x (all rows) faster than the default;
# BERT-base's 768 x 3072 layers are faster on the default's smaller tiles below ~20 % kept rows.
_BLOCK_TABLE: dict[tuple[str, int, str], BlockConfig] = {
  ("hopper", 2, "narrow"): BlockConfig(),
  ("hopper", 2, "wide"): BlockConfig(dx_m=128, dx_k=256, dx_n=64, dx_warps=8,
                                     dw_k=128, dw_n=256, dw_m=64, dw_warps=8),
  ("hopper", 4, "narrow"): BlockConfig(dx_n=32, dw_m=32, dw_k=64, dw_n=128, dw_warps=4),
  ("hopper", 4, "wide"): BlockConfig(dx_n=32, dw_m=32, dw_k=64, dw_n=128, dw_warps=4),
}
_WIDE_WEIGHT = 3072 * 3072
_DEFAULT_CONFIG = BlockConfig()
# Triton's dot needs every operand dim to be at least 16.
_MIN_BLOCK = 16
# The most programs :func:`block_config` lets share one dW tile. Each adds a float32 partial tile
# to write and sum; past 4 that pass costs more than the idle SMs it fills.
_MAX_DW_SPLIT = 4


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

  A dW grid of fewer tiles than the GPU has SMs (BERT-base's 768 x 768 projections: 36 tiles on
  132 SMs) splits each tile's rows over up to :data:`_MAX_DW_SPLIT` programs.
  """
  shape_class = "wide" if in_features * out_features >= _WIDE_WEIGHT else "narrow"
  base = _BLOCK_TABLE.get((_gpu_generation(), jnp.dtype(dtype).itemsize, shape_class),
                          _DEFAULT_CONFIG)
  config = dataclasses.replace(
    base,
    dx_m=_fit(base.dx_m, num_rows), dx_k=_fit(base.dx_k, in_features),
    dx_n=_fit(base.dx_n, out_features),
    dw_m=_fit(base.dw_m, num_rows), dw_k=_fit(base.dw_k, in_features),
    dw_n=_fit(base.dw_n, out_features),
  )
  return with_dw_split(config, in_features, out_features)


def with_dw_split(config: BlockConfig, in_features: int, out_features: int) -> BlockConfig:
  """``config`` with ``dw_split`` filling this GPU's SMs with dW programs (unchanged off GPU)."""
  sms = _sm_count()
  if not sms:
    return config
  tiles = pl.cdiv(in_features, config.dw_k) * pl.cdiv(out_features, config.dw_n)
  return dataclasses.replace(config, dw_split=max(1, min(_MAX_DW_SPLIT, sms // tiles)))


def _round_up(value: int, multiple: int) -> int:
  return -(-value // multiple) * multiple


def _pad_to(array: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Zero-pad ``array`` at the end of each dim to ``shape`` (no copy when already that shape)."""
  if array.shape == shape:
    return array
  return jnp.pad(array, [(0, s - d) for s, d in zip(shape, array.shape)])


def _launch(body, out_shape, *, grid, warps: int, stages: int, interpret: bool, name: str):
  """``pl.pallas_call`` of ``body`` on whole refs (the kernels index them), Triton-compiled."""
  return pl.pallas_call(
    body, out_shape=out_shape, grid=grid,
    compiler_params=pl_triton.CompilerParams(num_warps=warps, num_stages=stages),
    interpret=interpret, name=name)


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


# Columns the gather kernel copies per step, and its warps.
_GATHER_COLS = 256
_GATHER_WARPS = 4


def _gather_kernel(count_ref, perm_ref, *refs, block_m: int, block_cols: tuple[int, ...]):
  """Rows ``perm[block]`` of each source copied to the block's contiguous rows of its copy; rows
  at or past ``count`` as zeros (the one block that straddles it), nothing past that block."""
  sources, copies = refs[:len(refs) // 2], refs[len(refs) // 2:]
  start = pl.program_id(0) * block_m
  count = count_ref[0]
  rows = perm_ref[pl.ds(start, block_m)]
  valid = (start + jnp.arange(block_m) < count)[:, None]
  live = (start < count).astype(jnp.int32)  # arithmetic: see _dx_kernel
  for source, copy, cols in zip(sources, copies, block_cols):
    def step(c, carry, source=source, copy=copy, cols=cols):
      span = pl.ds(c * cols, cols)
      tile = source[rows, span]
      copy[pl.ds(start, block_m), span] = jnp.where(valid, tile, jnp.zeros((), tile.dtype))
      return carry

    lax.fori_loop(0, live * (source.shape[1] // cols), step, jnp.int32(0))


def gather_pallas(sources, perm, count, *, block_m: int, interpret: bool = False):
  """Contiguous copies of the kept rows of each ``(M, width)`` array of ``sources``.

  Row ``i < count`` of a copy is row ``perm[i]`` of its source; rows ``count ..
  round_up(count, block_m) - 1`` are zero; the rows past those are never written (whatever the
  allocator left there: readers stop at that block). ``M`` must be a multiple of ``block_m``.
  """
  num_rows = sources[0].shape[0]
  # The widest power of two up to _GATHER_COLS that divides the width (widths are whole tiles).
  block_cols = tuple(math.gcd(_GATHER_COLS, s.shape[1]) for s in sources)
  for source, cols in zip(sources, block_cols):
    assert source.shape[0] == num_rows and source.shape[1] % cols == 0, (source.shape, cols)
  body = functools.partial(_gather_kernel, block_m=block_m, block_cols=block_cols)
  return _launch(body, tuple(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in sources),
                 grid=(num_rows // block_m,), warps=_GATHER_WARPS, stages=2,
                 interpret=interpret, name="sebp_gather")(count, perm, *sources)


def _split_share(total, split: int, part):
  """``(first, steps)``: program ``part``'s share, the ``part``-th of ``split`` contiguous runs,
  of a loop of ``total`` steps; the last runs may be shorter or empty."""
  per_part = pl.cdiv(total, split)
  first = part * per_part
  return first, jnp.maximum(jnp.minimum(total - first, per_part), 0)


def _dx_kernel(count_ref, perm_ref, dyc_ref, kernel_ref, dx_ref, *,
               block_m: int, block_k: int, block_n: int, group: int, precision,
               first_block: int = 0, split: int = 1):
  """One ``(block_m, block_k)`` tile of ``dx`` at rows ``perm[block]``, ``block`` counted from
  ``first_block``. With ``split > 1``, this program's share of the loop over ``N`` instead: a
  float32 partial tile at ``dx[part, block]``, in ``perm`` order."""
  col_blocks = kernel_ref.shape[0] // block_k
  row_blocks = dx_ref.shape[-2] // block_m - (first_block if split == 1 else 0)
  row_block, col_block = _grouped_tile(pl.program_id(0), row_blocks, col_blocks, group)
  start = (first_block + row_block) * block_m
  count = count_ref[0]
  cols = pl.ds(col_block * block_k, block_k)
  total = dyc_ref.shape[1] // block_n
  first_step, share = (0, total) if split == 1 else _split_share(total, split, pl.program_id(1))

  def step(n, acc):
    span = pl.ds((first_step + n) * block_n, block_n)
    return acc + lax.dot_general(dyc_ref[pl.ds(start, block_m), span], kernel_ref[cols, span],
                                 DX_DIMS, precision=precision,
                                 preferred_element_type=jnp.float32)

  # A block past `count` runs no step and stores zeros. A trip count, not a branch, so the loop
  # stays a plain pipelined loop, and loaded tiles go to the dot untouched (rows of the last
  # block past `count` are zero in `dyc`).
  # (Arithmetic, not jnp.where: Pallas-Triton in jax 0.11 types a select of literals as i1.)
  steps = (start < count).astype(jnp.int32) * share
  acc = lax.fori_loop(0, steps, step, jnp.zeros((block_m, block_k), jnp.float32))
  if split == 1:
    dx_ref[perm_ref[pl.ds(start, block_m)], cols] = acc.astype(dx_ref.dtype)
  else:
    dx_ref[pl.program_id(1), pl.ds(start, block_m), cols] = acc


def _dw_kernel(count_ref, xc_ref, dyc_ref, dw_ref, *,
               block_m: int, block_k: int, block_n: int, group: int, split: int, precision):
  """One ``(block_k, block_n)`` tile of ``dw``, summed over the compacted kept rows only (over
  this program's share of them when ``split > 1``: a partial tile at ``dw[part]``)."""
  k_blocks, n_blocks = xc_ref.shape[1] // block_k, dyc_ref.shape[1] // block_n
  k_block, n_block = _grouped_tile(pl.program_id(0), k_blocks, n_blocks, group)
  k_span = pl.ds(k_block * block_k, block_k)
  n_span = pl.ds(n_block * block_n, block_n)

  def step(t, acc):
    rows = pl.ds(t * block_m, block_m)
    return acc + lax.dot_general(xc_ref[rows, k_span], dyc_ref[rows, n_span], DW_DIMS,
                                 precision=precision, preferred_element_type=jnp.float32)

  # Runtime trip count: the cost follows the kept rows, not the padded length. Program `part`
  # takes the `part`-th of `split` contiguous runs of row blocks.
  first, steps = _split_share(pl.cdiv(count_ref[0], block_m), split, pl.program_id(1))
  acc = lax.fori_loop(0, steps, lambda t, acc: step(first + t, acc),
                      jnp.zeros((block_k, block_n), jnp.float32))
  if split == 1:
    dw_ref[k_span, n_span] = acc.astype(dw_ref.dtype)
  else:
    dw_ref[pl.program_id(1), k_span, n_span] = acc


def _dx_split_rows(num_rows: int, config: BlockConfig) -> int:
  """Leading ``perm`` positions whose dX tiles split their ``N`` loop (0: none)."""
  if config.dx_split <= 1:
    return 0
  return min(config.dx_split_rows, num_rows) // config.dx_m * config.dx_m


def dx_pallas(dyc, kernel, perm, count, *, config: BlockConfig, precision=None,
              interpret: bool = False) -> jax.Array:
  """``dx = (dy * keep) @ kernelᵀ`` from the compacted gradient ``dyc``.

  Args:
    dyc: ``(M, N)``, the kept rows of ``dy`` first (:func:`gather_pallas`), ``M % dx_m == 0``
      and ``N % dx_n == 0``.
    kernel: ``(K, N)`` with ``K % dx_k == 0``.
    perm: ``(M' >= M,)`` int32 active-first permutation; ``count``: ``(1,)`` int32.

  Returns:
    ``(M, K)`` in ``kernel.dtype``.
  """
  num_rows, _ = dyc.shape
  in_features = kernel.shape[0]
  tile = dict(block_m=config.dx_m, block_k=config.dx_k, block_n=config.dx_n,
              group=config.dx_group, precision=precision)
  launch = functools.partial(_launch, warps=config.dx_warps, stages=config.dx_stages,
                             interpret=interpret)
  col_blocks = in_features // config.dx_k
  split_rows = _dx_split_rows(num_rows, config)
  out_shape = jax.ShapeDtypeStruct((num_rows, in_features), kernel.dtype)
  if split_rows == num_rows:  # every row's tile is split: the scatter below writes them all
    dx = jnp.zeros(out_shape.shape, out_shape.dtype)
  else:
    body = functools.partial(_dx_kernel, **tile, first_block=split_rows // config.dx_m)
    dx = launch(body, out_shape, grid=((num_rows - split_rows) // config.dx_m * col_blocks,),
                name="sebp_dx")(count, perm, dyc, kernel)
  if not split_rows:
    return dx
  partials = launch(
    functools.partial(_dx_kernel, **tile, split=config.dx_split),
    jax.ShapeDtypeStruct((config.dx_split, split_rows, in_features), jnp.float32),
    grid=(split_rows // config.dx_m * col_blocks, config.dx_split),
    name="sebp_dx_split")(count, perm, dyc, kernel)
  # The rows at perm[:split_rows] are exactly those the kernel above left unwritten.
  return dx.at[perm[:split_rows]].set(partials.sum(axis=0).astype(dx.dtype),
                                      unique_indices=True)


def dw_pallas(xc, dyc, count, *, config: BlockConfig, precision=None,
              interpret: bool = False) -> jax.Array:
  """``dw = xᵀ @ (dy * keep)`` over the compacted kept rows only.

  Args:
    xc: ``(M, K)``, the kept rows of ``x`` first (:func:`gather_pallas`), ``M % dw_m == 0`` and
      ``K % dw_k == 0``.
    dyc: ``(M, N)``, the kept rows of ``dy`` first, ``N % dw_n == 0``.
    count: ``(1,)`` int32.

  Returns:
    ``(K, N)`` in ``xc.dtype``.
  """
  in_features, out_features = xc.shape[1], dyc.shape[1]
  split = config.dw_split
  body = functools.partial(_dw_kernel, block_m=config.dw_m, block_k=config.dw_k,
                           block_n=config.dw_n, group=config.dw_group, split=split,
                           precision=precision)
  out_shape = ((in_features, out_features), xc.dtype) if split == 1 else (
    (split, in_features, out_features), jnp.float32)
  tiles = (in_features // config.dw_k) * (out_features // config.dw_n)
  dw = _launch(body, jax.ShapeDtypeStruct(*out_shape), grid=(tiles, split),
               warps=config.dw_warps, stages=config.dw_stages, interpret=interpret,
               name="sebp_dw")(count, xc, dyc)
  return dw if split == 1 else dw.sum(axis=0).astype(xc.dtype)


def _in_features(x, kernel) -> int:
  return kernel.shape[0] if kernel is not None else x.shape[1]


def _row_block(config: BlockConfig) -> int:
  """Rows of the gather kernel's blocks: a whole number of both GEMMs' row tiles."""
  return max(config.dx_m, config.dw_m)


def _sparse_backward(x, kernel, dy, perm, count, *, config, precision, interpret):
  """Compact the kept rows, then both products; operands padded to whole tiles where needed."""
  num_rows, out_features = dy.shape
  in_features = _in_features(x, kernel)
  m_pad = _round_up(num_rows, _row_block(config))
  k_pad = _round_up(in_features, max(config.dx_k, config.dw_k))
  n_pad = _round_up(out_features, max(config.dx_n, config.dw_n))
  sources = [_pad_to(dy, (m_pad, n_pad))]
  if x is not None:
    sources.append(_pad_to(x, (m_pad, k_pad)))
  dyc, *xc = gather_pallas(sources, perm, count, block_m=_row_block(config),
                           interpret=interpret)
  dx = dw = None
  if kernel is not None:
    dx = dx_pallas(dyc, _pad_to(kernel, (k_pad, n_pad)), perm, count, config=config,
                   precision=precision, interpret=interpret)
    dx = dx[:num_rows, :in_features] if dx.shape != (num_rows, in_features) else dx
  if x is not None:
    dw = dw_pallas(xc[0], dyc, count, config=config, precision=precision, interpret=interpret)
    dw = dw[:in_features, :out_features] if dw.shape != (in_features, out_features) else dw
  return dx, dw


def backward(x, kernel, dy, *, policy: RowPolicy, precision=None, interpret: bool = False,
             config: BlockConfig | None = None, crossover: float | None = None,
             plan: RowPlan | None = None):
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

  Returns:
    ``(dx, dw)`` as :func:`sebp_jax.backends.xla.backward` does.
  """
  num_rows, out_features = dy.shape
  if config is None:
    config = block_config(num_rows, _in_features(x, kernel), out_features, dy.dtype)
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
  sparse = functools.partial(_sparse_backward, config=config, precision=precision,
                             interpret=interpret)
  dense = functools.partial(dense_backward, keep=keep, policy=policy, precision=precision,
                            planned=plan is not None)
  if config.crossover >= 1.0:  # no dense branch: no conditional (and no host round trip) at all
    return sparse(x, kernel, dy, perm, count)
  # Past the crossover the compact products save less than the gather costs.
  use_dense = count[0] > int(config.crossover * num_rows)
  return lax.cond(use_dense,
                  lambda: dense(x, kernel, dy),
                  lambda: sparse(x, kernel, dy, perm, count))
