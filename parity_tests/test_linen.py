"""flax.linen integration: SEBPDense against nn.Dense, swap_dense on a padded transformer block."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parity_tests import reference
from parity_tests.ids import kwargs_id
from parity_tests.impls import impl_params, implements
from parity_tests.jaxprs import count_primitive, count_sebp_rules, dot_output_shapes
from parity_tests.tolerances import assert_close
from sebp_jax import RowPolicy, SEBPDense, above_crossover, sebp_value_and_grad, swap_dense

IMPLS = impl_params()


def _assert_trees_close(actual, expected, what: str, dtype=None) -> None:
  assert jax.tree.structure(actual) == jax.tree.structure(expected), what
  for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(actual),
                               jax.tree.leaves(expected)):
    assert got.dtype == want.dtype, f"{what}{jax.tree_util.keystr(path)}: dtype"
    assert_close(got, want, dtype, what=f"{what}{jax.tree_util.keystr(path)}")


# --- SEBPDense ---------------------------------------------------------------------------------

DENSE_CONFIGS = [
  dict(features=7),
  dict(features=5, use_bias=False),
  dict(features=3, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16),
  dict(features=4, kernel_init=nn.initializers.normal(0.3), bias_init=nn.initializers.ones),
]


def test_sebp_dense_named_layers_share_dense_checkpoints():
  # Documented in SEBPDense: linen auto-names a submodule after its class ("SEBPDense_0" where
  # nn.Dense is "Dense_0"), so layers meant to share checkpoints are named explicitly.
  x = jnp.ones((2, 3))
  auto = _TwoLayers(SEBPDense).init(jax.random.key(0), x)
  assert sorted(auto["params"]) == ["SEBPDense_0", "SEBPDense_1"]
  named = _TwoLayers(SEBPDense, named=True).init(jax.random.key(0), x)
  expected = _TwoLayers(nn.Dense, named=True).init(jax.random.key(0), x)
  assert jax.tree.structure(named) == jax.tree.structure(expected)
  for got, want in zip(jax.tree.leaves(named), jax.tree.leaves(expected)):
    np.testing.assert_array_equal(got, want)


class _TwoLayers(nn.Module):
  dense: type[nn.Module]
  named: bool = False

  @nn.compact
  def __call__(self, x):
    names = ("hidden", "out") if self.named else (None, None)  # None: linen names them
    return self.dense(2, name=names[1])(nn.relu(self.dense(4, name=names[0])(x)))


@pytest.mark.parametrize("config", DENSE_CONFIGS, ids=kwargs_id)
def test_sebp_dense_params_equal_dense_params(config):
  x = jnp.ones((2, 9, 11))
  key = jax.random.key(17)
  params = SEBPDense(**config, policy=RowPolicy(max_rows=3)).init(key, x)
  expected = nn.Dense(**config).init(key, x)
  assert jax.tree.structure(params) == jax.tree.structure(expected)
  for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(expected)):
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("config", DENSE_CONFIGS, ids=kwargs_id)
def test_sebp_dense_runs_on_dense_params(impl, config):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((3, 10, 11)), config.get("dtype", jnp.float32))
  dense = nn.Dense(**config)
  params = dense.init(jax.random.key(1), x)
  g = rng.standard_normal((3, 10, config["features"])) * (np.arange(10) < 6)[:, None]
  g = jnp.asarray(g, config.get("dtype", jnp.float32))

  def grads(module):
    loss = lambda p, x: jnp.sum(module.apply(p, x).astype(jnp.float32) * g)
    return jax.grad(loss, argnums=(0, 1))(params, x)

  np.testing.assert_array_equal(SEBPDense(**config, impl=impl).apply(params, x),
                                dense.apply(params, x))
  _assert_trees_close(grads(SEBPDense(**config, impl=impl)), grads(dense), "grad")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("policy", [RowPolicy(threshold=0.8), RowPolicy(max_rows=5)], ids=str)
def test_sebp_dense_policy_matches_reference(impl, policy):
  if not implements(impl, policy):
    pytest.skip(f"{impl} implements the exact policy only")
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((2, 13, 6)), jnp.float32)
  g = jnp.asarray(rng.standard_normal((2, 13, 9)), jnp.float32)
  layer = SEBPDense(9, policy=policy, impl=impl)
  params = layer.init(jax.random.key(2), x)
  dparams, dx = jax.grad(lambda p, x: jnp.sum(layer.apply(p, x) * g), argnums=(0, 1))(params, x)
  p = params["params"]
  exp_dx, exp_dk, exp_db = reference.sebp_reference(x, p["kernel"], p["bias"], g,
                                                    policy.threshold, policy.max_rows)
  assert_close(dx, exp_dx, what="dx")
  assert_close(dparams["params"]["kernel"], exp_dk, what="dkernel")
  assert_close(dparams["params"]["bias"], exp_db, what="dbias")


def test_sebp_dense_bf16_activations_with_f32_params():
  rng = np.random.default_rng(2)
  layer = SEBPDense(8, dtype=jnp.bfloat16, impl="xla")
  x = jnp.asarray(rng.standard_normal((4, 25, 5)), jnp.bfloat16)
  params = layer.init(jax.random.key(3), x)
  g = jnp.asarray(rng.standard_normal((4, 25, 8)) * (rng.random((4, 25, 1)) < 0.3), jnp.bfloat16)
  y, vjp = jax.vjp(layer.apply, params, x)
  assert y.dtype == jnp.bfloat16
  dparams, dx = vjp(g)
  p = dparams["params"]
  assert dx.dtype == jnp.bfloat16 and p["kernel"].dtype == p["bias"].dtype == jnp.float32
  kernel_bf16 = params["params"]["kernel"].astype(jnp.bfloat16)
  exp_dx, exp_dk = reference.sebp_reference(x, kernel_bf16, None, g)
  assert_close(dx, exp_dx, jnp.bfloat16, what="dx")
  assert_close(p["kernel"], exp_dk, jnp.bfloat16, what="dkernel (bf16 matmul, f32 param)")


@pytest.mark.parametrize("kwargs, error, message", [
  (dict(impl="gpu"), ValueError, r"`impl` must be one of"),
  (dict(policy="exact"), TypeError, r"`policy` must be a RowPolicy, got str"),
  (dict(dot_general=jax.lax.dot_general), ValueError, r"`dot_general` and `dot_general_cls` are"),
  (dict(dot_general_cls=lambda: jax.lax.dot_general), ValueError, r"leave them unset"),
])
def test_sebp_dense_rejects_bad_attributes(kwargs, error, message):
  with pytest.raises(error, match=message):
    SEBPDense(4, **kwargs)


# --- a padded transformer block built from plain nn.Dense --------------------------------------


class Block(nn.Module):
  """Pre-LN self-attention + MLP over ``(B, T, D)`` with a key-padding mask, then a token head."""

  dim: int = 12
  heads: int = 3
  hidden: int = 20
  classes: int = 5

  @nn.compact
  def __call__(self, x, mask):
    b, t, _ = x.shape
    h = nn.LayerNorm(name="ln_attn")(x)
    split = lambda z: z.reshape(b, t, self.heads, self.dim // self.heads)
    q, k, v = (split(nn.Dense(self.dim, name=n)(h)) for n in ("query", "key", "value"))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(self.dim // self.heads)
    logits = jnp.where(mask[:, None, None, :], logits, -1e9)
    attn = jnp.einsum("bhqk,bkhd->bqhd", nn.softmax(logits, axis=-1), v).reshape(b, t, self.dim)
    x = x + nn.Dense(self.dim, name="out")(attn)
    h = nn.LayerNorm(name="ln_mlp")(x)
    h = nn.Dense(self.dim, name="down")(nn.gelu(nn.Dense(self.hidden, name="up")(h)))
    return nn.Dense(self.classes, name="head")(x + h)


LAYERS = ("query", "key", "value", "out", "up", "down", "head")


def _padded_batch(seed: int, batch: int = 3, tokens: int = 16, dim: int = 12):
  """Inputs, a right-padding mask with random lengths (one sequence full) and labels."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, tokens, size=batch)
  lengths[0] = tokens
  mask = np.arange(tokens) < lengths[:, None]
  x = rng.standard_normal((batch, tokens, dim)).astype(np.float32)
  labels = rng.integers(0, Block.classes, size=(batch, tokens))
  return jnp.asarray(x), jnp.asarray(mask), jnp.asarray(labels)


