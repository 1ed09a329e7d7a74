"""The Pallas kernels against the contract's reference, at their block edges.

The contract tests (test_matmul.py) run every impl, "interpret" and "pallas" included, on random
shapes; here the block structure itself is under test: small explicit tiles so that the kept-row
count falls just below, on and just above a block boundary, partial tiles in every dim, count 0
and count M, the crossover to the dense branch, and the partition kernel on its own. "interpret"
runs the kernels in the Pallas interpreter on CPU; "pallas" runs them on a GPU.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import tune_blocks
from parity_tests.jaxprs import count_primitive
from parity_tests.reference import keep_mask as reference_keep_mask
from parity_tests.reference import sebp_reference
from parity_tests.tolerances import assert_close
from sebp_jax import RowPolicy, row_plan, sebp_matmul
from sebp_jax.backends import pallas as pallas_backend
from sebp_jax.matmul import SEBPDotGeneral

# Tiles of 16 rows (Triton's smallest dot) make block boundaries cheap to reach.
SMALL_TILES = pallas_backend.BlockConfig(
  dx_m=16, dx_k=16, dx_n=16, dx_warps=4, dx_stages=2,
  dw_m=16, dw_k=16, dw_n=32, dw_warps=4, dw_stages=2, crossover=1.0)

KERNEL_IMPLS = [
  pytest.param(True, id="interpret"),
  pytest.param(False, id="pallas", marks=pytest.mark.gpu),
]


def _case(rng, num_rows, in_features, out_features, kept, dtype, *, quiet=0.0):
  """Random ``x, kernel, dy`` with exactly the rows ``kept`` active (others zero or ``quiet``)."""
  x = rng.standard_normal((num_rows, in_features)).astype(np.float32)
  kernel = rng.standard_normal((in_features, out_features)).astype(np.float32)
  dy = rng.standard_normal((num_rows, out_features)).astype(np.float32)
  active = np.zeros(num_rows, bool)
  active[kept] = True
  dy = np.where(active[:, None], dy, quiet * np.sign(dy)).astype(np.float32)
  cast = lambda a: jnp.asarray(a, dtype)
  return cast(x), cast(kernel), cast(dy)


def _backward(x, kernel, dy, policy, *, interpret, config, kernel_nk=False, plan=None):
  """``(dx, dw)`` of the Pallas backward, jitted, in IEEE float32 (as the reference)."""
  return jax.jit(lambda x, k, dy: pallas_backend.backward(
    x, k, dy, policy=policy, precision=jax.lax.Precision.HIGHEST, interpret=interpret,
    config=config, kernel_nk=kernel_nk, plan=plan))(x, kernel, dy)


def _check(x, kernel, dy, policy, *, interpret, config=SMALL_TILES, kernel_nk=False,
           plan=None):
  """The backward against the reference; ``kernel_nk``: handed the kernel stored ``(N, K)``, its
  ``dw`` must come back in that layout; ``plan``: a row plan of ``dy``'s non-zero rows."""
  dx, dw = _backward(x, kernel.T if kernel_nk else kernel, dy, policy, interpret=interpret,
                     config=config, kernel_nk=kernel_nk, plan=plan)
  want_dx, want_dw = sebp_reference(x, kernel, None, dy, policy.threshold, policy.max_rows)
  if kernel_nk:
    want_dw = want_dw.T
  assert dx.dtype == x.dtype and dw.dtype == kernel.dtype
  assert_close(dx, want_dx, x.dtype, what="dx")
  assert_close(dw, want_dw, x.dtype, what="dw")


# dw_split=3: the 1..5 row blocks of each of dW's 6 tiles (3 x 2) are shared unevenly by up to
# three programs (one per row block: dw_min_part=1), some with none, the last to finish summing
# their partial tiles; with dw_slots=4, only the 2 tiles past the first 4 are split and 2
# persistent programs loop over those 4 (2 tiles each); with it, 4 persistent dX
# programs loop over up to 15 tiles (5 row blocks of 16 x 3 column blocks of 16 once K is
# padded to 48), up to 4 each. The dX splits (N = 60 padded to 64: 4 steps
# of 16, the last with real columns, so that a missing last part shows):
# * 4 parts at most, to occupy 24 programs: counts up to 32 run 4 parts of one step each, up to
#   64 run 2, past that 1 (the split region is the first 64 rows);
# * 3 parts at most, to occupy 12 programs: counts up to 16 run 3 parts (2, 2 and 0 steps: an
#   empty share), up to 32 run 2, past that 1, each of the 12 programs then looping over tiles.
# compact=False: no gather, the GEMMs read the kept rows in place and mask the positions past
# count (with every dW tile split in two, one part per 2 row blocks). fused: both GEMMs in one
# launch, 4 persistent dX programs first, then dW's (4 whole tiles on 3 persistent programs, 2
# tiles split in two), on the rows read in place and on the compacted ones.
DX_SPLIT = dict(dx_split=4, dx_programs=24)
DW_SPLIT = dict(dw_split=3, dw_slots=4, dw_min_part=1, dx_programs=4, dw_programs=2)
FUSED = dict(fused=True, dx_programs=4, dw_split=2, dw_slots=4, dw_min_part=1, dw_programs=3)
SPLITS = [dict(dw_split=1), DW_SPLIT, DX_SPLIT,
          dict(dx_split=3, dx_programs=12, dw_split=3, dw_min_part=1),
          dict(compact=False, dw_split=2, dw_min_part=2),
          dict(compact=False, **DX_SPLIT), dict(compact=False, **FUSED), FUSED]


def _split_id(split: dict) -> str:
  return "-".join(map(str, split.values()))


@pytest.mark.parametrize("interpret", KERNEL_IMPLS)
@pytest.mark.parametrize("split", SPLITS, ids=_split_id)
@pytest.mark.parametrize("count", [0, 1, 15, 16, 17, 32, 33, 75])
def test_count_around_block_boundaries(interpret, split, count):
  rng = np.random.default_rng(count)
  num_rows = 75  # not a multiple of 16: the last row tile is partial
  kept = np.sort(rng.choice(num_rows, count, replace=False))
  config = pallas_backend.BlockConfig(**{**SMALL_TILES.__dict__, **split})
  _check(*_case(rng, num_rows, 37, 60, kept, jnp.float32), RowPolicy(), interpret=interpret,
         config=config)


