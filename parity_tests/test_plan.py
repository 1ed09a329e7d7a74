"""Row plans (``row_plan``, ``rows=``): the kept rows handed in once per step.

The definition under test (DESIGN §2, "Row plan"): with a plan, ``dx``/``dw`` are the dense
backward of ``dy * plan[:, None]``, whatever ``dy`` holds outside the plan; a checking plan raises
an error naming the layer when a row outside it is non-zero or non-finite; layers whose leading
dims are not the plan's score ``dy`` as usual. Every backend is held to it, against the dense
float32 reference of :mod:`parity_tests.reference`.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parity_tests.impls import impl_params
from parity_tests.jaxprs import count_primitive
from parity_tests.reference import dense_vjp, sebp_reference
from parity_tests.tolerances import assert_close
from sebp_jax import RowPlan, RowPolicy, row_plan, sebp_matmul, sebp_value_and_grad, swap_dense

HIGHEST = jax.lax.Precision.HIGHEST


def _padded_batch(rng, lengths, seq_len, in_features, out_features, *, noise=0.0):
  """``x (B, T, K)``, ``kernel (K, N)``, ``dy (B, T, N)`` real on each sequence's prefix (``noise``
  elsewhere) and the ``(B, T)`` int32 mask of real tokens."""
  batch = len(lengths)
  mask = (np.arange(seq_len)[None, :] < np.asarray(lengths)[:, None]).astype(np.int32)
  x = rng.standard_normal((batch, seq_len, in_features)).astype(np.float32)
  kernel = rng.standard_normal((in_features, out_features)).astype(np.float32)
  dy = rng.standard_normal((batch, seq_len, out_features)).astype(np.float32)
  dy = np.where(mask[..., None] > 0, dy, noise * dy).astype(np.float32)
  return jnp.asarray(x), jnp.asarray(kernel), jnp.asarray(dy), jnp.asarray(mask)


def _vjp(impl, x, kernel, dy, plan, **kwargs):
  run = lambda x, k: sebp_matmul(x, k, impl=impl, precision=HIGHEST, rows=plan, **kwargs)
  return jax.jit(lambda x, k, dy: jax.vjp(run, x, k)[1](dy))(x, kernel, dy)


@pytest.mark.parametrize("num_rows", [1, 5, 1023, 1024, 1500])
@pytest.mark.parametrize("density", [0.0, 0.4, 1.0])
def test_plan_is_the_active_first_permutation(num_rows, density):
  keep = np.random.default_rng(num_rows).random(num_rows) < density
  plan = row_plan(jnp.asarray(keep))
  perm, count = np.asarray(plan.perm), int(plan.count[0])
  assert plan.rows_shape == (num_rows,) and len(perm) % 1024 == 0 and len(perm) >= num_rows
  rows = np.arange(num_rows)
  assert count == keep.sum()
  np.testing.assert_array_equal(perm[:count], rows[keep])
  np.testing.assert_array_equal(perm[count:num_rows], rows[~keep])
  np.testing.assert_array_equal(perm[num_rows:], np.arange(num_rows, len(perm)))


@pytest.mark.parametrize("impl", impl_params())
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("lengths", [(5, 0, 17), (0, 0, 0), (17, 17, 17)], ids=str)
def test_planned_backward_is_the_dense_backward_of_the_masked_gradient(impl, dtype, lengths):
  # Outside the plan `dy` is non-zero here: the plan, not dy, decides (the definition), so a
  # backend that still read dy would keep those rows and fail.
  rng = np.random.default_rng(sum(lengths))
  x, kernel, dy, mask = _padded_batch(rng, lengths, 17, 19, 45, noise=1.0)
  cast = lambda a: a.astype(dtype)
  dx, dw = _vjp(impl, cast(x), cast(kernel), cast(dy), row_plan(mask))
  masked = jnp.where(mask[..., None] > 0, cast(dy), 0)
  want_dx, want_dw = dense_vjp(cast(x), cast(kernel), masked)
  if impl == "dense":  # the plain backward: the plan does not apply
    want_dx, want_dw = dense_vjp(cast(x), cast(kernel), cast(dy))
  assert dx.dtype == dtype and dw.dtype == dtype
  assert_close(dx, want_dx, dtype, what="dx")
  assert_close(dw, want_dw, dtype, what="dw")


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_plan_keeps_nonfinite_rows_inside_it(impl):
  rng = np.random.default_rng(1)
  x, kernel, dy, mask = _padded_batch(rng, (4, 9), 12, 7, 20)
  dy = dy.at[1, 3, 5].set(jnp.nan).at[0, 0, 1].set(jnp.inf)
  dx, dw = _vjp(impl, x, kernel, dy, row_plan(mask))
  want_dx, want_dw = sebp_reference(x, kernel, None, dy)
  assert_close(dx, want_dx, jnp.float32, what="dx")
  assert_close(dw, want_dw, jnp.float32, what="dw")


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_layer_of_other_leading_dims_scores_dy(impl):
  # A (B, hidden) pooler under a (B, T) plan: the plan does not describe its rows, so every
  # non-zero row of its dy counts, as without a plan.
  rng = np.random.default_rng(2)
  x, kernel, dy, mask = _padded_batch(rng, (3, 1), 6, 10, 12)
  pooled_x, pooled_dy = x[:, 0], dy[:, 0].at[1].set(0.0)
  dx, dw = _vjp(impl, pooled_x, kernel, pooled_dy, row_plan(mask))
  want_dx, want_dw = sebp_reference(pooled_x, kernel, None, pooled_dy)
  assert_close(dx, want_dx, jnp.float32, what="dx")
  assert_close(dw, want_dw, jnp.float32, what="dw")


@pytest.mark.parametrize("impl", ["xla", "interpret"])
@pytest.mark.parametrize("outside", ["value", "nan"])
def test_checking_plan_names_the_layer_it_catches(impl, outside):
  model = nn.Sequential([nn.Dense(8, name="up"), nn.relu, nn.Dense(4, name="down")])
  rng = np.random.default_rng(3)
  x, _, _, mask = _padded_batch(rng, (3, 6), 6, 5, 4)
  params = model.init(jax.random.key(0), x)
  leak = jnp.nan if outside == "nan" else 1.0
  # The loss weighs one padded row of the output: a plan from the attention mask misses it.
  weights = mask.astype(jnp.float32).at[0, 4].set(leak)

  def loss(params, plan):
    with swap_dense(rows=plan, impl=impl):
      return jnp.sum(model.apply(params, x) * weights[..., None])

  with pytest.raises(Exception, match=r"layer layers_2 has 1 output-gradient row\(s\) outside"):
    jax.block_until_ready(jax.jit(jax.grad(loss))(params, row_plan(mask, check=True)))
  # The same plan unchecked runs, and a plan that covers the row passes the check.
  jax.block_until_ready(jax.jit(jax.grad(loss))(params, row_plan(mask)))
  covering = row_plan(mask.at[0, 4].set(1), check=True)
  jax.block_until_ready(jax.jit(jax.grad(loss))(params, covering))


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_sebp_value_and_grad_with_rows_equals_value_and_grad(impl):
  model = nn.Sequential([nn.Dense(16), nn.gelu, nn.Dense(3)])
  rng = np.random.default_rng(4)
  x, _, _, mask = _padded_batch(rng, (2, 7, 0), 7, 6, 3)
  params = model.init(jax.random.key(0), x)

  def loss(params, x, mask):  # padded rows reach no output: their gradient rows are zero
    return jnp.sum(jnp.tanh(model.apply(params, x)) * mask[..., None])

  want = jax.value_and_grad(loss)(params, x, mask)
  got = jax.jit(sebp_value_and_grad(loss, rows=lambda params, x, mask: mask, check_rows=True,
                                    impl=impl))(params, x, mask)
  jax.tree.map(lambda g, w: assert_close(g, w, jnp.float32), got, want)


def test_plan_skips_the_partition_in_every_planned_layer():
  model = nn.Sequential([nn.Dense(16), nn.relu, nn.Dense(8)])
  x = jnp.ones((2, 16, 8))
  mask = jnp.ones((2, 16), jnp.int32).at[:, 5:].set(0)
  params = model.init(jax.random.key(0), x)

  def kernels(plan):
    def loss(params):
      with swap_dense(impl="interpret", crossover=1.0, rows=plan):
        return jnp.sum(model.apply(params, x) ** 2)
    return count_primitive(jax.make_jaxpr(jax.grad(loss))(params), "pallas_call")

  # Partition and gather in both layers, dX in the second, dW in both; a plan drops partitions.
  assert kernels(None) == 7
  assert kernels(row_plan(mask)) == 5


def test_bad_rows_are_named():
  x, kernel = jnp.ones((2, 3, 4)), jnp.ones((4, 5))
  plan = row_plan(jnp.ones((2, 3)))
  with pytest.raises(TypeError, match="`rows`"):
    sebp_matmul(x, kernel, rows=jnp.ones((2, 3)))
  with pytest.raises(ValueError, match="`rows`.*exact policy"):
    sebp_matmul(x, kernel, rows=plan, policy=RowPolicy(threshold=0.1))
  with pytest.raises(TypeError, match="`mask`"):
    row_plan([[1, 0]])
  with pytest.raises(ValueError, match="`mask`"):
    row_plan(jnp.ones(()))
  with pytest.raises(TypeError, match="`check`"):
    row_plan(jnp.ones((2,)), check="yes")
  with pytest.raises(TypeError, match="`rows`"):
    sebp_value_and_grad(lambda p: p, rows=jnp.ones((2,)))
  assert isinstance(plan, RowPlan) and plan.applies_to(x) and not plan.applies_to(x[0])
