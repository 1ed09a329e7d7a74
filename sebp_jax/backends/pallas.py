"""SEBP backward as Pallas kernels lowered through Triton (GPU), or run by the Pallas interpreter.

The plan (DESIGN §5):

* **selection** (XLA, memory-bound): keep mask, runtime ``count`` and the active-first permutation
  ``perm`` of all rows (:mod:`sebp_jax.policy`);
* **dX kernel**: grid over (row blocks of ``perm``, column blocks of ``K``). A block before
  ``count`` gathers ``dy[perm[rows]]``, multiplies by ``kernelᵀ`` and scatters the tile into
  ``dx[perm[rows]]``; a block past ``count`` only stores zeros. Every row of ``dx`` is written
  exactly once: no memset, no atomics, no compacted copy. With ``dx_split`` (opt-in: faster up
  to ``dx_split_rows`` kept rows, slower past them; benchmarks/NOTES.md, "v6 outcome"), the first
  kept rows' tiles share their loop over ``N`` among several programs, whose float32 partial
  tiles XLA sums and scatters to those rows;
* **dW kernel**: grid over output tiles; each program loops over the kept rows only, with the
  runtime trip count ``cdiv(count, block_m)``, gathering ``x`` and ``dy`` rows through ``perm``.
  Where the tiles are fewer than the GPU's SMs, ``dw_split`` programs share a tile's rows and XLA
  sums their float32 partial tiles;
* **crossover**: above a measured fraction of kept rows ``lax.cond`` runs the dense backward.

Every Pallas detail of the project lives in this file.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from sebp_jax.backends.xla import DW_DIMS, DX_DIMS, dense_backward
from sebp_jax.policy import RowPolicy, keep_mask

__all__ = ["BlockConfig", "block_config", "backward", "dx_pallas", "dw_pallas"]


@dataclasses.dataclass(frozen=True)
class BlockConfig:
  """Tile sizes and launch parameters of the two kernels.

  ``dx_*``: the dX kernel's tile is ``dx_m`` rows x ``dx_k`` columns, looping over ``N`` in steps
  of ``dx_n``. ``dw_*``: the dW kernel's tile is ``dw_k x dw_n``, looping over kept rows in steps
  of ``dw_m``; ``dw_split`` programs share each tile's rows (split-K over rows), their float32
  partial tiles summed afterwards. ``dx_split > 1``: the dX tiles of the first ``dx_split_rows``
  kept rows are computed by ``dx_split`` programs each, sharing the loop over ``N`` (their float32
  partial tiles summed by XLA and scattered to the rows): with few kept rows only a few row
  blocks have work, and each would otherwise stream its whole ``N`` alone. ``crossover``: the
  kept-row fraction above which the dense backward runs instead.
  """

  dx_m: int = 64
  dx_k: int = 128
  dx_n: int = 64
  dx_warps: int = 4
  dx_stages: int = 3
  dw_m: int = 64
  dw_k: int = 128
  dw_n: int = 128
  dw_warps: int = 8
  dw_stages: int = 3
  dw_split: int = 1
  dx_split: int = 1
  dx_split_rows: int = 128
  crossover: float = 0.4


# Measured tile choices, keyed by (GPU generation, dtype width in bytes). Tuned with
# benchmarks/tune_blocks.py; see benchmarks/NOTES.md for the measurements behind them.
_BLOCK_TABLE: dict[tuple[str, int], BlockConfig] = {
  ("hopper", 2): BlockConfig(),
  ("hopper", 4): BlockConfig(dx_n=32, dw_m=32, dw_k=64, dw_n=128, dw_warps=4),
}
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
  """Tile sizes for an ``(M, K) x (K, N)`` layer: the table's entry, shrunk to small shapes.

  A dW grid of fewer tiles than the GPU has SMs (BERT-base's 768 x 768 projections: 36 tiles on
  132 SMs) splits each tile's rows over up to :data:`_MAX_DW_SPLIT` programs.
  """
  base = _BLOCK_TABLE.get((_gpu_generation(), jnp.dtype(dtype).itemsize), _DEFAULT_CONFIG)
  config = dataclasses.replace(
    base,
    dx_m=_fit(base.dx_m, num_rows), dx_k=_fit(base.dx_k, in_features),
    dx_n=_fit(base.dx_n, out_features),
    dw_m=_fit(base.dw_m, num_rows), dw_k=_fit(base.dw_k, in_features),
    dw_n=_fit(base.dw_n, out_features),
  )
  sms = _sm_count()
  if sms:
    tiles = pl.cdiv(in_features, config.dw_k) * pl.cdiv(out_features, config.dw_n)
    config = dataclasses.replace(config, dw_split=max(1, min(_MAX_DW_SPLIT, sms // tiles)))
  return config


def _round_up(value: int, multiple: int) -> int:
  return -(-value // multiple) * multiple


def _pad_to(array: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Zero-pad ``array`` at the end of each dim to ``shape`` (no copy when already that shape)."""
  if array.shape == shape:
    return array
  return jnp.pad(array, [(0, s - d) for s, d in zip(shape, array.shape)])