def _loss(params, x, mask, labels, model=Block()):
  """Mean token cross-entropy over the real tokens only."""
  logp = nn.log_softmax(model.apply(params, x, mask))
  nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
  return jnp.sum(jnp.where(mask, nll, 0.0)) / jnp.sum(mask)


@functools.lru_cache
def _block_params():
  x, mask, _ = _padded_batch(0)
  return Block().init(jax.random.key(0), x, mask)


@pytest.mark.parametrize("impl", IMPLS)
def test_swap_dense_gradients_equal_dense_on_padded_block(impl):
  params = _block_params()
  x, mask, labels = _padded_batch(1)
  grad = jax.grad(lambda *args: _loss(*args), argnums=(0, 1))  # a fresh trace
  expected = jax.jit(grad)(params, x, mask, labels)

  def sebp(fn):
    def run(*args):
      with swap_dense(impl=impl):
        return fn(*args)
    return run

  if impl != "dense":  # the swap reached every layer's matmul: one custom rule each
    assert count_primitive(jax.make_jaxpr(sebp(_loss))(params, x, mask, labels),
                           "custom_vjp_call") == len(LAYERS)
  _assert_trees_close(jax.jit(sebp(grad))(params, x, mask, labels), expected, "grad")


def _sebp_layers(where, x, mask, **swap_kwargs) -> list[str]:
  """Names of the Dense layers that run with SEBP under ``swap_dense(where=where)``.

  A spy interceptor, installed inside ``swap_dense`` (so it runs after it), sees each Dense after
  the swap decided. A fresh function is traced each time: jit's trace cache knows no contexts.
  """
  seen = []

  def spy(next_fun, args, kwargs, context):
    # Any product but lax's, each layer once (a layer run as a group of one is called again).
    if isinstance(context.module, nn.Dense) and context.method_name == "__call__":
      if context.module.dot_general is not None and context.module.name not in seen:
        seen.append(context.module.name)
    return next_fun(*args, **kwargs)

  params = _block_params()  # outside the spy: a first (uncached) init would run every layer too
  with swap_dense(where=where, **swap_kwargs), nn.intercept_methods(spy):
    jaxpr = jax.make_jaxpr(lambda *args: _loss(*args))(
      params, x, mask, jnp.zeros(mask.shape, jnp.int32))
  # Each SEBP layer is one custom_vjp in the traced program: the swap did reach the matmul.
  assert count_sebp_rules(jaxpr) == len(seen)
  return seen