@pytest.mark.parametrize("interpret", KERNEL_IMPLS)
@pytest.mark.parametrize("split", SPLITS, ids=_split_id)
@pytest.mark.parametrize("count", [0, 17, 75])
@pytest.mark.parametrize("planned,kernel_nk", [(False, True), (True, False), (True, True)],
                         ids=["nk", "planned-kn", "planned-nk"])
def test_kernel_layouts_and_row_plans(interpret, split, count, planned, kernel_nk):
  # nk: a tied output embedding's layout: dX reads the (N, K) kernel as stored, dW is written in
  # it (its GEMM with the operands and the tile's sides swapped: dw_k 16 over N, dw_n 32 over K).
  # planned: under a row plan the dX kernel leaves the dropped rows unwritten (NaN in the
  # interpreter) and the plan's select zeroes them: every kept row right, every dropped row zero.
  rng = np.random.default_rng(count + (11 if planned else 1))
  kept = np.sort(rng.choice(75, count, replace=False))
  config = pallas_backend.BlockConfig(**{**SMALL_TILES.__dict__, **split})
  plan = row_plan(np.isin(np.arange(75), kept)) if planned else None
  _check(*_case(rng, 75, 37, 60, kept, jnp.float32), RowPolicy(), interpret=interpret,
         config=config, kernel_nk=kernel_nk, plan=plan)


@pytest.mark.parametrize("split", [{}, DX_SPLIT], ids=["plain", "dx_split"])
def test_dx_without_zero_rows_leaves_the_rows_past_the_live_tiles_unwritten(split):
  # dx_pallas(zero_rows=False) in the interpreter, whose unwritten outputs are NaN: the kept rows'
  # products in place, the live tiles' other rows zero (dy is zero there), every row past the
  # live tiles NaN: no zero row is stored there. (The interpreter only: on a GPU those rows hold
  # whatever the buffer held.)
  rng = np.random.default_rng(3)
  config = pallas_backend.BlockConfig(**{**SMALL_TILES.__dict__, **split})
  count, kept = 20, np.sort(rng.choice(64, 20, replace=False))
  x, kernel, dy = _case(rng, 64, 32, 48, kept, jnp.float32)
  dropped = np.setdiff1d(np.arange(64), kept)
  perm = jnp.asarray(np.concatenate([kept, dropped]), jnp.int32)
  dyc = dy[perm]  # compacted: the kept rows first, zeros after them
  dx = np.asarray(jax.jit(lambda: pallas_backend.dx_pallas(
    dyc, kernel, perm, jnp.array([count], jnp.int32), config=config, interpret=True,
    precision=jax.lax.Precision.HIGHEST, zero_rows=False))())
  want = np.asarray(dy, np.float64)[kept] @ np.asarray(kernel, np.float64).T
  assert_close(dx[kept], want, jnp.float32, what="kept rows, in place")
  live_rows = -(-count // config.dx_m) * config.dx_m
  np.testing.assert_array_equal(dx[dropped[:live_rows - count]], 0.0)
  assert np.isnan(dx[dropped[live_rows - count:]]).all()


@pytest.mark.parametrize("interpret", KERNEL_IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(50, 19, 23), (64, 48, 96), (33, 130, 17)])
@pytest.mark.parametrize("split", [{}, DX_SPLIT], ids=["plain", "dx_split"])
def test_partial_tiles(interpret, dtype, shape, split):
  num_rows, in_features, out_features = shape
  rng = np.random.default_rng(num_rows * in_features)
  kept = np.flatnonzero(rng.random(num_rows) < 0.4)
  config = pallas_backend.BlockConfig(**{**SMALL_TILES.__dict__, **split})
  _check(*_case(rng, num_rows, in_features, out_features, kept, dtype), RowPolicy(),
         interpret=interpret, config=config)