def _launch(body, out_shape, *, grid, warps: int, stages: int, interpret: bool, name: str):
  """``pl.pallas_call`` of ``body`` on whole refs (the kernels index them), Triton-compiled.

  Inside ``jax.shard_map(check_vma=True)`` every operand is the device's own and so are the
  outputs: they vary over every manual mesh axis some operand varies over. ``pallas_call``
  needs ``out_shape`` to say how they vary; it is declared invariant, which the Pallas
  interpreter requires (in jax 0.10 it carries the kernel's invariant values in a loop whose
  carry must keep its type), and the outputs are cast to varying afterwards.
  """

  def call(*operands):
    varying = tuple(sorted(frozenset().union(*(jax.typeof(a).mat.varying for a in operands))))
    invariant = jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                     manual_axis_type=jax.sharding.ManualAxisType()), out_shape)
    outputs = pl.pallas_call(
      body, out_shape=invariant, grid=grid,
      compiler_params=pl_triton.CompilerParams(num_warps=warps, num_stages=stages),
      interpret=interpret, name=name)(*operands)
    if not varying:
      return outputs
    return jax.tree.map(lambda o: lax.pcast(o, varying, to="varying"), outputs)

  return call


# Rows the partition kernel handles per step (one scan of this many flags at a time), and its warps.
# On an H200 at 16K rows one 16K-row scan takes 12 µs, sixteen 1K-row scans 22 µs
# (benchmarks/NOTES.md, v4); warps 4 to 16 make no difference.
_PARTITION_CHUNK = 16384
_PARTITION_WARPS = 4


def _partition_kernel(keep_ref, perm_ref, count_ref, *, chunk: int):
  """Active-first permutation of all rows, in one program: a stable partition by prefix sums.

  XLA spends ~30 µs of small kernels on the same cumsum-and-scatter (H200, 16K rows); here it
  is two passes over the flags in one launch.
  """
  steps = keep_ref.shape[0] // chunk

  def add_chunk(i, total):
    return total + jnp.sum(keep_ref[pl.ds(i * chunk, chunk)])

  count = lax.fori_loop(0, steps, add_chunk, jnp.int32(0))

  def place_chunk(i, kept_before):
    flags = keep_ref[pl.ds(i * chunk, chunk)]
    kept = kept_before + jnp.cumsum(flags)  # kept rows in [0, row]
    row = i * chunk + jnp.arange(chunk, dtype=jnp.int32)
    # Kept row -> slot kept-1; dropped row -> after every kept row, in row order.
    perm_ref[jnp.where(flags > 0, kept - 1, count + row - kept)] = row
    return kept_before + jnp.sum(flags)

  lax.fori_loop(0, steps, place_chunk, jnp.int32(0))
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
                 grid=(1,), warps=_PARTITION_WARPS, stages=1, interpret=interpret,
                 name="sebp_partition")(flags)


def _split_share(total, split: int, part):
  """``(first, steps)``: program ``part``'s share, the ``part``-th of ``split`` contiguous runs,
  of a loop of ``total`` steps; the last runs may be shorter or empty."""
  per_part = pl.cdiv(total, split)
  first = part * per_part
  return first, jnp.maximum(jnp.minimum(total - first, per_part), 0)


def _dx_kernel(count_ref, perm_ref, dy_ref, kernel_ref, dx_ref, *,
               block_m: int, block_k: int, block_n: int, mask_rows: bool, precision,
               first_block: int = 0, split: int = 1):
  """One ``(block_m, block_k)`` tile of ``dx`` at rows ``perm[block]``, ``block`` counted from
  ``first_block``. With ``split > 1``, this program's share of the loop over ``N`` instead: a
  float32 partial tile at ``dx[part, block]``, in ``perm`` order."""
  row_block, col_block = first_block + pl.program_id(0), pl.program_id(1)
  count = count_ref[0]
  start = row_block * block_m
  rows = perm_ref[pl.ds(start, block_m)]
  cols = pl.ds(col_block * block_k, block_k)
  total = dy_ref.shape[1] // block_n
  first_step, share = (0, total) if split == 1 else _split_share(total, split, pl.program_id(2))

  def step(n, acc):
    span = pl.ds((first_step + n) * block_n, block_n)
    return acc + lax.dot_general(dy_ref[rows, span], kernel_ref[cols, span], DX_DIMS,
                                 precision=precision, preferred_element_type=jnp.float32)

  # A block past `count` runs no step and stores zeros. A trip count, not a branch, so the loop
  # stays a plain pipelined loop, and loaded tiles go to the dot untouched.
  # (Arithmetic, not jnp.where: Pallas-Triton in jax 0.11 types a select of literals as i1.)
  steps = (start < count).astype(jnp.int32) * share
  acc = lax.fori_loop(0, steps, step, jnp.zeros((block_m, block_k), jnp.float32))
  if mask_rows:
    # Row i of dx depends on row i of dy only, and dropped rows are finite (non-finite rows are
    # always kept): zeroing the dropped rows' results equals zeroing their gradient first.
    acc = jnp.where((start + jnp.arange(block_m) < count)[:, None], acc, 0.0)
  if split == 1:
    dx_ref[rows, cols] = acc.astype(dx_ref.dtype)
  else:
    dx_ref[pl.program_id(2), pl.ds(start, block_m), cols] = acc