@pytest.mark.parametrize("where, expected", [
  (None, LAYERS),
  (lambda path: path[-1] in ("up", "down"), ("up", "down")),
  (lambda path: path[-1] != "head", LAYERS[:-1]),
  (lambda path: False, ()),
], ids=["all", "mlp", "not_head", "none"])
def test_swap_dense_where_selects_layers(where, expected):
  x, mask, _ = _padded_batch(2)
  if expected:
    assert sorted(_sebp_layers(where, x, mask)) == sorted(expected)
  else:
    with pytest.warns(UserWarning, match="`where` selected none of the 7 layer"):
      assert _sebp_layers(where, x, mask) == []


def test_swap_dense_where_gets_module_paths():
  x, mask, _ = _padded_batch(2)
  paths = []
  _sebp_layers(lambda path: paths.append(path) or True, x, mask)
  assert sorted(set(paths)) == sorted((name,) for name in LAYERS)


def test_swap_dense_where_changes_only_selected_layers():
  # max_rows=1 drops rows: a selected layer's weight gradient changes; the head, nearest the loss
  # and not selected, keeps its exact gradient since nothing after it is SEBP.
  params = _block_params()
  x, mask, labels = _padded_batch(3)
  grad = jax.grad(_loss)
  dense = grad(params, x, mask, labels)
  with swap_dense(RowPolicy(max_rows=1), where=lambda path: path[-1] == "up", impl="xla"):
    sebp = jax.jit(grad)(params, x, mask, labels)
  _assert_trees_close(sebp["params"]["head"], dense["params"]["head"], "head grad")
  _assert_trees_close(sebp["params"]["down"], dense["params"]["down"], "down grad")
  assert not np.allclose(sebp["params"]["up"]["kernel"], dense["params"]["up"]["kernel"])