# (dx_programs, count) -> parts of the N loop, of 5 steps (N = 75 on dx_n = dw_n = 16 tiles) for
# the 3 column blocks of K = 37, at most 4 parts: 2/2/1/0 steps, 2/2/1, 3/2, all 5; the count of
# 40 splits all three of its row blocks.
@pytest.mark.parametrize("interpret", KERNEL_IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("programs,count,parts", [(24, 20, 4), (9, 1, 3), (18, 40, 2),
                                                  (6, 20, 1)])
def test_dx_split_shares_ragged_n_loops(interpret, dtype, programs, count, parts):
  live_tiles = -(-count // 16) * 3
  assert min(max(programs // live_tiles, 1), 4) == parts  # guards the case table above
  rng = np.random.default_rng(programs * count)
  kept = np.sort(rng.choice(75, count, replace=False))
  config = pallas_backend.BlockConfig(**{**SMALL_TILES.__dict__, "dw_n": 16, "dx_split": 4,
                                         "dx_programs": programs})
  _check(*_case(rng, 75, 37, 75, kept, dtype), RowPolicy(), interpret=interpret, config=config)


@pytest.mark.parametrize("interpret", KERNEL_IMPLS)
@pytest.mark.parametrize("count", [65, 75])
def test_dx_split_launch_runs_one_part_tiles_as_the_unsplit_launch_does(interpret, count):
  # Past DX_SPLIT's split rows (64, above) every live tile has one part; such a tile runs the
  # unsplit launch's loop, its trip count known at compile time (NOTES "v35"), so dX is the
  # unsplit launch's bit for bit, and dW, which the dX split does not touch, too.
  rng = np.random.default_rng(count)
  kept = np.sort(rng.choice(75, count, replace=False))
  x, kernel, dy = _case(rng, 75, 37, 60, kept, jnp.float32)
  grads = {}
  for split in (1, DX_SPLIT["dx_split"]):
    config = pallas_backend.BlockConfig(**{**SMALL_TILES.__dict__, **DX_SPLIT, "dx_split": split})
    grads[split] = _backward(x, kernel, dy, RowPolicy(), interpret=interpret, config=config)
  assert pallas_backend._dx_launch(80, 48, 4, config)[1:] == (4, 64)  # the split compiled in
  for one_part, unsplit in zip(grads[DX_SPLIT["dx_split"]], grads[1]):
    np.testing.assert_array_equal(np.asarray(one_part), np.asarray(unsplit))


@pytest.mark.parametrize("interpret", KERNEL_IMPLS)
@pytest.mark.parametrize("policy", [RowPolicy(threshold=0.01), RowPolicy(max_rows=20),
                                    RowPolicy(threshold=0.01, max_rows=5)])
@pytest.mark.parametrize("split", SPLITS[::2], ids=_split_id)
def test_dropped_rows_that_are_not_zero(interpret, policy, split):
  # Quiet rows (|dy| = 1e-3) are active for the exact policy but cut by these: the kernels must
  # mask them in dx and dw, including inside the last, partial row block (and in the split dX
  # tiles' partial sums).
  rng = np.random.default_rng(7)
  kept = np.flatnonzero(rng.random(70) < 0.5)
  config = pallas_backend.BlockConfig(**{**SMALL_TILES.__dict__, **split})
  _check(*_case(rng, 70, 29, 40, kept, jnp.float32, quiet=1e-3), policy, interpret=interpret,
         config=config)


def _bf16_as_float64(a) -> np.ndarray:
  return np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64)


def _sum_rounding_partials(terms: np.ndarray, block: int) -> np.ndarray:
  """``terms.sum(0)`` with the running sum rounded to bfloat16 after every ``block`` terms: what a
  GEMM that keeps its partial sums in bfloat16 returns (XLA:GPU's bfloat16 GEMM on such shapes,
  benchmarks/NOTES.md "XLA:GPU's bfloat16 GEMM")."""
  total = np.zeros(terms.shape[1:])
  for start in range(0, len(terms), block):
    total = _bf16_as_float64(total + terms[start:start + block].sum(0))
  return total


@pytest.mark.parametrize("interpret", KERNEL_IMPLS)
@pytest.mark.parametrize("split", [{}, DX_SPLIT, DW_SPLIT], ids=["plain", "dx_split", "dw_split"])
@pytest.mark.parametrize("product", ["dw", "dx"])
def test_long_contractions_that_cancel_accumulate_in_float32(interpret, split, product):
  # bfloat16 products over ~125 kept rows (dW) or 500 columns (dX) whose sum cancels to a
  # fraction of its terms: within bfloat16's tolerance of float64 when summed in float32, as the
  # contract says; summed with bfloat16 partials every 16 terms (a row block, a step of N) they
  # miss it by 5-10x (seeds picked so). Checked by mutation: running sums rounded to bfloat16
  # fail every case of their product, and a dX split's partial tiles rounded so fail its case.
  if product == "dw":
    rng = np.random.default_rng(1177)
    x = rng.standard_normal((251, 1))
    kept = rng.random(251) < 0.5
    dy = rng.standard_normal((251, 6)) * kept[:, None]
    kernel = np.ones((1, 6))
  else:
    rng = np.random.default_rng(281)
    dy = rng.standard_normal((8, 500))
    kernel = rng.standard_normal((1, 500))
    x = np.ones((8, 1))
  x, kernel, dy = (jnp.asarray(a, jnp.bfloat16) for a in (x, kernel, dy))
  config = pallas_backend.BlockConfig(**{**SMALL_TILES.__dict__, **split})
  got = dict(zip(("dx", "dw"), jax.jit(lambda x, k, dy: pallas_backend.backward(
    x, k, dy, policy=RowPolicy(), interpret=interpret, config=config))(x, kernel, dy)))[product]
  x64, kernel64, dy64 = (_bf16_as_float64(a) for a in (x, kernel, dy))
  if product == "dw":
    # In the kept rows' order, as the kernel sums them once compacted.
    want, terms = x64.T @ dy64, (x64[:, :, None] * dy64[:, None, :])[kept]
  else:
    want, terms = dy64 @ kernel64.T, (dy64 * kernel64).T[:, :, None]
  assert_close(got, want, jnp.bfloat16, what=product)
  with pytest.raises(AssertionError, match="elements differ"):
    assert_close(_sum_rounding_partials(terms, 16), want, jnp.bfloat16, what="bf16 partials")


@pytest.mark.parametrize("interpret", KERNEL_IMPLS)
@pytest.mark.parametrize("split", [{}, DX_SPLIT, DW_SPLIT], ids=["plain", "dx_split", "dw_split"])
def test_nonfinite_rows_reach_dx_and_dw(interpret, split):
  # 7 kept rows, two of them non-finite: with the dX split, their dX rows are sums of 2 partial
  # tiles; with the dW split, dW's tail tiles sums of a part that holds them and one that does not.
  rng = np.random.default_rng(3)
  x, kernel, dy = _case(rng, 40, 17, 20, np.arange(5), jnp.float32)
  dy = dy.at[30, 3].set(jnp.nan).at[12, 0].set(-jnp.inf)
  config = pallas_backend.BlockConfig(**{**SMALL_TILES.__dict__, **split})
  _check(x, kernel, dy, RowPolicy(), interpret=interpret, config=config)


@pytest.mark.parametrize("interpret", KERNEL_IMPLS)
@pytest.mark.parametrize("count", [10, 40])
def test_crossover_runs_dense_branch(interpret, count):
  # crossover=0.25 of 64 rows: 10 kept rows take the kernels, 40 the dense branch.
  config = pallas_backend.BlockConfig(**{**SMALL_TILES.__dict__, "crossover": 0.25})
  rng = np.random.default_rng(count)
  _check(*_case(rng, 64, 32, 48, np.arange(count), jnp.float32), RowPolicy(threshold=0.5),
         interpret=interpret, config=config)


@pytest.mark.parametrize("interpret", KERNEL_IMPLS)
def test_only_one_product_requested(interpret):
  rng = np.random.default_rng(11)
  x, kernel, dy = _case(rng, 48, 20, 24, np.arange(0, 48, 3), jnp.float32)
  want_dx, want_dw = sebp_reference(x, kernel, None, dy)
  run = lambda x, k: pallas_backend.backward(x, k, dy, policy=RowPolicy(), interpret=interpret,
                                             config=SMALL_TILES,
                                             precision=jax.lax.Precision.HIGHEST)
  dx, dw = run(None, kernel)
  assert dw is None
  assert_close(dx, want_dx, jnp.float32, what="dx alone")
  dx, dw = run(x, None)
  assert dx is None
  assert_close(dw, want_dw, jnp.float32, what="dw alone")


@pytest.mark.parametrize("interpret", KERNEL_IMPLS)
@pytest.mark.parametrize("num_rows", [1, 7, 1500, 4096, 40000])  # 40000: three chunks
@pytest.mark.parametrize("density", [0.0, 0.3, 1.0])
def test_partition_kernel(interpret, num_rows, density):
  rng = np.random.default_rng(num_rows)
  keep = rng.random(num_rows) < density
  perm, count = pallas_backend.partition_pallas(jnp.asarray(keep), interpret=interpret)
  perm, count = np.asarray(perm), int(np.asarray(count)[0])
  assert count == keep.sum()
  rows = np.arange(num_rows)
  np.testing.assert_array_equal(perm[:count], rows[keep])
  np.testing.assert_array_equal(perm[count:num_rows], rows[~keep])
  np.testing.assert_array_equal(perm[num_rows:], np.arange(num_rows, len(perm)))


@pytest.mark.parametrize("interpret", KERNEL_IMPLS)
@pytest.mark.parametrize("programs", [None, 2, 5], ids=["block_each", "two_loop", "five"])
@pytest.mark.parametrize("count", [0, 1, 15, 16, 17, 40, 48])
def test_gather_kernel(interpret, programs, count):
  # Two sources of different widths and dtypes, each of several column chunks (dy: 3 chunks of
  # 256 columns, x: 5 of 64), and every program copies one chunk of one source: the kept rows in
  # perm order, then zeros to the end of the block that holds the last of them. Three row blocks:
  # one program each (the default off GPU), two programs that loop (blocks 0 and 2, block 1), or
  # more programs than blocks.
  num_rows, block_m = 48, 16
  rng = np.random.default_rng(count)
  dy = jnp.asarray(rng.standard_normal((num_rows, 768)), jnp.bfloat16)
  x = jnp.asarray(rng.standard_normal((num_rows, 320)), jnp.float32)
  keep = np.zeros(num_rows, bool)
  keep[rng.permutation(num_rows)[:count]] = True
  perm, counted = pallas_backend.partition_pallas(jnp.asarray(keep), interpret=interpret)
  gathered, (dy_sum,), counters = jax.jit(
    lambda sources, perm, counted: pallas_backend.gather_pallas(
      sources, perm, counted, block_m=block_m, interpret=interpret, programs=programs,
      summed=(0,), zeroed=(5, 0, 64)))([dy, x], perm, counted)
  # The arrival counters of split GEMMs, zeroed in the launch (the interpreter fills what no
  # program writes with int32's minimum), a power of two long; none for a launch of no split.
  assert counters[1] is None
  counters = [counters[0], counters[2]]
  assert [(c.dtype, c.shape) for c in counters] == [(jnp.int32, (8,)), (jnp.int32, (64,))]
  assert all(not np.asarray(c).any() for c in counters)
  written = -(-count // block_m) * block_m
  for source, copy in zip((dy, x), gathered):
    source, copy = np.asarray(source, np.float32), np.asarray(copy, np.float32)
    np.testing.assert_array_equal(copy[:count], source[np.nonzero(keep)[0]])
    np.testing.assert_array_equal(copy[count:written], 0.0)
  # dy's float32 column sums over the kept rows (bias gradients), from every program's partial
  # row, zeros for programs without a kept block.
  assert dy_sum.dtype == jnp.float32 and dy_sum.shape == (768,)
  np.testing.assert_allclose(dy_sum, np.asarray(dy, np.float32)[keep].sum(axis=0), rtol=1e-5,
                             atol=1e-4)


def test_reference_mask_agrees_with_count():
  # Guards the helper above: the reference counts what _case made active.
  rng = np.random.default_rng(0)
  _, _, dy = _case(rng, 30, 4, 5, np.array([1, 4, 29]), jnp.float32)
  assert reference_keep_mask(dy).nonzero()[0].tolist() == [1, 4, 29]


def test_block_table_shrinks_to_small_layers():
  config = pallas_backend.block_config(20, 9, 300, jnp.bfloat16)
  assert config.dx_m == config.dw_m == 32 and config.dx_k == config.dw_k == 16
  assert config.dw_n == 128  # 300 columns keep the table's tile


@pytest.mark.parametrize("out_features,compact", [(3072, True), (16383, True), (16384, False),
                                                  (128256, False)])
def test_vocabulary_wide_layers_read_kept_rows_in_place(out_features, compact):
  # A compacted copy of a vocabulary-wide dy would add a dy-sized buffer to the peak memory.
  assert pallas_backend.block_config(4096, 3072, out_features, jnp.bfloat16).compact == compact


@pytest.mark.parametrize("rows,in_features,out_features,dx_n,dx_k", [
  (4096, 3072, 8192, 128, 128),  # LLaMA-3B MLP up at batch 1: long dX steps over N
  (4096, 3072, 3072, 128, 128),  # its q/o projections, as long
  (4096, 8192, 3072, 128, 128),  # its MLP down, as long (on the persistent dX launch)
  (4096, 3072, 1024, 64, 128),  # its k/v projections: a small weight, the default tiles
  (32768, 3072, 8192, 64, 256),  # the MLP at batch 8: the wide tiles
])
def test_block_table_shape_classes_on_hopper(monkeypatch, rows, in_features, out_features,
                                             dx_n, dx_k):
  monkeypatch.setattr(pallas_backend, "_gpu_generation", lambda: "hopper")
  config = pallas_backend.block_config(rows, in_features, out_features, jnp.bfloat16)
  assert (config.dx_n, config.dx_k) == (dx_n, dx_k)


@pytest.mark.parametrize("in_features,out_features,dw_k,dw_split", [
  (768, 768, 64, 1),  # BERT-base q/k/v/o ("small"): 72 dW tiles, unsplit
  (384, 1536, 64, 1),  # MiniLM's FFN, as small a weight
  (768, 3072, 128, 8),  # BERT-base FFN ("narrow"): 144 tiles of 128 x 128, the 12 past 132 split
  (768, 1408, 128, 2),  # just past the small class: 66 tiles of 128 x 128, split 2
])
def test_dw_tiles_and_split_by_shape_class_on_hopper(monkeypatch, in_features, out_features,
                                                     dw_k, dw_split):
  monkeypatch.setattr(pallas_backend, "_gpu_generation", lambda: "hopper")
  monkeypatch.setattr(pallas_backend, "_sm_count", lambda: 132)
  config = pallas_backend.block_config(16384, in_features, out_features, jnp.bfloat16)
  assert (config.dw_k, config.dw_split) == (dw_k, dw_split)


@pytest.mark.parametrize("rows,in_features,out_features,launch", [
  (4096, 3072, 8192, (132, 2, 128)),
  (4096, 3072, 128256, (264, 8, 320)),
  (16384, 3072, 8192, (132, 4, 640)),
  (16384, 8192, 3072, (132, 4, 256)),
])
def test_few_row_layers_split_their_dx_on_hopper(monkeypatch, rows, in_features, out_features,
                                                 launch):
  # LLaMA-3B at batch 1 (24 column blocks of 128 at K = 3072): the LM head's dX shares its
  # 128,256-column loop among up to 8 programs per tile, two programs per SM: 264 // 2 // 24 = 5
  # row blocks of 64 can still have 2 parts. The MLP up (`wide_short`) splits in 2, one program
  # per SM (its four 128-column steps fill an SM's shared memory): 132 // 2 // 24 = 2 row blocks.
  # At batch 4 (`wide`: 128 x 256 tiles, one program per SM) up splits in up to 4 parts below
  # 132 // 2 // 12 = 5 row blocks of 128, down (32 column blocks) below 2.
  monkeypatch.setattr(pallas_backend, "_gpu_generation", lambda: "hopper")
  monkeypatch.setattr(pallas_backend, "_sm_count", lambda: 132)
  config = pallas_backend.block_config(rows, in_features, out_features, jnp.bfloat16)
  assert pallas_backend._dx_launch(rows, in_features, out_features // config.dx_n,
                                   config) == launch


@pytest.mark.parametrize("sms,tiles,split,tail", [
  (None, 36, 1, 0),  # off GPU: unchanged
  (132, 36, 3, 36),  # fewer tiles than SMs: every tile split
  (132, 144, 8, 12),  # a second wave of 12 tiles: those split, as far as _MAX_DW_SPLIT allows
  (132, 200, 1, 0),  # a second wave of 68: 132 // 68 = 1, nothing split
  (132, 264, 1, 0),  # two whole waves: nothing to split
  (132, 4, 8, 4),
])
def test_dw_split_fills_the_gpu(monkeypatch, sms, tiles, split, tail):
  monkeypatch.setattr(pallas_backend, "_sm_count", lambda: sms)
  config = pallas_backend.block_config(4096, 128 * tiles, 128, jnp.bfloat16)
  assert config.dw_k == config.dw_n == 128
  assert (config.dw_split, config.dw_slots) == (split, sms or 0)
  assert pallas_backend._dw_tail(tiles, config) == tail


@pytest.mark.parametrize("sms,tiles,programs", [
  (None, {}, 0),  # off GPU: one program per tile
  (132, {}, 264),  # 3 steps of 64 x 64 and 64 x 128 tiles: 72 KiB, two fit in an SM
  (132, dict(dx_n=128, dx_stages=4), 132),  # 4 steps of twice as wide: 192 KiB, one per SM
  (132, dict(dx_programs=7), 7),  # set by the table: kept
])
def test_dx_programs_sized_from_the_sm_count(monkeypatch, sms, tiles, programs):
  monkeypatch.setattr(pallas_backend, "_sm_count", lambda: sms)
  config = pallas_backend.BlockConfig(**tiles)
  assert pallas_backend.with_dx_programs(config, jnp.bfloat16).dx_programs == programs


@pytest.mark.parametrize("programs,in_features,split,launch", [
  (0, 3072, 4, (1536, 4, 2048)),  # one program per tile (off GPU): half the tiles can split
  (264, 3072, 4, (264, 4, 320)),  # LLaMA-3B: 24 column blocks, 5 row blocks can have 2 parts
  (132, 16384, 4, (132, 1, 0)),  # 128 column blocks: never 2 parts, off
  (264, 128, 4, (256, 4, 4096)),  # 1 column block: 256 items at most; every row can split
  (264, 128, 1, (64, 1, 0)),  # unsplit: no more programs than the 64 tiles
])
def test_dx_launch_from_the_programs(programs, in_features, split, launch):
  config = pallas_backend.BlockConfig(dx_split=split, dx_programs=programs)
  assert pallas_backend._dx_launch(4096, in_features, 64, config) == launch


@pytest.mark.parametrize("compact", [True, False], ids=["compact", "in_place"])
def test_fused_needs_no_dx_split(compact):
  config = pallas_backend.BlockConfig(**{**SMALL_TILES.__dict__, "compact": compact,
                                         "dx_split": 4, "fused": True})
  x, kernel, dy = (jnp.ones(shape) for shape in ((32, 16), (16, 32), (32, 32)))
  with pytest.raises(ValueError, match="`fused`.*needs dx_split=1, got dx_split=4"):
    jax.eval_shape(lambda: pallas_backend.backward(x, kernel, dy, policy=RowPolicy(),
                                                   config=config, interpret=True))


def test_grads_pallas_called_directly_checks_dx_split():
  config = pallas_backend.BlockConfig(**{**SMALL_TILES.__dict__, "compact": False, "dx_split": 4})
  x, kernel, dy = (jnp.ones(shape) for shape in ((32, 16), (16, 32), (32, 32)))
  perm, count = jnp.arange(32, dtype=jnp.int32), jnp.array([32], jnp.int32)
  with pytest.raises(ValueError, match="grads_pallas: needs dx_split=1, got dx_split=4"):
    pallas_backend.grads_pallas(x, dy, kernel, perm, count, config=config, dw_config=config,
                                interpret=True)


@pytest.mark.parametrize("split", [dict(dx_split=0), dict(dx_split=2, dx_programs=-1),
                                   dict(dw_programs=-1), dict(dw_split=0),
                                   dict(dw_split=2, dw_min_part=0)])
def test_bad_launch_sizes_are_named(split):
  config = pallas_backend.BlockConfig(**{**SMALL_TILES.__dict__, **split})
  x, kernel, dy = (jnp.ones(shape) for shape in ((32, 16), (16, 32), (32, 32)))
  with pytest.raises(ValueError, match="`d[xw]_(split|programs|min_part)`"):
    jax.eval_shape(lambda: pallas_backend.backward(x, kernel, dy, policy=RowPolicy(),
                                                   config=config, interpret=True))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("policy", [RowPolicy(), RowPolicy(max_rows=100)], ids=str)
@pytest.mark.parametrize("split", [dict(), dict(dw_split=3, dx_programs=3, dw_programs=5),
                                   dict(dx_split=4, dx_programs=8),
                                   dict(dx_split=8, dx_programs=132),
                                   dict(compact=False),
                                   dict(compact=False, dx_split=4, dx_programs=8),
                                   dict(compact=False, fused=True),
                                   dict(compact=False, fused=True, dw_split=3, dx_programs=3,
                                        dw_programs=5),
                                   dict(fused=True), dict(fused=True, dw_split=3),
                                   dict(dw_split=3, dw_slots=4, dw_programs=3),
                                   dict(fused=True, dw_split=3, dw_slots=4)],
                         ids=["plain", "dw_split_persistent_dx", "dx_split", "dx_split_all_rows",
                              "in_place", "in_place_dx_split", "fused_in_place",
                              "fused_in_place_dw_split", "fused", "fused_dw_split",
                              "dw_split_tail", "fused_dw_split_tail"])
@pytest.mark.parametrize("kernel_nk", [False, True], ids=["kn", "nk"])
def test_kernels_lower_to_triton_ir_without_a_gpu(dtype, policy, split, kernel_nk):
  config = pallas_backend.BlockConfig(**{**pallas_backend.BlockConfig().__dict__, **split,
                                         "crossover": 0.4})
  # Partition, gather, dX and dW (a split's partial tiles summed in its own launch); one fewer
  # without the gather, and one fewer with dX and dW in one launch.
  expected = 4 - (not split.get("compact", True)) - split.get("fused", False)
  assert _exported_kernel_count(config, dtype, 500, 192, 320, policy,
                                kernel_nk=kernel_nk) == expected


@pytest.mark.parametrize("key", sorted(pallas_backend._BLOCK_TABLE), ids=str)
def test_block_table_entries_lower_to_triton_ir(monkeypatch, key):
  # Every tuned entry as block_config hands it to a layer on the GPU it was tuned for (the SM
  # count of an H100 sizes its splits), lowered the way the test above lowers its variants.
  monkeypatch.setattr(pallas_backend, "_sm_count", lambda: 132)
  dtype = {2: jnp.bfloat16, 4: jnp.float32}[key[1]]
  num_rows, in_features, out_features = 4096, 3072, 16384 if key[2] == "vocab" else 640
  config = pallas_backend.BlockConfig(**{
    **pallas_backend._BLOCK_TABLE[key].__dict__, "compact": key[2] != "vocab"})
  config = pallas_backend.with_dx_programs(config, dtype)
  # Partition, dX, dW and the gather where compacted.
  expected = 3 + config.compact
  # A vocabulary-wide layer is typically a tied embedding, stored (N, K).
  assert _exported_kernel_count(config, dtype, num_rows, in_features, out_features,
                                kernel_nk=key[2] == "vocab") == expected


def _exported_kernel_count(config, dtype, num_rows, in_features, out_features,
                           policy=RowPolicy(), kernel_nk=False) -> int:
  """Pallas-Triton kernels in the CUDA export of the backward under ``config`` (lowered, not run).

  The Pallas-to-Triton lowering runs at JAX lowering time, on any host: exporting for CUDA
  catches a kernel that the interpreter runs but Triton cannot express (only Triton's own
  compilation to PTX needs the GPU). The Triton custom calls are not serializable in general,
  which is the one check disabled here."""
  from jax import export

  kernel_shape = (out_features, in_features) if kernel_nk else (in_features, out_features)
  shapes = [jax.ShapeDtypeStruct(shape, dtype) for shape in (
    (num_rows, in_features), kernel_shape, (num_rows, out_features))]
  backward = jax.jit(lambda x, k, dy: pallas_backend.backward(x, k, dy, policy=policy,
                                                              config=config,
                                                              kernel_nk=kernel_nk))
  exported = export.export(
    backward, platforms=["cuda"],
    disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*shapes)
  return exported.mlir_module().count("@__gpu$xla.gpu.triton(")


@pytest.mark.parametrize("name", [tune_blocks.TABLE, *sorted(tune_blocks.CANDIDATES)])
def test_tuner_candidates_lower_to_triton_ir(monkeypatch, name):
  # Every configuration the tuner times on the GPU, sized as it sizes them for an H100 (132 SMs),
  # at a LLaMA-b1-like shape: a candidate that Triton cannot express fails here, not in a tuning run.
  monkeypatch.setattr(pallas_backend, "_sm_count", lambda: 132)
  num_rows, in_features, out_features = 4096, 3072, 640
  config = tune_blocks.sized_candidate(name, num_rows, in_features, out_features, jnp.bfloat16)
  expected = 3 + config.compact - config.fused
  assert _exported_kernel_count(config, jnp.bfloat16, num_rows, in_features,
                                out_features) == expected


@pytest.mark.parametrize("split,rows,in_features,out_features,launches,alias", [
  # Each split's arrival counters are zeros made on the device, invariant over the mesh axis
  # while the rows vary, aliased to an output of its launch: dX's operand 4, dW's 4, the fused
  # launch's 5.
  (DX_SPLIT, 64, 32, 48, 4, (4, 1)),
  (DW_SPLIT, 75, 37, 60, 4, (4, 1)),
  (FUSED, 75, 37, 60, 3, (5, 2)),
], ids=["dx_split", "dw_split", "fused_dw_split"])
def test_splits_trace_in_shard_map_with_check_vma(split, rows, in_features, out_features,
                                                  launches, alias):
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

  mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,))
  config = pallas_backend.BlockConfig(**{**SMALL_TILES.__dict__, **split})

  def per_device(x, kernel, dy):
    dx, dw = pallas_backend.backward(x, kernel, dy, policy=RowPolicy(), config=config)
    return dx, jax.lax.psum(dw, "data")

  backward = jax.shard_map(per_device, mesh=mesh, in_specs=(P("data"), P(), P("data")),
                           out_specs=(P("data"), P()), check_vma=True)
  shapes = [jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))
            for shape, spec in (((rows, in_features), P("data")),
                                ((in_features, out_features), P()),
                                ((rows, out_features), P("data")))]
  with jax.set_mesh(mesh):
    jaxpr = str(jax.make_jaxpr(backward)(*shapes))
  assert jaxpr.count("pallas_call") == launches
  assert f"input_output_aliases=({alias},)" in jaxpr