def _dw_kernel(count_ref, perm_ref, x_ref, dy_ref, dw_ref, *,
               block_m: int, block_k: int, block_n: int, split: int, mask_rows: bool,
               precision):
  """One ``(block_k, block_n)`` tile of ``dw``, summed over the kept rows only (over this
  program's share of them when ``split > 1``: a partial tile at ``dw[split_index]``)."""
  k_block, n_block, part = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  count = count_ref[0]
  k_span = pl.ds(k_block * block_k, block_k)
  n_span = pl.ds(n_block * block_n, block_n)

  def step(t, acc):
    start = t * block_m
    rows = perm_ref[pl.ds(start, block_m)]
    dy = dy_ref[rows, n_span]
    if mask_rows:  # the last block's rows past `count` are dropped rows
      dy = jnp.where((start + jnp.arange(block_m) < count)[:, None], dy, 0)
    return acc + lax.dot_general(x_ref[rows, k_span], dy, DW_DIMS, precision=precision,
                                 preferred_element_type=jnp.float32)

  # Runtime trip count: the cost follows the kept rows, not the padded length. Program `part`
  # takes the `part`-th of `split` contiguous runs of row blocks.
  first, steps = _split_share(pl.cdiv(count, block_m), split, part)
  acc = lax.fori_loop(0, steps, lambda t, acc: step(first + t, acc),
                      jnp.zeros((block_k, block_n), jnp.float32))
  if split == 1:
    dw_ref[k_span, n_span] = acc.astype(dw_ref.dtype)
  else:
    dw_ref[part, k_span, n_span] = acc


def _dx_split_rows(num_rows: int, config: BlockConfig) -> int:
  """Leading ``perm`` positions whose dX tiles split their ``N`` loop (0: none)."""
  if config.dx_split <= 1:
    return 0
  return min(config.dx_split_rows, num_rows) // config.dx_m * config.dx_m