def test_swap_dense_is_undone_on_exit():
  x, mask, _ = _padded_batch(2)
  with swap_dense():
    pass
  jaxpr = jax.make_jaxpr(lambda *args: _loss(*args))(
    _block_params(), x, mask, jnp.zeros(mask.shape, jnp.int32))
  assert count_primitive(jaxpr, "custom_vjp_call") == 0
  with pytest.warns(UserWarning, match="`where` selected none"):
    assert _sebp_layers(lambda path: False, x, mask) == []


@pytest.mark.parametrize("impl", IMPLS)
def test_one_trace_across_batches_of_different_padding(impl):
  traces = []

  @jax.jit
  def step(params, x, mask, labels):
    traces.append(None)
    with swap_dense(impl=impl):
      return jax.grad(_loss)(params, x, mask, labels)

  params = _block_params()
  dense_step = jax.jit(jax.grad(lambda *args: _loss(*args)))
  for seed in range(4):
    x, mask, labels = _padded_batch(10 + seed)
    _assert_trees_close(step(params, x, mask, labels), dense_step(params, x, mask, labels),
                        f"grad of batch {seed}")
  assert len(traces) == 1 and step._cache_size() == 1


# --- composition: nn.scan, nn.remat, frozen kernels --------------------------------------------


class _Layer(nn.Module):
  dense: type[nn.Module] = nn.Dense

  @nn.compact
  def __call__(self, x, _):
    return nn.tanh(self.dense(x.shape[-1], name="dense")(x)), None


class _Stack(nn.Module):
  """Three layers, stacked by ``nn.scan`` or unrolled, optionally rematerialised."""

  dense: type[nn.Module] = nn.Dense
  scan: bool = True
  remat: bool = False

  @nn.compact
  def __call__(self, x):
    layer = nn.remat(_Layer) if self.remat else _Layer
    if self.scan:
      layers = nn.scan(layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
      return layers(self.dense, name="layers")(x, None)[0]
    for i in range(3):
      x, _ = layer(self.dense, name=f"layers_{i}")(x, None)
    return x


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("scan, remat", [(True, False), (False, True), (True, True)],
                         ids=["scan", "remat", "scan_remat"])
@pytest.mark.parametrize("how", ["SEBPDense", "swap_dense"])
def test_scan_and_remat(impl, scan, remat, how):
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.standard_normal((2, 11, 6)) * (np.arange(11) < 7)[:, None], jnp.float32)
  g = jnp.asarray(rng.standard_normal((2, 11, 6)) * (np.arange(11) < 7)[:, None], jnp.float32)
  dense = _Stack(scan=scan, remat=remat)
  params = dense.init(jax.random.key(5), x)
  loss = lambda model, p, x: jnp.sum(model.apply(p, x) * g)
  expected = jax.grad(functools.partial(loss, dense), argnums=(0, 1))(params, x)
  if how == "SEBPDense":
    model = _Stack(functools.partial(SEBPDense, impl=impl), scan=scan, remat=remat)
    fn = functools.partial(loss, model)
  else:
    def fn(p, x):
      with swap_dense(impl=impl):
        return loss(dense, p, x)
  if impl != "dense":  # the dense backward is plain autodiff: no custom rule to find
    # Unrolled, one SEBP matmul per layer; scanned, the body holds it (nn.scan may trace it twice).
    calls = count_primitive(jax.make_jaxpr(fn)(params, x), "custom_vjp_call")
    assert calls >= 1 if scan else calls == 3, calls
  _assert_trees_close(jax.jit(jax.grad(fn, argnums=(0, 1)))(params, x), expected, "grad")


def test_frozen_dense_kernel_costs_no_weight_gradient():
  layer = SEBPDense(7, impl="xla")
  x = jnp.ones((3, 40, 11))
  params = layer.init(jax.random.key(6), x)
  grad_x = jax.grad(lambda x: jnp.sum(layer.apply(params, x)))
  shapes = dot_output_shapes(jax.make_jaxpr(grad_x)(x))
  assert all(sorted(s) != [7, 11] for s in shapes), shapes


class _TiedOutput(nn.Module):
  """Embedding, one Dense, and the tied output projection ``nn.Embed.attend``."""

  @nn.compact
  def __call__(self, ids):
    embed = nn.Embed(53, 16, name="embed")
    return embed.attend(nn.Dense(16, name="hidden")(embed(ids)))