def _conds_in_backward(run, x, kernel):
  """``cond`` equations in the jaxpr of ``run``'s gradient with respect to ``x`` and ``kernel``."""
  grad = jax.grad(lambda x, k: jnp.sum(run(x, k) ** 2), argnums=(0, 1))
  return count_primitive(jax.make_jaxpr(grad)(x, kernel), "cond", into_kernels=False)


@pytest.mark.parametrize("crossover,conds", [(None, 1), (0.25, 1), (1.0, 0), (3.0, 0)])
def test_crossover_argument_compiles_the_conditional_in_or_out(crossover, conds):
  # None: the block table's crossover (0.4 off the table too); >= 1: no conditional at all. The
  # gradient is the contract's in every case, with every row kept (count = M, past any crossover).
  rng = np.random.default_rng(5)
  x, kernel, dy = _case(rng, 40, 24, 33, np.arange(40), jnp.float32)
  run = lambda x, k: sebp_matmul(x, k, impl="interpret", crossover=crossover,
                                 precision=jax.lax.Precision.HIGHEST)
  assert _conds_in_backward(run, x, kernel) == conds
  dx, dw = jax.vjp(run, x, kernel)[1](dy)
  want_dx, want_dw = sebp_reference(x, kernel, None, dy)
  assert_close(dx, want_dx, jnp.float32, what="dx")
  assert_close(dw, want_dw, jnp.float32, what="dw")


