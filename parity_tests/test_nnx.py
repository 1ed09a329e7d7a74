"""flax.nnx integration: SEBPLinear against nnx.Linear, swap_linear on a padded model."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from parity_tests import reference
from parity_tests.ids import kwargs_id
from parity_tests.impls import impl_params, implements
from parity_tests.jaxprs import count_primitive
from parity_tests.tolerances import assert_close
from sebp_jax import RowPolicy
from sebp_jax.matmul import SEBPDotGeneral
from sebp_jax.nnx import SEBPLinear, swap_linear

IMPLS = impl_params()


def _assert_states_close(actual, expected, what: str) -> None:
  actual, expected = nnx.to_pure_dict(actual), nnx.to_pure_dict(expected)
  assert jax.tree.structure(actual) == jax.tree.structure(expected), what
  for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(actual),
                               jax.tree.leaves(expected)):
    assert got.dtype == want.dtype, f"{what}{jax.tree_util.keystr(path)}: dtype"
    assert_close(got, want, what=f"{what}{jax.tree_util.keystr(path)}")


LINEAR_CONFIGS = [
  dict(),
  dict(use_bias=False),
  dict(param_dtype=jnp.bfloat16, dtype=jnp.bfloat16),
  dict(kernel_init=nnx.initializers.normal(0.3), bias_init=nnx.initializers.ones),
]


@pytest.mark.parametrize("config", LINEAR_CONFIGS, ids=kwargs_id)
def test_sebp_linear_params_equal_linear_params(config):
  sebp = SEBPLinear(11, 7, policy=RowPolicy(max_rows=2), rngs=nnx.Rngs(3), **config)
  dense = nnx.Linear(11, 7, rngs=nnx.Rngs(3), **config)
  got, want = nnx.to_pure_dict(nnx.state(sebp, nnx.Param)), nnx.to_pure_dict(nnx.state(dense, nnx.Param))
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)


def _padded(seed, shape=(3, 14), features=11):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, shape[-1] + 1, size=shape[:-1] + (1,))
  real = (np.arange(shape[-1]) < lengths)[..., None]
  return jnp.asarray(rng.standard_normal(shape + (features,)) * real, jnp.float32), real


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("policy", [RowPolicy(), RowPolicy(threshold=0.5), RowPolicy(max_rows=4)],
                         ids=str)
def test_sebp_linear_matches_reference(impl, policy):
  if not implements(impl, policy):
    pytest.skip(f"{impl} implements the exact policy only")
  layer = SEBPLinear(11, 6, policy=policy, impl=impl, rngs=nnx.Rngs(0))
  x, real = _padded(1)
  g = jnp.asarray(np.random.default_rng(2).standard_normal((3, 14, 6)) * real, jnp.float32)
  grads, dx = nnx.grad(lambda m, x: jnp.sum(m(x) * g), argnums=(0, 1))(layer, x)
  exp_dx, exp_dk, exp_db = reference.sebp_reference(x, layer.kernel[...], layer.bias[...], g,
                                                    policy.threshold, policy.max_rows)
  assert_close(dx, exp_dx, what="dx")
  assert_close(grads.kernel[...], exp_dk, what="dkernel")
  assert_close(grads.bias[...], exp_db, what="dbias")


def test_sebp_linear_rejects_dot_general_and_bad_arguments():
  with pytest.raises(ValueError, match=r"`dot_general` is SEBP's own"):
    SEBPLinear(3, 4, dot_general=jax.lax.dot_general, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"`impl` must be one of"):
    SEBPLinear(3, 4, impl="triton", rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match=r"`policy` must be a RowPolicy"):
    SEBPLinear(3, 4, policy=0.0, rngs=nnx.Rngs(0))


class _Model(nnx.Module):
  """A projection, a two-layer MLP in an ``nnx.List``, and a head: four nnx.Linear."""

  def __init__(self, rngs: nnx.Rngs, features: int = 11, hidden: int = 17):
    self.proj = nnx.Linear(features, features, rngs=rngs)
    self.mlp = nnx.List([nnx.Linear(features, hidden, rngs=rngs),
                         nnx.Linear(hidden, features, rngs=rngs)])
    self.head = nnx.Linear(features, 5, rngs=rngs)

  def __call__(self, x):
    x = x + nnx.relu(self.proj(x))
    x = x + self.mlp[1](nnx.gelu(self.mlp[0](x)))
    return self.head(x)


_PATHS = [("proj",), ("mlp", "0"), ("mlp", "1"), ("head",)]


def _loss(model, x, real):
  """Mean squared output over the real tokens only: padded rows get a zero gradient."""
  return jnp.sum(jnp.where(real, model(x), 0.0) ** 2) / jnp.sum(real)


def _sebp_paths(model) -> list[tuple[str, ...]]:
  return [tuple(str(p) for p in path) for path, m in nnx.iter_graph(model)
          if isinstance(m, nnx.Linear) and isinstance(m.dot_general, SEBPDotGeneral)]


@pytest.mark.parametrize("impl", IMPLS)
def test_swap_linear_gradients_equal_dense(impl):
  model = _Model(nnx.Rngs(0))
  x, real = _padded(4)
  expected = nnx.jit(nnx.grad(_loss, argnums=(0, 1)))(model, x, real)
  assert len(swap_linear(model, impl=impl)) == 4
  assert sorted(_sebp_paths(model)) == sorted(_PATHS)
  got = nnx.jit(nnx.grad(_loss, argnums=(0, 1)))(model, x, real)
  _assert_states_close(got[0], expected[0], "grad")
  assert_close(got[1], expected[1], what="dx")


@pytest.mark.parametrize("where, expected", [
  (lambda path: path[0] == "mlp", [("mlp", "0"), ("mlp", "1")]),
  (lambda path: path == ("head",), [("head",)]),
  (lambda path: False, []),
], ids=["mlp", "head", "none"])
def test_swap_linear_honours_where(where, expected):
  model = _Model(nnx.Rngs(0))
  seen = []
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    report = swap_linear(model, where=lambda path: seen.append(path) or where(path))
  assert sorted(layer.path for layer in report) == sorted(expected)
  # A `where` that selects nothing says so.
  assert [str(w.message) for w in caught if "selected none" in str(w.message)] == (
    [] if expected else ["swap_linear: `where` selected none of the 4 layer(s) it was asked "
                         "about (head, mlp/0, mlp/1, proj); every layer stays dense."])
  assert sorted(_sebp_paths(model)) == sorted(expected)
  assert sorted(seen) == sorted(_PATHS), "`where` gets every Linear's path, as strings"


def test_swap_linear_changes_only_selected_layers():
  # max_rows=1 drops rows in the selected first MLP layer only: its kernel gradient changes; the
  # head and the second MLP layer, after it and not selected, keep their exact gradients.
  model = _Model(nnx.Rngs(1))
  x, real = _padded(5)
  expected = nnx.grad(_loss)(model, x, real)
  swap_linear(model, RowPolicy(max_rows=1), where=lambda path: path == ("mlp", "0"), impl="xla")
  got = nnx.grad(_loss)(model, x, real)
  _assert_states_close(nnx.state(got.head), nnx.state(expected.head), "head grad")
  _assert_states_close(nnx.state(got.mlp[1]), nnx.state(expected.mlp[1]), "mlp[1] grad")
  assert not np.allclose(got.mlp[0].kernel[...], expected.mlp[0].kernel[...])


def test_swap_linear_leaves_custom_dot_general_alone():
  model = _Model(nnx.Rngs(0))
  custom = lambda *args, **kwargs: jax.lax.dot_general(*args, **kwargs)
  model.head.dot_general = custom
  assert len(swap_linear(model)) == 3
  assert model.head.dot_general is custom


@pytest.mark.parametrize("impl", IMPLS)
def test_one_trace_across_batches_of_different_padding(impl):
  model = _Model(nnx.Rngs(2))
  swap_linear(model, impl=impl)
  traces = []

  @nnx.jit
  def grad(model, x, real):
    traces.append(None)
    return nnx.grad(_loss)(model, x, real)

  dense = _Model(nnx.Rngs(2))
  dense_grad = nnx.jit(nnx.grad(_loss))
  for seed in range(4):
    x, real = _padded(10 + seed)
    _assert_states_close(grad(model, x, real), dense_grad(dense, x, real), f"batch {seed}")
  assert len(traces) == 1


@pytest.mark.parametrize("crossover,conds", [(None, 1), (1.0, 0)])
def test_crossover_reaches_the_backward(crossover, conds):
  # Through SEBPLinear and through swap_linear: 1.0 compiles the dense-branch conditional out.
  x = jax.random.normal(jax.random.key(0), (2, 9, 5))
  built = SEBPLinear(5, 7, impl="interpret", crossover=crossover, rngs=nnx.Rngs(0))
  swapped = nnx.Linear(5, 7, rngs=nnx.Rngs(0))
  assert len(swap_linear(swapped, impl="interpret", crossover=crossover)) == 1
  for layer in (built, swapped):
    grad = nnx.grad(lambda layer: jnp.sum(layer(x) ** 2))
    assert count_primitive(jax.make_jaxpr(grad)(layer), "cond", into_kernels=False) == conds


def test_bad_crossover_is_named_when_the_layer_is_built():
  with pytest.raises(ValueError, match="`crossover`"):
    SEBPLinear(5, 7, crossover=0.0, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="`crossover`"):
    swap_linear(nnx.Linear(5, 7, rngs=nnx.Rngs(0)), crossover="high")