@pytest.mark.parametrize("impl", impl_params())
def test_swap_dense_reaches_tied_output_projection(impl):
  # The tied projection is a model's largest matmul (LLaMA-3.2's 128K vocabulary): swap_dense
  # gives it the SEBP backward too. A threshold between the quiet and the loud rows of the
  # logits' gradient drops the quiet ones in "attend" only; the reference masks them by hand.
  policy = RowPolicy(threshold=1e-2)
  if not implements(impl, policy):
    pytest.skip(f"{impl} implements the exact policy only")
  model = _TiedOutput()
  ids = jnp.asarray(np.random.default_rng(0).integers(0, 53, (3, 11)))
  params = model.init(jax.random.key(1), ids)
  weight = jnp.asarray(np.where(np.arange(11) < 4, 1.0, 1e-4), jnp.float32)[None, :, None]
  loss = lambda p: jnp.sum(model.apply(p, ids) * weight)
  seen = []
  with swap_dense(policy, impl=impl, where=lambda path: seen.append(path) or path[-1] == "attend"):
    got = jax.grad(loss)(params)
  assert ("embed", "attend") in seen and ("hidden",) in seen

  # Reference: the dense model whose logits' gradient is `weight` with the dropped rows (every
  # quiet token) zeroed, which is what the contract makes of the projection's backward.
  keep = (np.arange(11) < 4)[None, :, None]
  reference_loss = lambda p: jnp.sum(model.apply(p, ids) * jnp.where(keep, weight, 0.0))

  want = jax.grad(reference_loss)(params)
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    assert_close(g, w, jnp.float32, what=jax.tree_util.keystr(path))


@pytest.mark.parametrize("crossover,conds", [(None, 1), (1.0, 0)])
def test_crossover_reaches_the_backward(crossover, conds):
  # Through SEBPDense and through swap_dense: 1.0 compiles the dense-branch conditional out.
  x = jax.random.normal(jax.random.key(0), (2, 9, 5))
  layer = SEBPDense(7, impl="interpret", crossover=crossover)
  params = layer.init(jax.random.key(1), x)
  grad = lambda apply: jax.make_jaxpr(jax.grad(lambda p: jnp.sum(apply(p) ** 2)))(params)
  conds_of = lambda jaxpr: count_primitive(jaxpr, "cond", into_kernels=False)  # noqa: E731
  assert conds_of(grad(lambda p: layer.apply(p, x))) == conds

  def swapped(p):
    with swap_dense(impl="interpret", crossover=crossover):
      return nn.Dense(7).apply(p, x)

  assert conds_of(grad(swapped)) == conds


def test_bad_crossover_is_named_when_the_layer_is_built():
  with pytest.raises(ValueError, match="`crossover`"):
    SEBPDense(3, crossover=0.0)
  with pytest.raises(ValueError, match="`crossover`"):
    with swap_dense(crossover=-1.0):
      pass


# --- sebp_value_and_grad: one crossover per call ------------------------------------------------

def _real_fraction(params, x, mask, labels):
  return jnp.mean(mask)


def _loss_and_branch(params, x, mask, labels):
  """``_loss``, and as aux 1.0 where every Dense ran with SEBP (0.0 where none did): the branch
  the crossover took, read back at run time."""
  swapped = {}

  def spy(next_fun, args, kwargs, context):  # inside the swap: sees each Dense after it
    if isinstance(context.module, nn.Dense) and context.method_name == "__call__":
      # Any product but lax's (a layer run as a group of one is called again, its product
      # captured, then handed back): the swap reached it.
      swapped.setdefault(context.module.name, context.module.dot_general is not None)
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(spy):
    loss = _loss(params, x, mask, labels)
  assert len(swapped) == len(LAYERS) and len(set(swapped.values())) == 1
  return loss, jnp.float32(next(iter(swapped.values())))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("branch", ["sparse", "dense"])
def test_sebp_value_and_grad_equals_dense_on_padded_block(impl, branch):
  # Either branch computes the dense gradients (exact policy); the crossover picks one per call.
  params = _block_params()
  x, mask, labels = _padded_batch(2)
  real = float(jnp.mean(mask))
  crossover = min(real + 0.05, 0.99) if branch == "sparse" else real / 2
  (loss, _), grads = jax.jit(jax.value_and_grad(_loss_and_branch, has_aux=True))(
    params, x, mask, labels)
  fn = sebp_value_and_grad(_loss_and_branch, _real_fraction, crossover=crossover, impl=impl,
                           has_aux=True)
  (got_loss, ran_sparse), got_grads = jax.jit(fn)(params, x, mask, labels)
  assert float(ran_sparse) == (1.0 if branch == "sparse" else 0.0)
  _assert_trees_close((got_loss, got_grads), (loss, grads), f"{branch} branch")