@pytest.mark.parametrize("crossover", [0, -0.5, float("nan"), "0.4", True])
def test_bad_crossover_is_named(crossover):
  x = jnp.ones((4, 3))
  with pytest.raises(ValueError, match="`crossover`"):
    sebp_matmul(x, jnp.ones((3, 2)), crossover=crossover)
  with pytest.raises(ValueError, match="`crossover`"):
    SEBPDotGeneral(crossover=crossover)


# The sibling accumulation: a second projection of the same input adds its dx into the first
# one's buffer. Each sibling keeps its own rows (per-layer scoring: other rows than the first),
# so rows the second drops keep the first one's values and rows it keeps get the sum.
@pytest.mark.parametrize("interpret", KERNEL_IMPLS)
@pytest.mark.parametrize("split", SPLITS, ids=_split_id)
@pytest.mark.parametrize("count", [0, 17, 75])
@pytest.mark.parametrize("kernel_nk", [False, True], ids=["kn", "nk"])
def test_dx_into_adds_a_sibling_dx_in_place(interpret, split, count, kernel_nk):
  rng = np.random.default_rng(count + 7)
  config = pallas_backend.BlockConfig(**{**SMALL_TILES.__dict__, **split})
  first = np.sort(rng.choice(75, 30, replace=False))
  second = np.sort(rng.choice(75, count, replace=False))
  x, kernel, dy = _case(rng, 75, 37, 60, first, jnp.float32)
  _, kernel2, dy2 = _case(rng, 75, 37, 44, second, jnp.float32)
  precision = jax.lax.Precision.HIGHEST

  def backward(k, d, dx_into=None):
    return pallas_backend.backward(x, k.T if kernel_nk else k, d, policy=RowPolicy(),
                                   precision=precision, interpret=interpret, config=config,
                                   kernel_nk=kernel_nk, dx_into=dx_into)

  dx, dw = jax.jit(lambda: (lambda first_dx: backward(kernel2, dy2, first_dx[0]))(
    backward(kernel, dy)))()
  want_dx1, _ = sebp_reference(x, kernel, None, dy, 0.0, None)
  want_dx2, want_dw2 = sebp_reference(x, kernel2, None, dy2, 0.0, None)
  assert_close(dx, np.asarray(want_dx1, np.float64) + np.asarray(want_dx2, np.float64),
               jnp.float32, what="summed dx")
  assert_close(dw, want_dw2.T if kernel_nk else want_dw2, jnp.float32, what="dw")