def dx_pallas(dy, kernel, perm, count, *, config: BlockConfig, mask_rows: bool = True,
              precision=None, interpret: bool = False) -> jax.Array:
  """``dx = (dy * keep) @ kernelᵀ`` on padded operands.

  Args:
    dy: ``(M, N)`` with ``M % dx_m == 0`` and ``N % dx_n == 0``.
    kernel: ``(K, N)`` with ``K % dx_k == 0``.
    perm: ``(M' >= M,)`` int32 active-first permutation; ``count``: ``(1,)`` int32.
    mask_rows: zero the rows past ``count``; ``False`` when they are zero already (exact policy).

  Returns:
    ``(M, K)`` in ``kernel.dtype``.
  """
  num_rows, _ = dy.shape
  in_features = kernel.shape[0]
  tile = dict(block_m=config.dx_m, block_k=config.dx_k, block_n=config.dx_n,
              mask_rows=mask_rows, precision=precision)
  launch = functools.partial(_launch, warps=config.dx_warps, stages=config.dx_stages,
                             interpret=interpret)
  col_blocks = in_features // config.dx_k
  split_rows = _dx_split_rows(num_rows, config)
  out_shape = jax.ShapeDtypeStruct((num_rows, in_features), kernel.dtype)
  if split_rows == num_rows:  # every row's tile is split: the scatter below writes them all
    dx = jnp.zeros(out_shape.shape, out_shape.dtype)
  else:
    body = functools.partial(_dx_kernel, **tile, first_block=split_rows // config.dx_m)
    dx = launch(body, out_shape, grid=((num_rows - split_rows) // config.dx_m, col_blocks),
                name="sebp_dx")(count, perm, dy, kernel)
  if not split_rows:
    return dx
  partials = launch(
    functools.partial(_dx_kernel, **tile, split=config.dx_split),
    jax.ShapeDtypeStruct((config.dx_split, split_rows, in_features), jnp.float32),
    grid=(split_rows // config.dx_m, col_blocks, config.dx_split),
    name="sebp_dx_split")(count, perm, dy, kernel)
  # The rows at perm[:split_rows] are exactly those the kernel above left unwritten.
  return dx.at[perm[:split_rows]].set(partials.sum(axis=0).astype(dx.dtype),
                                      unique_indices=True)


def dw_pallas(x, dy, perm, count, *, config: BlockConfig, mask_rows: bool = True,
              precision=None, interpret: bool = False) -> jax.Array:
  """``dw = xᵀ @ (dy * keep)`` over the kept rows only, on padded operands.

  Args:
    x: ``(M, K)`` with ``M % dw_m == 0`` and ``K % dw_k == 0``.
    dy: ``(M, N)`` with ``N % dw_n == 0``.
    perm: ``(M' >= M,)`` int32 active-first permutation; ``count``: ``(1,)`` int32.
    mask_rows: zero the rows past ``count``; ``False`` when they are zero already (exact policy).

  Returns:
    ``(K, N)`` in ``x.dtype``.
  """
  in_features, out_features = x.shape[1], dy.shape[1]
  split = config.dw_split
  body = functools.partial(_dw_kernel, block_m=config.dw_m, block_k=config.dw_k,
                           block_n=config.dw_n, split=split, mask_rows=mask_rows,
                           precision=precision)
  out_shape = ((in_features, out_features), x.dtype) if split == 1 else (
    (split, in_features, out_features), jnp.float32)
  dw = _launch(body, jax.ShapeDtypeStruct(*out_shape),
               grid=(in_features // config.dw_k, out_features // config.dw_n, split),
               warps=config.dw_warps, stages=config.dw_stages, interpret=interpret,
               name="sebp_dw")(count, perm, x, dy)
  return dw if split == 1 else dw.sum(axis=0).astype(x.dtype)


def _in_features(x, kernel) -> int:
  return kernel.shape[0] if kernel is not None else x.shape[1]


def _padded_rows(num_rows: int, config: BlockConfig) -> int:
  """Rows of ``dy`` (and ``x``) padded to whole row tiles of both kernels."""
  return _round_up(num_rows, max(config.dx_m, config.dw_m))


def _sparse_backward(x, kernel, dy, perm, count, *, config, mask_rows, precision, interpret):
  """Both products through the kernels; operands padded to whole tiles where they are not."""
  num_rows, out_features = dy.shape
  in_features = _in_features(x, kernel)
  m_pad = _padded_rows(num_rows, config)
  k_pad = _round_up(in_features, max(config.dx_k, config.dw_k))
  n_pad = _round_up(out_features, max(config.dx_n, config.dw_n))
  dy = _pad_to(dy, (m_pad, n_pad))
  dx = dw = None
  if kernel is not None:
    dx = dx_pallas(dy, _pad_to(kernel, (k_pad, n_pad)), perm, count, config=config,
                   mask_rows=mask_rows, precision=precision, interpret=interpret)
    dx = dx[:num_rows, :in_features] if dx.shape != (num_rows, in_features) else dx
  if x is not None:
    dw = dw_pallas(_pad_to(x, (m_pad, k_pad)), dy, perm, count, config=config,
                   mask_rows=mask_rows, precision=precision, interpret=interpret)
    dw = dw[:in_features, :out_features] if dw.shape != (in_features, out_features) else dw
  return dx, dw


def backward(x, kernel, dy, *, policy: RowPolicy, precision=None, interpret: bool = False,
             config: BlockConfig | None = None, crossover: float | None = None):
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

  Returns:
    ``(dx, dw)`` as :func:`sebp_jax.backends.xla.backward` does.
  """
  num_rows, out_features = dy.shape
  if config is None:
    config = block_config(num_rows, _in_features(x, kernel), out_features, dy.dtype)
  if crossover is not None:
    config = dataclasses.replace(config, crossover=crossover)
  keep = keep_mask(dy, policy)
  # Padding rows (of `dy` padded to whole tiles) come last in `perm`: dropped, never gathered as
  # kept; positions below the padded row count only ever name rows below it.
  perm, count = partition_pallas(_pad_to(keep, (_padded_rows(num_rows, config),)),
                                 interpret=interpret)
  # Under the exact policy every dropped row is zero already: no masking in the kernels.
  sparse = functools.partial(_sparse_backward, config=config, mask_rows=not policy.is_exact,
                             precision=precision, interpret=interpret)
  dense = functools.partial(dense_backward, keep=keep, policy=policy, precision=precision)
  if config.crossover >= 1.0:  # no dense branch: no conditional (and no host round trip) at all
    return sparse(x, kernel, dy, perm, count)
  # Past the crossover the compact products save less than the gather costs.
  use_dense = count[0] > int(config.crossover * num_rows)
  return lax.cond(use_dense,
                  lambda: dense(x, kernel, dy),
                  lambda: sparse(x, kernel, dy, perm, count))