@pytest.mark.parametrize("crossover,conds", [(0.5, 1), (1.0, 0)])
def test_sebp_value_and_grad_compiles_one_conditional_per_call(crossover, conds):
  # The per-layer conditionals are compiled out; the sparse branch still runs every layer's
  # SEBP rule (one custom_vjp each), the dense branch none.
  params = _block_params()
  args = (params, *_padded_batch(3))
  fn = sebp_value_and_grad(lambda *a: _loss(*a), _real_fraction, crossover=crossover,
                           impl="interpret")
  jaxpr = jax.make_jaxpr(fn)(*args)
  assert count_primitive(jaxpr, "cond", into_kernels=False) == conds
  # Pallas kernels in the backward of every layer: the partition, the gather and the dX and dW
  # kernels (the head's dX too: its input is the block's output, which carries a gradient).
  assert count_primitive(jaxpr, "pallas_call") == 4 * len(LAYERS)
  per_layer = sebp_value_and_grad(lambda *a: _loss(*a), _real_fraction, crossover=1.0,
                                  impl="interpret")
  with swap_dense(impl="interpret"):  # the per-layer way: one conditional in every layer
    assert count_primitive(jax.make_jaxpr(jax.value_and_grad(lambda *a: _loss(*a)))(*args),
                           "cond", into_kernels=False) == len(LAYERS)
  assert count_primitive(jax.make_jaxpr(per_layer)(*args), "cond", into_kernels=False) == 0


@pytest.mark.parametrize("fraction,crossover,dense", [
  (0.1, None, False), (0.4, None, False), (0.41, None, True),  # the measured default: 0.4
  (0.3, 0.2, True), (0.2, 0.2, False), (1.0, 1.0, False), (0.0, 0.5, False)])
def test_above_crossover_is_sebp_value_and_grads_rule_on_the_host(fraction, crossover, dense):
  assert above_crossover(fraction, crossover) is dense
  assert above_crossover(np.float64(fraction), crossover) is dense  # a NumPy mask's mean


def test_above_crossover_names_bad_arguments():
  for bad in (-0.1, 1.5, float("nan")):
    with pytest.raises(ValueError, match="`active_fraction`"):
      above_crossover(bad)
  with pytest.raises(ValueError, match="`crossover`"):
    above_crossover(0.2, crossover=0.0)


def test_sebp_value_and_grad_passes_argnums_and_aux():
  params = _block_params()
  x, mask, labels = _padded_batch(4)
  with_aux = lambda p, x, m, l: (_loss(p, x, m, l), jnp.sum(jnp.where(m[..., None], x, 0.0)))
  expected = jax.value_and_grad(with_aux, argnums=(0, 1), has_aux=True)(params, x, mask, labels)
  got = sebp_value_and_grad(with_aux, _real_fraction, crossover=0.99, impl="xla",
                            argnums=(0, 1), has_aux=True)(params, x, mask, labels)
  _assert_trees_close(got, expected, "value, aux and grads")


def test_sebp_value_and_grad_names_bad_arguments():
  loss = lambda *a: _loss(*a)
  with pytest.raises(TypeError, match="`fun`"):
    sebp_value_and_grad(None, _real_fraction)
  with pytest.raises(TypeError, match="`active_fraction`"):
    sebp_value_and_grad(loss, 0.3)
  for bad in (0.0, -1.0, float("nan"), "0.4", True):
    with pytest.raises(ValueError, match="`crossover`"):
      sebp_value_and_grad(loss, _real_fraction, crossover=bad)
  with pytest.raises(ValueError, match="`impl`"):
    sebp_value_and_grad(loss, _real_fraction, impl="triton")
  per_row = sebp_value_and_grad(loss, lambda p, x, m, l: jnp.mean(m, axis=1))
  with pytest.raises(ValueError, match="`active_fraction` must return a real scalar"):
    jax.jit(per_row)(_block_params(), *_padded_batch(5))  # at trace time