@pytest.mark.parametrize("interpret", KERNEL_IMPLS)
@pytest.mark.parametrize("count", [10, 70])
def test_dx_into_through_the_dense_branch(interpret, count):
  # Past the crossover the dense branch runs, and still adds dx_into.
  rng = np.random.default_rng(count)
  x, kernel, dy = _case(rng, 75, 37, 60, np.arange(count), jnp.float32)
  into = jnp.asarray(rng.standard_normal((75, 37)), jnp.float32)
  config = pallas_backend.BlockConfig(**{**SMALL_TILES.__dict__, "crossover": 0.5})
  dx, _ = jax.jit(lambda: pallas_backend.backward(
    x, kernel, dy, policy=RowPolicy(), precision=jax.lax.Precision.HIGHEST,
    interpret=interpret, config=config, dx_into=into))()
  want_dx, _ = sebp_reference(x, kernel, None, dy, 0.0, None)
  assert_close(dx, np.asarray(into, np.float64) + np.asarray(want_dx, np.float64), jnp.float32)


def test_dx_into_is_checked():
  x = jnp.ones((32, 16)); kernel = jnp.ones((16, 32)); dy = jnp.ones((32, 32))
  with pytest.raises(ValueError, match="`dx_into` needs `kernel`"):
    pallas_backend.backward(x, None, dy, policy=RowPolicy(), interpret=True,
                            config=SMALL_TILES, dx_into=jnp.zeros((32, 16)))
  with pytest.raises(ValueError, match="`accumulator` must be float32\\[32, 16\\]"):
    pallas_backend.backward(x, kernel, dy, policy=RowPolicy(), interpret=True,
                            config=SMALL_TILES, dx_into=jnp.zeros((32, 16), jnp.bfloat16))


