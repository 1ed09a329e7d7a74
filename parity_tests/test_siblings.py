"""``sebp_matmuls``: sibling projections of one input under one SEBP backward, against dense
autodiff of the same products (each sibling's ``dx`` summed into the first one's in place)."""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parity_tests.impls import impl_params
from parity_tests.jaxprs import dot_output_shapes, iter_eqns
from parity_tests.tolerances import assert_close
import sebp_jax
from sebp_jax import row_plan, sebp_matmul, sharded_rows
from sebp_jax.backends import pallas as pallas_backend
from sebp_jax.matmul import sebp_matmuls

# The backends with a sibling rule of their own: the Pallas kernels (interpreted on the CPU, run on
# a GPU) and XLA's; "dense" has no backward to share.
IMPLS = [param for param in impl_params() if param.values[0] != "dense"]
SHAPE, FEATURES = (2, 9), (8, 5, 7)  # odd sizes: three siblings of different widths
# Small tiles, no crossover: the Pallas interpreter runs the accumulating kernels themselves.
TILES = pallas_backend.BlockConfig(dx_m=16, dx_k=16, dx_n=16, dx_warps=4, dx_stages=2, dw_m=16,
                                   dw_k=16, dw_n=32, dw_warps=4, dw_stages=2, crossover=1.0)


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
  monkeypatch.setattr(pallas_backend, "block_config", lambda *args: TILES)


def _case(dtype, seed=0, same_rows=True):
  rng = np.random.default_rng(seed)
  mask = np.zeros(SHAPE, bool)
  mask[0, :6], mask[1, :3] = True, True  # real tokens a prefix of each sequence
  x = jnp.asarray(rng.standard_normal((*SHAPE, 12)), dtype)
  kernels = tuple(jnp.asarray(rng.standard_normal((12, n)), dtype) for n in FEATURES)
  dys = []
  for n in FEATURES:
    rows = mask if same_rows else mask & (rng.random(SHAPE) < 0.6)
    dys.append(jnp.asarray(np.where(rows[..., None], rng.standard_normal((*SHAPE, n)), 0.0), dtype))
  return mask, x, kernels, tuple(dys)


def _grads(fn, x, kernels, dys):
  _, vjp = jax.vjp(fn, x, kernels)
  return vjp(dys)


def _dense(x, kernels):
  return tuple(x @ kernel for kernel in kernels)


def _biases(dtype, with_none=False):
  """One bias per sibling (the middle one ``None`` with ``with_none``)."""
  rng = np.random.default_rng(11)
  biases = [jnp.asarray(rng.standard_normal(n), dtype) for n in FEATURES]
  if with_none:
    biases[1] = None
  return tuple(biases)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("planned", [False, True], ids=["scored", "planned"])
def test_matches_dense_autodiff(impl, dtype, planned):
  mask, x, kernels, dys = _case(dtype)
  rows = row_plan(jnp.asarray(mask)) if planned else None
  fn = lambda x, ks: sebp_matmuls(x, ks, impl=impl, rows=rows)  # noqa: E731
  (dx, dws), (want_dx, want_dws) = _grads(fn, x, kernels, dys), _grads(_dense, x, kernels, dys)
  assert_close(dx, want_dx, dtype, what="dx")
  for index, (dw, want) in enumerate(zip(dws, want_dws)):
    assert_close(dw, want, dtype, what=f"dw[{index}]")


def _kernel_launches(fn, x, kernels, dys):
  """The Pallas kernels the backward of ``fn`` runs, by name, in order."""
  _, vjp = jax.vjp(fn, x, kernels)
  # The kernel's name: `name` here, `name_and_src_info` (name, then source) in some jax versions.
  return [str(eqn.params.get("name", eqn.params.get("name_and_src_info"))).split()[0]
          for eqn in iter_eqns(jax.make_jaxpr(vjp)(dys)) if eqn.primitive.name == "pallas_call"]


@pytest.mark.parametrize("rows, policy, shared", [
  ("planned", sebp_jax.RowPolicy(), True),
  ("scored", sebp_jax.RowPolicy(), True),  # exact: the union of the siblings' kept rows
  ("scored", sebp_jax.RowPolicy(threshold=0.5), False),
  ("scored", sebp_jax.RowPolicy(max_rows=4), False),
], ids=["planned", "scored exact", "threshold", "top-n"])
def test_siblings_share_one_partition_and_gather_where_exact(rows, policy, shared):
  # One partition (none under a plan) and one gather of x and every dy where one set of kept
  # rows is exact for the group; else each sibling selects and gathers its own.
  mask, x, kernels, dys = _case("float32")
  plan = row_plan(jnp.asarray(mask)) if rows == "planned" else None
  launches = _kernel_launches(
    lambda x, ks: sebp_matmuls(x, ks, policy=policy, impl="interpret", rows=plan), x, kernels,
    dys)
  groups = 1 if shared else len(FEATURES)
  assert launches.count("sebp_gather") == groups
  assert launches.count("sebp_partition") == (0 if plan is not None else groups)
  # dX and dW: one launch each for the group where it shares its rows, one per sibling where it
  # does not.
  assert launches.count("sebp_dx") == (1 if shared else len(FEATURES))
  assert launches.count("sebp_dw_siblings") == (1 if shared else 0)
  assert launches.count("sebp_dw") == (0 if shared else len(FEATURES))