@pytest.mark.parametrize("split", [dict(), dict(dx_split=4, dx_programs=8), dict(compact=False),
                                   dict(compact=False, fused=True), dict(fused=True)],
                         ids=["plain", "dx_split", "in_place", "fused_in_place", "fused"])
def test_accumulating_dx_lowers_to_triton_ir(split):
  from jax import export

  config = pallas_backend.BlockConfig(**{**pallas_backend.BlockConfig().__dict__, **split,
                                         "crossover": 1.0})
  shapes = [jax.ShapeDtypeStruct(shape, jnp.bfloat16)
            for shape in ((512, 192), (192, 320), (512, 320), (512, 192))]
  backward = jax.jit(lambda x, k, dy, into: pallas_backend.backward(
    x, k, dy, policy=RowPolicy(), config=config, dx_into=into))
  exported = export.export(
    backward, platforms=["cuda"],
    disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*shapes)
  # Partition, gather (where compacted), dX, dW (one launch with dX where fused).
  expected = 3 + config.compact - config.fused
  assert exported.mlir_module().count("@__gpu$xla.gpu.triton(") == expected


@pytest.mark.parametrize("split", [dict(), dict(dx_split=4, dx_programs=8), dict(compact=False),
                                   dict(compact=False, fused=True), dict(fused=True)],
                         ids=["plain", "dx_split", "in_place", "fused_in_place", "fused"])