# Row blocks of 4 (the case keeps 9 of 18 rows: three live blocks), so that dW's row split runs
# at three parts; one sibling (5 outputs) on tiles of its own with one part.
_SPLIT_TILES = dataclasses.replace(TILES, dx_m=4, dw_m=4, dw_split=3, dw_min_part=1)
_OWN_TILES = dataclasses.replace(TILES, dw_warps=8, dw_stages=3)


@pytest.mark.parametrize("planned", [False, True], ids=["scored", "planned"])
@pytest.mark.parametrize("tiles, dtype", [("split tails", "float32"), ("mixed", "float32"),
                                          ("mixed", "bfloat16")])
def test_the_groups_dw_in_one_launch(monkeypatch, dtype, planned, tiles):
  # `dw_siblings_pallas`: every sibling's dW programs in one launch, each on its own tiles
  # (arrival counters and partial tiles where it splits a tail), against dense autodiff and the
  # launch per sibling.
  configs = {"split tails": lambda n: _SPLIT_TILES,
             "mixed": lambda n: _OWN_TILES if n == 5 else _SPLIT_TILES}[tiles]
  monkeypatch.setattr(pallas_backend, "block_config", lambda rows, k, n, dtype: configs(n))
  mask, x, kernels, dys = _case(dtype, seed=4)
  plan = row_plan(jnp.asarray(mask)) if planned else None
  fn = lambda x, ks: sebp_matmuls(x, ks, impl="interpret", rows=plan)  # noqa: E731
  monkeypatch.setattr(pallas_backend, "_SIBLINGS_DW_ONE_LAUNCH", False)
  per_sibling = _grads(fn, x, kernels, dys)
  monkeypatch.setattr(pallas_backend, "_SIBLINGS_DW_ONE_LAUNCH", True)
  launches = _kernel_launches(fn, x, kernels, dys)
  assert launches.count("sebp_dw_siblings") == 1 and "sebp_dw" not in launches, launches
  # dX: one launch where the siblings' dX tiles are alike (the mixed ones' rows are not).
  assert launches.count("sebp_dx") == (1 if tiles == "split tails" else len(FEATURES))
  dx, dws = _grads(fn, x, kernels, dys)
  # dX's launches are the same as before (test_matches_dense_autodiff checks them).
  np.testing.assert_array_equal(np.asarray(dx), np.asarray(per_sibling[0]))
  want_dws = _grads(_dense, x, kernels, dys)[1]
  for index, (dw, want, before) in enumerate(zip(dws, want_dws, per_sibling[1])):
    assert dw.shape == want.shape and dw.dtype == want.dtype
    assert_close(dw, want, dtype, what=f"dw[{index}]")
    # The same programs as the launch per sibling: the same sums, in the same order.
    np.testing.assert_array_equal(np.asarray(dw), np.asarray(before))


# dX split 4 ways over one live tile: 2 + 2 + 2 steps of N in turn (each sibling padded to 32
# columns, steps of 16), shared 2, 2, 2, 0 by the parts, so that parts run across siblings.
_DX_SPLIT_TILES = dataclasses.replace(TILES, dx_split=4, dx_programs=4)


@pytest.mark.parametrize("planned", [False, True], ids=["scored", "planned"])
@pytest.mark.parametrize("tiles, dtype", [("unsplit", "float32"), ("unsplit", "bfloat16"),
                                          ("split", "float32"), ("split", "bfloat16")])
def test_the_groups_dx_in_one_launch(monkeypatch, dtype, planned, tiles):
  # `dx_pallas` of every sibling: each tile's loop runs through the three N in turn (split over
  # programs across the siblings' boundaries), one launch, against dense float32; dW bitwise
  # the launch per sibling's.
  config = {"unsplit": TILES, "split": _DX_SPLIT_TILES}[tiles]
  monkeypatch.setattr(pallas_backend, "block_config", lambda *args: config)
  mask, x, kernels, dys = _case(dtype, seed=6)
  plan = row_plan(jnp.asarray(mask)) if planned else None
  fn = lambda x, ks: sebp_matmuls(x, ks, impl="interpret", rows=plan)  # noqa: E731
  monkeypatch.setattr(pallas_backend, "_SIBLINGS_DX_ONE_LAUNCH", False)
  per_sibling = _grads(fn, x, kernels, dys)
  assert _kernel_launches(fn, x, kernels, dys).count("sebp_dx") == len(FEATURES)
  monkeypatch.setattr(pallas_backend, "_SIBLINGS_DX_ONE_LAUNCH", True)
  launches = _kernel_launches(fn, x, kernels, dys)
  assert launches.count("sebp_dx") == 1 and launches.count("sebp_dw_siblings") == 1, launches
  dx, dws = _grads(fn, x, kernels, dys)
  # Dense float32 on the same values: one rounding of the whole sum, as the one launch does
  # (bfloat16 autodiff rounds each sibling's dx before adding them).
  f32 = lambda arrays: tuple(a.astype(jnp.float32) for a in arrays)  # noqa: E731
  want_dx, _ = _grads(_dense, x.astype(jnp.float32), f32(kernels), f32(dys))
  assert dx.shape == x.shape and dx.dtype == x.dtype
  assert_close(dx, want_dx, dtype, what="dx")
  if not planned:  # the dropped rows: zeros written by the launch
    np.testing.assert_array_equal(np.asarray(dx)[~mask], 0.0)
  for index, (dw, before) in enumerate(zip(dws, per_sibling[1])):
    np.testing.assert_array_equal(np.asarray(dw), np.asarray(before), err_msg=f"dw[{index}]")


def test_siblings_with_other_dx_tiles_keep_a_launch_each(monkeypatch):
  # The 5-wide sibling on dX tiles of its own: no one launch for three tiles that differ, a
  # launch each (the later ones adding into the first one's dx), the same values.
  monkeypatch.setattr(pallas_backend, "block_config", lambda rows, k, n, dtype: (
    dataclasses.replace(TILES, dx_warps=8) if n == 5 else TILES))
  monkeypatch.setattr(pallas_backend, "_SIBLINGS_DX_ONE_LAUNCH", True)
  mask, x, kernels, dys = _case("float32", seed=7)
  fn = lambda x, ks: sebp_matmuls(x, ks, impl="interpret", rows=row_plan(jnp.asarray(mask)))  # noqa: E731
  assert _kernel_launches(fn, x, kernels, dys).count("sebp_dx") == len(FEATURES)
  assert_close(_grads(fn, x, kernels, dys)[0], _grads(_dense, x, kernels, dys)[0], "float32")


def test_the_one_dx_launch_keeps_nan_and_inf():
  # A NaN in one sibling's kept row and an Inf in another's: the summed dx row is non-finite
  # there and finite everywhere else.
  mask, x, kernels, dys = _case("float32", seed=8)
  dys = (dys[0].at[0, 2, 1].set(jnp.nan), dys[1], dys[2].at[1, 0, 4].set(jnp.inf))
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(pallas_backend, "_SIBLINGS_DX_ONE_LAUNCH", True)
    dx, _ = _grads(lambda x, ks: sebp_matmuls(x, ks, impl="interpret"), x, kernels, dys)
  finite = np.isfinite(np.asarray(dx)).all(axis=-1)
  assert not finite[0, 2] and not finite[1, 0]
  assert finite.sum() == finite.size - 2


def test_the_one_dw_launch_keeps_an_inf_row():
  mask, x, kernels, dys = _case("float32", seed=5)
  dys = dys[:2] + (dys[2].at[0, 1, 3].set(jnp.inf),)
  _, dws = _grads(lambda x, ks: sebp_matmuls(x, ks, impl="interpret"), x, kernels, dys)
  # Row (0, 1) of x times the Inf in column 3: column 3 of the last dW is non-finite, the rest
  # of every dW finite.
  assert not np.isfinite(np.asarray(dws[2])[:, 3]).any()
  assert np.isfinite(np.delete(np.asarray(dws[2]), 3, axis=1)).all()
  assert all(np.isfinite(np.asarray(dw)).all() for dw in dws[:2])


@pytest.mark.gpu
def test_the_groups_dw_in_one_launch_on_the_gpu(monkeypatch):
  # LLaMA-3B-like q, k and v over two sequences of 2048 tokens, 1024 or more of each real (a
  # prefix), on the table's tiles sized for this GPU: each sibling splits its last wave's tiles
  # over rows (two parts of at least 16 row blocks), so the one launch runs three fix-ups at
  # once. Bitwise the launch per sibling (the same programs, the same order of sums), and dense
  # float32 within bfloat16's tolerance.
  monkeypatch.undo()  # the table's tiles, not the small ones
  rng = np.random.default_rng(12)
  lengths = rng.integers(1024, 3072, size=2)
  mask = np.arange(2048)[None, :] < lengths[:, None]
  x = jnp.asarray(rng.standard_normal((2, 2048, 3072)), jnp.bfloat16)
  kernels = tuple(jnp.asarray(rng.standard_normal((3072, n)) / 50, jnp.bfloat16)
                  for n in (3072, 1024, 1024))
  dys = tuple(jnp.asarray(np.where(mask[..., None], rng.standard_normal((2, 2048, n)), 0),
                          jnp.bfloat16) for n in (3072, 1024, 1024))
  plan = row_plan(jnp.asarray(mask))
  monkeypatch.setattr(pallas_backend, "_SIBLINGS_DW_ONE_LAUNCH", False)
  fn = jax.jit(lambda x, ks, dys: _grads(
    lambda x, ks: sebp_matmuls(x, ks, impl="pallas", rows=plan), x, ks, dys))
  per_sibling = fn(x, kernels, dys)
  monkeypatch.setattr(pallas_backend, "_SIBLINGS_DW_ONE_LAUNCH", True)
  fn = jax.jit(lambda x, ks, dys: _grads(
    lambda x, ks: sebp_matmuls(x, ks, impl="pallas", rows=plan), x, ks, dys))
  dws = fn(x, kernels, dys)[1]
  want = _grads(_dense, x.astype(jnp.float32), tuple(k.astype(jnp.float32) for k in kernels),
                tuple(dy.astype(jnp.float32) for dy in dys))[1]
  for index, (dw, before, dense) in enumerate(zip(dws, per_sibling[1], want)):
    np.testing.assert_array_equal(np.asarray(dw), np.asarray(before))
    assert_close(dw, dense, "bfloat16", what=f"dw[{index}]")