@pytest.mark.parametrize("kernel_nk", [False, True], ids=["kn", "nk"])
def test_planned_backward_lowers_to_triton_ir(split, kernel_nk):
  # Under a row plan: no partition, dX's dropped rows left unwritten (no zero item) and zeroed
  # by an XLA select.
  from jax import export

  config = pallas_backend.BlockConfig(**{**pallas_backend.BlockConfig().__dict__, **split,
                                         "crossover": 1.0})
  mask = jax.ShapeDtypeStruct((512,), jnp.bool_)
  shapes = [jax.ShapeDtypeStruct(shape, jnp.bfloat16)
            for shape in ((512, 192), (320, 192) if kernel_nk else (192, 320), (512, 320))]
  backward = jax.jit(lambda mask, x, k, dy: pallas_backend.backward(
    x, k, dy, policy=RowPolicy(), config=config, plan=row_plan(mask), kernel_nk=kernel_nk))
  exported = export.export(
    backward, platforms=["cuda"],
    disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(mask,
                                                                                       *shapes)
  text = exported.mlir_module()
  assert text.count("@__gpu$xla.gpu.triton(") == config.compact + 2 - config.fused
  # No gather puts rows in place (v20 did); the select that zeroes the dropped rows is checked
  # where its effect shows, in the interpreter (NaN in every unwritten row).
  assert "stablehlo.gather" not in text


@pytest.mark.parametrize("one_dx", [False, True], ids=["dx_each", "dx_one_launch"])
@pytest.mark.parametrize("one_dw", [False, True], ids=["dw_each", "dw_one_launch"])
@pytest.mark.parametrize("column_sums", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("planned", [True, False], ids=["planned", "scored"])
def test_sibling_groups_lower_to_triton_ir(monkeypatch, planned, column_sums, one_dw, one_dx):
  # q, k and v of LLaMA-3B-like widths: one gather of x and the three dy (four sources of
  # different widths; with biases, it sums the dys' rows too), then dX (the later two
  # accumulating) and dW per sibling, or the three dW in one launch (`dw_siblings_pallas`, each
  # splitting its few tiles over rows as on a 132-SM GPU), or the three dX in one launch (each
  # tile's loop through the three N, split two ways); scored (exact policy, default crossover),
  # one partition of the union of their rows before it.
  from jax import export

  monkeypatch.setattr(pallas_backend, "_SIBLINGS_DW_ONE_LAUNCH", one_dw)
  monkeypatch.setattr(pallas_backend, "_SIBLINGS_DX_ONE_LAUNCH", one_dx)
  if one_dw:
    monkeypatch.setattr(pallas_backend, "_sm_count", lambda: 132)
  if one_dx:
    table = pallas_backend.block_config
    monkeypatch.setattr(pallas_backend, "block_config", lambda *args: dataclasses.replace(
      table(*args), dx_split=2))

  mask = jax.ShapeDtypeStruct((512,), jnp.bool_)
  shapes = [jax.ShapeDtypeStruct(shape, jnp.bfloat16)
            for shape in ((512, 192), (192, 320), (192, 64), (192, 64), (512, 320), (512, 64),
                          (512, 64))]

  def backward(mask, x, kq, kk, kv, dq, dk, dv):
    return pallas_backend.siblings_backward(
      x, (kq, kk, kv), (dq, dk, dv), policy=RowPolicy(), crossover=1.0 if planned else None,
      plan=row_plan(mask) if planned else None, column_sums=column_sums)
  exported = export.export(
    jax.jit(backward), platforms=["cuda"],
    disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(mask,
                                                                                       *shapes)
  assert exported.mlir_module().count("@__gpu$xla.gpu.triton(") == (not planned) + 1 + (
    1 if one_dx else 3) + (1 if one_dw else 3)