@pytest.mark.gpu
@pytest.mark.parametrize("rows, widths", [(16384, (768, 768, 768)), (4096, (8192, 8192))],
                         ids=["bert_qkv", "llama_gate_up"])
def test_the_groups_dx_in_one_launch_on_the_gpu(monkeypatch, rows, widths):
  # BERT-base's q/k/v at batch 32 and LLaMA-3B's gate/up at batch 1 (the latter's dX split two
  # ways), real tokens a prefix of each 512 / 4096-token sequence, on the table's tiles sized
  # for this GPU: one dX launch, within bfloat16's tolerance of dense float32.
  monkeypatch.undo()  # the table's tiles, not the small ones
  monkeypatch.setattr(pallas_backend, "_SIBLINGS_DX_ONE_LAUNCH", True)
  rng = np.random.default_rng(13)
  seq = 512 if rows == 16384 else 4096
  lengths = rng.integers(8, seq // 6, size=rows // seq)
  mask = np.arange(seq)[None, :] < lengths[:, None]
  k = 768 if rows == 16384 else 3072
  x = jnp.asarray(rng.standard_normal((rows // seq, seq, k)), jnp.bfloat16)
  kernels = tuple(jnp.asarray(rng.standard_normal((k, n)) / 50, jnp.bfloat16) for n in widths)
  dys = tuple(jnp.asarray(np.where(mask[..., None], rng.standard_normal((*mask.shape, n)), 0),
                          jnp.bfloat16) for n in widths)
  plan = row_plan(jnp.asarray(mask))
  fn = lambda x, ks: sebp_matmuls(x, ks, impl="pallas", rows=plan)  # noqa: E731
  assert _kernel_launches(fn, x, kernels, dys).count("sebp_dx") == 1
  dx = jax.jit(lambda x, ks, dys: _grads(fn, x, ks, dys)[0])(x, kernels, dys)
  f32 = lambda arrays: tuple(a.astype(jnp.float32) for a in arrays)  # noqa: E731
  want = _grads(_dense, x.astype(jnp.float32), f32(kernels), f32(dys))[0]
  assert_close(dx, want, "bfloat16", what="dx")


def test_one_dw_launch_names_mismatched_arguments():
  x, dyc = jnp.ones((16, 16)), jnp.ones((16, 32))
  perm, count = jnp.arange(16, dtype=jnp.int32), jnp.array([16], jnp.int32)
  with pytest.raises(ValueError, match="2 `dycs`, 1 `configs`"):
    pallas_backend.dw_siblings_pallas(x, [dyc, dyc], perm, count, configs=[TILES],
                                      interpret=True)


def _launches_and_dots(fn, *args):
  """The Pallas kernels (by name) and the output shapes of the dots that ``fn(*args)`` runs."""
  jaxpr = jax.make_jaxpr(fn)(*args)
  return ([str(e.params.get("name", e.params.get("name_and_src_info"))).split()[0]
           for e in iter_eqns(jaxpr) if e.primitive.name == "pallas_call"],
          dot_output_shapes(jaxpr))


@pytest.mark.parametrize("impl", ["xla", "interpret"])
@pytest.mark.parametrize("planned", [False, True], ids=["scored", "planned"])
@pytest.mark.parametrize("wrt", ["x", "kernels", "x and k"])
def test_a_group_runs_only_the_products_autodiff_asks_for(impl, planned, wrt):
  # As sebp_matmul's rule: no dX for an input without gradient, no dW for a frozen kernel
  # (`perturbed` under symbolic zeros); what is asked for equals dense autodiff.
  mask, x, kernels, dys = _case("float32", seed=9)
  plan = row_plan(jnp.asarray(mask)) if planned else None
  biases = _biases("float32")

  def loss(fn, x, ks):
    return sum(jnp.sum(y * dy) for y, dy in zip(fn(x, ks, biases), dys))

  sebp = lambda x, ks, bs: sebp_matmuls(x, ks, bs, impl=impl, rows=plan)  # noqa: E731
  dense = lambda x, ks, bs: tuple(x @ k + b for k, b in zip(ks, bs))  # noqa: E731
  # x and k: the input and the middle kernel differentiated, the other two frozen.
  argnums, split = {"x": (0, None), "kernels": (1, None), "x and k": ((0, 1), 1)}[wrt]

  def grads(fn):
    if split is None:
      return jax.grad(lambda x, ks: loss(fn, x, ks), argnums=argnums)
    return jax.grad(lambda x, k: loss(fn, x, (kernels[0], k, kernels[2])), argnums=argnums)
  args = (x, kernels if split is None else kernels[split])
  got, want = grads(sebp)(*args), grads(dense)(*args)
  jax.tree.map(lambda a, b: assert_close(a, b, "float32"), got, want)

  launches, dots = _launches_and_dots(grads(sebp), *args)
  dw_shapes = [(12, n) for n in FEATURES]
  wanted_dw = {"x": [], "kernels": dw_shapes, "x and k": [dw_shapes[1]]}[wrt]
  if impl == "xla":  # XLA's dots (in each capacity's branch): dW of the asked-for kernels only
    assert sorted({shape for shape in dots if shape in dw_shapes}) == sorted(wanted_dw)
    assert any(shape[-1] == 12 and len(shape) == 2 and shape[0] >= 18 for shape in dots) == (
      wrt != "kernels"), dots
  else:
    assert ("sebp_dx" in launches) == (wrt != "kernels"), launches
    assert ("sebp_dw_siblings" in launches) == bool(wanted_dw), launches


@pytest.mark.parametrize("policy", [sebp_jax.RowPolicy(threshold=0.5),
                                    sebp_jax.RowPolicy(max_rows=4)], ids=["threshold", "top-n"])
def test_inexact_policies_select_per_sibling(policy):
  # Each sibling's gradients are the dense backward of its own dy * keep, as sebp_matmul's.
  _, x, kernels, dys = _case("float32", seed=6, same_rows=False)
  got = _grads(lambda x, ks: sebp_matmuls(x, ks, policy=policy, impl="interpret"), x, kernels,
               dys)
  parts = [_grads(lambda x, k: sebp_matmul(x, k, policy=policy, impl="xla"), x, kernel, dy)
           for kernel, dy in zip(kernels, dys)]
  assert_close(got[0], sum(dx for dx, _ in parts), "float32", what="dx")
  for dw, (_, want) in zip(got[1], parts):
    assert_close(dw, want, "float32")


@pytest.mark.parametrize("crossover", [0.1, 0.9], ids=["dense branch", "sparse branch"])
def test_one_crossover_for_the_group(crossover):
  # Both branches give the bias gradients too: the gather's sums, or XLA's past the crossover.
  _, x, kernels, dys = _case("float32", seed=7, same_rows=False)
  biases = _biases("float32")
  fn = lambda x, ks, bs: sebp_matmuls(x, ks, bs, impl="interpret", crossover=crossover)  # noqa: E731
  _, vjp = jax.vjp(fn, x, kernels, biases)
  assert sum(eqn.primitive.name == "cond"  # the kernels' own `pl.when`s are conds too
             for eqn in iter_eqns(jax.make_jaxpr(vjp)(dys), into_kernels=False)) == 1
  dx, dws, dbs = vjp(dys)
  want_dx, want_dws = _grads(_dense, x, kernels, dys)
  assert_close(dx, want_dx, "float32", what="dx")
  for dw, want in zip(dws, want_dws):
    assert_close(dw, want, "float32")
  for db, dy in zip(dbs, dys):
    assert_close(db, jnp.sum(dy, axis=(0, 1)), "float32", what="db")


@pytest.mark.parametrize("impl", IMPLS)
def test_siblings_keeping_different_rows(impl):
  # Per-layer scoring: each sibling keeps its own rows, so the second adds into rows the first
  # left zero and leaves rows it drops as the first wrote them.
  _, x, kernels, dys = _case("float32", seed=1, same_rows=False)
  fn = lambda x, ks: sebp_matmuls(x, ks, impl=impl)  # noqa: E731
  (dx, dws), (want_dx, want_dws) = _grads(fn, x, kernels, dys), _grads(_dense, x, kernels, dys)
  assert_close(dx, want_dx, "float32", what="dx")
  for dw, want in zip(dws, want_dws):
    assert_close(dw, want, "float32")


@pytest.mark.parametrize("impl", IMPLS)
def test_an_unused_sibling_gets_a_zero_gradient(impl):
  _, x, kernels, dys = _case("float32", seed=2)
  def loss(x, ks):
    return sum(jnp.sum(y * d) for y, d in zip(sebp_matmuls(x, ks, impl=impl)[1:], dys[1:]))

  dx, dws = jax.grad(loss, argnums=(0, 1))(x, kernels)
  want_dx, want_dws = _grads(lambda x, ks: _dense(x, ks[1:]), x, kernels, dys[1:])
  assert_close(dx, want_dx, "float32")
  assert not np.asarray(dws[0]).any()
  for dw, want in zip(dws[1:], want_dws[1:]):
    assert_close(dw, want, "float32")


def test_rows_declared_unsharded_take_the_per_sibling_path():
  _, x, kernels, dys = _case("float32", seed=3)
  with sharded_rows(()):
    (dx, dws) = _grads(lambda x, ks: sebp_matmuls(x, ks, impl="interpret"), x, kernels, dys)
  want_dx, want_dws = _grads(_dense, x, kernels, dys)
  assert_close(dx, want_dx, "float32")
  for dw, want in zip(dws, want_dws):
    assert_close(dw, want, "float32")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows, policy", [
  ("planned", sebp_jax.RowPolicy()),
  ("scored", sebp_jax.RowPolicy()),
  ("scored", sebp_jax.RowPolicy(threshold=0.5)),
  ("scored", sebp_jax.RowPolicy(max_rows=4)),
], ids=["planned", "scored exact", "threshold", "top-n"])
def test_bias_gradients_are_full_row_sums(impl, dtype, rows, policy):
  # Inside the rule, summed by the shared gather where there is one (exact policy, plan), else
  # by XLA; under every policy the full float32 row sum of each dy, as dense autodiff's. The
  # products' gradients are those of sebp_matmuls without biases (the same rule).
  mask, x, kernels, dys = _case(dtype, seed=8, same_rows=rows == "planned")
  biases = _biases(dtype, with_none=True)
  plan = row_plan(jnp.asarray(mask)) if rows == "planned" else None
  fn = lambda x, ks, bs: sebp_matmuls(x, ks, bs, policy=policy, impl=impl, rows=plan)  # noqa: E731
  ys, vjp = jax.vjp(fn, x, kernels, biases)
  dx, dws, dbs = vjp(dys)
  for y, kernel, bias in zip(ys, kernels, biases):
    want = x @ kernel if bias is None else x @ kernel + bias
    assert y.dtype == jnp.dtype(dtype)
    assert_close(y, want, dtype, what="y")
  assert dbs[1] is None
  for index in (0, 2):
    want = jnp.sum(dys[index].astype(jnp.float32), axis=(0, 1)).astype(dtype)
    assert dbs[index].dtype == jnp.dtype(dtype)
    assert_close(dbs[index], want, dtype, what=f"db[{index}]")
  without = _grads(lambda x, ks: sebp_matmuls(x, ks, policy=policy, impl=impl, rows=plan), x,
                   kernels, dys)
  assert_close(dx, without[0], dtype, what="dx")
  for dw, want in zip(dws, without[1]):
    assert_close(dw, want, dtype, what="dw")


@pytest.mark.parametrize("planned", [False, True], ids=["scored", "planned"])
def test_the_shared_gather_sums_the_bias_gradients(planned):
  # No reduction of a whole dy in the backward: the bias gradients come out of the gather (a few
  # partial rows, summed), not from XLA reading each (rows, N_i) dy again.
  mask, x, kernels, dys = _case("float32", seed=9)
  plan = row_plan(jnp.asarray(mask)) if planned else None
  fn = lambda x, ks, bs: sebp_matmuls(x, ks, bs, impl="interpret", rows=plan)  # noqa: E731
  _, vjp = jax.vjp(fn, x, kernels, _biases("float32"))
  # Reductions of matrices: the interpreted gather's over a tile's rows and XLA's over its
  # partial rows, both fewer than dy's 18 rows; none over dy itself, (2, 9, N_i) or (18, N_i).
  reduced = [tuple(eqn.invars[0].aval.shape) for eqn in iter_eqns(jax.make_jaxpr(vjp)(dys))
             if eqn.primitive.name == "reduce_sum" and eqn.invars[0].aval.ndim > 1]
  assert reduced and not [shape for shape in reduced
                          if shape[:2] == SHAPE or shape[0] >= SHAPE[0] * SHAPE[1]], reduced
  dbs = vjp(dys)[2]
  for db, dy in zip(dbs, dys):
    assert_close(db, jnp.sum(dy, axis=(0, 1)), "float32")


@pytest.mark.parametrize("impl", IMPLS)
def test_a_nan_row_reaches_the_bias_gradient(impl):
  # A row with a NaN is kept (the exact policy never drops what it cannot prove zero), so the
  # gather's sum carries it.
  mask, x, kernels, dys = _case("float32", seed=10)
  dys = (dys[0].at[1, 1, 2].set(jnp.nan),) + dys[1:]
  _, vjp = jax.vjp(lambda x, ks, bs: sebp_matmuls(x, ks, bs, impl=impl), x, kernels,
                   _biases("float32"))
  dbs = vjp(dys)[2]
  assert np.isnan(np.asarray(dbs[0])[2]) and np.isfinite(np.delete(np.asarray(dbs[0]), 2)).all()
  assert np.isfinite(np.asarray(dbs[1])).all()


def test_bad_input_is_named():
  x = jnp.ones((2, 3, 4))
  with pytest.raises(ValueError, match="`kernels` must hold at least one weight"):
    sebp_matmuls(x, ())
  with pytest.raises(ValueError, match="expects 5"):
    sebp_matmuls(x, (jnp.ones((4, 2)), jnp.ones((5, 2))))
  with pytest.raises(ValueError, match="one bias .or None. per kernel"):
    sebp_matmuls(x, (jnp.ones((4, 2)), jnp.ones((4, 3))), (jnp.ones(2),))
  with pytest.raises(ValueError, match="`bias` must have shape \\(3,\\)"):
    sebp_matmuls(x, (jnp.ones((4, 2)), jnp.ones((4, 3))), (None, jnp.ones(2)))


# --- dense_siblings: the same group through flax.linen and swap_dense ----------------------------

import flax.linen as nn  # noqa: E402

from sebp_jax.linen import dense_siblings, swap_dot_general  # noqa: E402


class _Siblings(nn.Module):
  """q, k and v of one input, as an attention layer makes them (v without a bias)."""

  grouped: bool = True
  dtype: jnp.dtype | None = None

  @nn.compact
  def __call__(self, x):
    layers = [nn.Dense(n, use_bias=name != "v", dtype=self.dtype, name=name)
              for n, name in zip(FEATURES, ("q", "k", "v"))]
    ys = dense_siblings(layers, x) if self.grouped else tuple(layer(x) for layer in layers)
    return sum(jnp.sum(jnp.sin(y.astype(jnp.float32))) for y in ys)


def _module_case():
  mask, x, *_ = _case("float32", seed=4)
  x = jnp.where(jnp.asarray(mask)[..., None], x, 0.0)
  params = _Siblings().init(jax.random.key(0), x)
  return x, params


def _loss_grads(module, params, x, swap=None):
  def loss(params, x):
    with swap or contextlib.nullcontext():
      return module.apply(params, x)
  return jax.grad(loss, argnums=(0, 1))(params, x)


def test_without_a_swap_siblings_are_the_separate_layers():
  x, params = _module_case()
  assert _Siblings().apply(params, x) == _Siblings(grouped=False).apply(params, x)
  assert (jax.tree.structure(params)
          == jax.tree.structure(_Siblings(grouped=False).init(jax.random.key(0), x)))


@pytest.mark.parametrize("impl", IMPLS)
def test_one_backward_for_the_group_under_swap_dense(impl):
  x, params = _module_case()
  got = _loss_grads(_Siblings(), params, x, sebp_jax.swap_dense(impl=impl))
  separate = _loss_grads(_Siblings(grouped=False), params, x, sebp_jax.swap_dense(impl=impl))
  dense = _loss_grads(_Siblings(), params, x)
  for want in (separate, dense):
    jax.tree.map(lambda a, b: assert_close(a, b, "float32"), got, want)
  with sebp_jax.swap_dense(impl=impl) as report:
    forward = str(jax.make_jaxpr(_Siblings().apply)(params, x))
  assert forward.count("custom_vjp_call") == 1  # one rule for q, k and v
  assert [layer.path for layer in report.layers] == [("q",), ("k",), ("v",)]


@pytest.mark.parametrize("impl", IMPLS)
def test_a_bfloat16_group_of_float32_parameters(impl):
  # The layers compute in bfloat16 from float32 parameters: each bias is promoted as nn.Dense
  # promotes it before it enters the group's rule, and its gradient comes back in float32.
  x, params = _module_case()
  model = _Siblings(dtype=jnp.bfloat16)
  with sebp_jax.swap_dense(impl=impl):
    outputs = model.apply(params, x)
  assert_close(outputs, model.apply(params, x), "bfloat16")
  got = _loss_grads(model, params, x, sebp_jax.swap_dense(impl=impl))
  want = _loss_grads(_Siblings(grouped=False, dtype=jnp.bfloat16), params, x)
  assert got[0]["params"]["q"]["bias"].dtype == jnp.float32
  jax.tree.map(lambda a, b: assert_close(a, b, "bfloat16"), got, want)


def test_a_group_the_swap_splits_runs_layer_by_layer():
  x, params = _module_case()
  only_q = sebp_jax.swap_dense(impl="xla", where=lambda path: path[-1] == "q")
  with only_q as report:
    forward = str(jax.make_jaxpr(_Siblings().apply)(params, x))
  assert forward.count("custom_vjp_call") == 1 and len(report.layers) == 1
  got = _loss_grads(_Siblings(), params, x, sebp_jax.swap_dense(
    impl="xla", where=lambda path: path[-1] == "q"))
  jax.tree.map(lambda a, b: assert_close(a, b, "float32"), got, _loss_grads(_Siblings(), params, x))


def test_another_dot_general_runs_layer_by_layer():
  calls = []

  def counting(*args, **kwargs):
    calls.append(1)
    return jax.lax.dot_general(*args, **kwargs)

  x, params = _module_case()
  with swap_dot_general(counting):
    got = _Siblings().apply(params, x)
  assert len(calls) == 3 and got == _Siblings().apply(params, x)


# --- a lone Dense's bias inside its rule (linen._LONE_BIAS_IN_RULE) -------------------------------

from sebp_jax import linen as sebp_linen  # noqa: E402


class _Mlp(nn.Module):
  """BERT's feed-forward block in small: up (biased) and GELU, then down (no bias here)."""

  @nn.compact
  def __call__(self, x):
    h = nn.gelu(nn.Dense(FEATURES[0], name="up")(x), approximate=False)
    return nn.Dense(FEATURES[1], use_bias=False, name="down")(h)


def _mlp_case():
  mask, x, *_ = _case("float32", seed=12)
  x = jnp.where(jnp.asarray(mask)[..., None], x, 0.0)
  dy = jnp.asarray(np.where(mask[..., None], np.random.default_rng(13).standard_normal(
    (*SHAPE, FEATURES[1])), 0.0), jnp.float32)
  return mask, x, dy, _Mlp().init(jax.random.key(1), x)


def _mlp_vjp(params, x, swap):
  def apply(params, x):
    with swap:
      return _Mlp().apply(params, x)
  return jax.vjp(apply, params, x)[1]


@pytest.fixture
def lone_bias_in_rule(monkeypatch):
  monkeypatch.setattr(sebp_linen, "_LONE_BIAS_IN_RULE", True)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("planned", [False, True], ids=["scored", "planned"])
def test_a_lone_dense_with_its_bias_in_the_rule(lone_bias_in_rule, impl, planned):
  # The same gradients as dense autodiff (the bias's: dy's full row sum), one rule per layer,
  # each layer reported once, the parameters init makes under the swap the layers' own.
  mask, x, dy, params = _mlp_case()
  plan = row_plan(jnp.asarray(mask)) if planned else None
  swap = sebp_jax.swap_dense(impl=impl, rows=plan)
  got = _mlp_vjp(params, x, swap)(dy)
  want = _mlp_vjp(params, x, contextlib.nullcontext())(dy)
  jax.tree.map(lambda a, b: assert_close(a, b, "float32"), got, want)
  with sebp_jax.swap_dense(impl=impl, rows=plan) as report:
    forward = str(jax.make_jaxpr(_Mlp().apply)(params, x))
    init = _Mlp().init(jax.random.key(1), x)
  assert forward.count("custom_vjp_call") == 2
  assert [layer.path for layer in report.layers] == [("up",), ("down",)]
  assert jax.tree.structure(init) == jax.tree.structure(params)


@pytest.mark.parametrize("planned", [False, True], ids=["scored", "planned"])
def test_a_lone_dense_bias_is_summed_by_its_gather(monkeypatch, planned):
  # With the flag, no reduction over up's whole dy in the backward: its gather sums the kept rows
  # it copies. Without it, autodiff of the bias add is that reduction.
  mask, x, dy, params = _mlp_case()
  plan = row_plan(jnp.asarray(mask)) if planned else None

  def whole_dy_sums(flag):
    monkeypatch.setattr(sebp_linen, "_LONE_BIAS_IN_RULE", flag)
    vjp = _mlp_vjp(params, x, sebp_jax.swap_dense(impl="interpret", rows=plan))
    return [eqn for eqn in iter_eqns(jax.make_jaxpr(vjp)(dy)) if eqn.primitive.name == "reduce_sum"
            and eqn.invars[0].aval.shape in ((*SHAPE, FEATURES[0]), (18, FEATURES[0]))]

  assert whole_dy_sums(False) and not whole_dy_sums(True)


def test_a_lone_dense_in_a_group_stays_in_its_group(lone_bias_in_rule):
  # Inside dense_siblings, each layer is captured for the group's rule, not made a group of its
  # own: q, k and v still share one rule.
  x, params = _module_case()
  with sebp_jax.swap_dense(impl="xla"):
    forward = str(jax.make_jaxpr(_Siblings().apply)(params, x))
  assert forward.count("custom_vjp_call") == 1
  got = _loss_grads(_Siblings(), params, x, sebp_jax.swap_dense(impl="xla"))
  jax.tree.map(lambda a, b: assert_close(a, b, "float32"), got, _loss_grads(_Siblings(), params, x))


# --- linear_siblings: the same group through flax.nnx ---------------------------------------------

from flax import nnx  # noqa: E402

from sebp_jax.nnx import SEBPLinear, linear_siblings, swap_linear  # noqa: E402


def _nnx_layers(make=nnx.Linear, **kwargs):
  """q, k and v as an ``nnx.List`` (a module: what ``swap_linear`` takes)."""
  return nnx.List([make(12, n, rngs=nnx.Rngs(seed), **kwargs) for seed, n in enumerate(FEATURES)])


def _nnx_loss_grads(layers, x, grouped=True):
  def loss(layers, x):
    ys = linear_siblings(layers, x) if grouped else tuple(layer(x) for layer in layers)
    return sum(jnp.sum(jnp.sin(y)) for y in ys)
  graph, state = nnx.split(layers)
  return jax.grad(lambda state, x: loss(nnx.merge(graph, state), x), argnums=(0, 1))(state, x)


def _nnx_x():
  mask, x, *_ = _case("float32", seed=5)
  return jnp.where(jnp.asarray(mask)[..., None], x, 0.0)


def _rules(layers, x):
  return str(jax.make_jaxpr(lambda x: linear_siblings(layers, x))(x)).count("custom_vjp_call")


@pytest.mark.parametrize("impl", IMPLS)
def test_nnx_one_backward_for_the_group_under_swap_linear(impl):
  x, dense = _nnx_x(), _nnx_layers()
  want = _nnx_loss_grads(dense, x)
  assert all(jnp.array_equal(a, b) for a, b in zip(linear_siblings(dense, x),
                                                   (layer(x) for layer in dense)))
  swapped = _nnx_layers()
  swap_linear(swapped, impl=impl)
  assert _rules(swapped, x) == 1  # one rule for q, k and v
  for ys, zs in zip(linear_siblings(swapped, x), (layer(x) for layer in swapped)):
    assert_close(ys, zs, "float32")
  for got in (_nnx_loss_grads(swapped, x), _nnx_loss_grads(swapped, x, grouped=False)):
    jax.tree.map(lambda a, b: assert_close(a, b, "float32"), got, want)


def test_nnx_sebp_linear_layers_of_one_policy_group():
  x = _nnx_x()
  layers = _nnx_layers(SEBPLinear, impl="xla", use_bias=False)
  assert _rules(layers, x) == 1
  jax.tree.map(lambda a, b: assert_close(a, b, "float32"), _nnx_loss_grads(layers, x),
               _nnx_loss_grads(_nnx_layers(use_bias=False), x))


@pytest.mark.parametrize("change", ["one dense", "other impl", "float32 output"])
def test_nnx_a_mixed_group_runs_layer_by_layer(change):
  x, layers = _nnx_x(), _nnx_layers()
  swap_linear(layers, impl="xla")
  if change == "one dense":
    layers[1].dot_general = jax.lax.dot_general
  elif change == "other impl":
    swap_linear(layers[2], impl="interpret")
  else:
    layers[0].preferred_element_type = jnp.float32
  assert _rules(layers, x) == (2 if change == "one dense" else 3)
  jax.tree.map(lambda a, b: assert_close(a, b, "float32"), _nnx_loss_grads(layers, x),
               _nnx_loss_grads(_nnx_layers(), x))


def test_nnx_bad_input_is_named():
  with pytest.raises(ValueError, match="`layers` must hold at least one layer"):
    linear_siblings([], jnp.ones((2, 3)))
