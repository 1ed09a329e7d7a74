"""The bound-definition comparison (``benchmarks/bound_definitions.py``).

Each bound is checked for what it claims to do to a small model: the same forward as dense,
zero gradients for the linear kernels, and which part of the backward survives compilation (the
derivative of a ``sin`` between two linear layers: ``jax-bound`` keeps it; without a bias, whose
gradient reads ``dy``, the looser definitions let XLA or JAX drop it). The steps towards SEBP
(compacted rows, the row plan) must give dense's gradients where the loss ignores the padding. The
tiny BERT runs end to end on the CPU into a temporary folder.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("optax")
import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import bound_definitions, profile_step  # noqa: E402


class _SinBetweenLinears(nn.Module):
  use_bias: bool

  @nn.compact
  def __call__(self, x):
    up = nn.Dense(13, use_bias=self.use_bias, name="up")
    return nn.Dense(5, use_bias=self.use_bias, name="down")(jnp.sin(up(x)))


# Two sequences of 5 tokens, 3 and 2 of them real (a prefix each, as padding is).
_MASK = jnp.array([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]], jnp.int32)


def _compiled_gradient(definition: str, use_bias: bool):
  """The loss sums the squares of the real tokens' outputs only: padding rows get zero ``dy``."""
  model = _SinBetweenLinears(use_bias)
  x = jax.random.normal(jax.random.key(3), (*_MASK.shape, 9))
  params = model.init(jax.random.key(4), x)
  known = bound_definitions.Known(_MASK, bound_definitions.static_capacity([{
    "attention_mask": _MASK}], multiple=2), impl="interpret")

  def loss(params, x):
    with bound_definitions.DEFINITIONS[definition](known):
      return jnp.sum((model.apply(params, x) * _MASK[..., None]) ** 2)

  grad = jax.jit(jax.value_and_grad(loss))
  return grad(params, x), grad.lower(params, x).compile().as_text()


# The bound must still run the backward of everything that is not a linear layer, as SEBP does:
# here sin's derivative, cos, whose result feeds only `up`'s (free) backward. Symbolic zero
# cotangents ("no gradient") let JAX prune it, and XLA prunes it unless something uses `dy`: with
# a bias its gradient does; without one (LLaMA) only jax-bound's read of `dy` can.
@pytest.mark.parametrize("definition, use_bias, keeps_cosine", [
  ("jax-bound", True, True), ("jax-bound", False, True),
  ("zeros, dy unread", True, True), ("zeros, dy unread", False, False),
  ("no gradient", True, False), ("no gradient", False, False)])
def test_definitions_zero_the_kernels_and_keep_or_drop_the_backward_between(
    definition, use_bias, keeps_cosine):
  (value, grads), hlo = _compiled_gradient(definition, use_bias)
  (dense_value, dense_grads), dense_hlo = _compiled_gradient("dense", use_bias)
  np.testing.assert_allclose(value, dense_value, rtol=1e-6)  # the forward is untouched
  grads, dense_grads = grads["params"], dense_grads["params"]
  for layer in ("up", "down"):
    np.testing.assert_array_equal(grads[layer]["kernel"], 0.0)
    assert np.abs(dense_grads[layer]["kernel"]).max() > 0
  assert ("cosine" in dense_hlo) and (("cosine" in hlo) == keeps_cosine)
  if use_bias and definition != "no gradient":  # the bias gradient, a row sum of dy, is exact
    np.testing.assert_allclose(grads["down"]["bias"], dense_grads["down"]["bias"], rtol=1e-5)


@pytest.mark.parametrize("definition", ["compacted rows, cuBLAS", "SEBP, row plan"])
@pytest.mark.parametrize("use_bias", [True, False])
def test_steps_towards_sebp_give_dense_gradients(definition, use_bias):
  (value, grads), _ = _compiled_gradient(definition, use_bias)
  (dense_value, dense_grads), _ = _compiled_gradient("dense", use_bias)
  np.testing.assert_allclose(value, dense_value, rtol=1e-6)
  for path, dense_leaf in jax.tree_util.tree_leaves_with_path(dense_grads):
    leaf = dict(jax.tree_util.tree_leaves_with_path(grads))[path]
    assert np.abs(dense_leaf).max() > 0, path
    np.testing.assert_allclose(leaf, dense_leaf, rtol=2e-5, atol=1e-6, err_msg=str(path))


def test_compacted_rows_drop_what_the_capacity_does_not_hold():
  # The capacity is the ceiling's promise, not a check: with fewer rows than real tokens the
  # gradient changes (this is why it is sized from every timed batch's masks).
  model = _SinBetweenLinears(False)
  x = jax.random.normal(jax.random.key(3), (*_MASK.shape, 9))
  params = model.init(jax.random.key(4), x)

  def grads(capacity):
    def loss(params):
      known = bound_definitions.Known(_MASK, capacity)
      with bound_definitions.DEFINITIONS["compacted rows, cuBLAS"](known):
        return jnp.sum((model.apply(params, x) * _MASK[..., None]) ** 2)
    return jax.grad(loss)(params)["params"]["up"]["kernel"]

  np.testing.assert_allclose(grads(5), grads(6), rtol=1e-6)
  assert np.abs(grads(4) - grads(5)).max() > 1e-3


def test_static_capacity_holds_every_batch_rounded_up():
  batches = [{"attention_mask": np.array([[1, 1, 0, 0]] * 3)},
             {"attention_mask": np.array([[1, 1, 1, 0]] * 3)}]
  assert bound_definitions.static_capacity(batches) == 12  # 9 real tokens, at most 12 rows
  assert bound_definitions.static_capacity(batches, multiple=4) == 12
  assert bound_definitions.static_capacity(batches[:1], multiple=4) == 8


def test_bound_stays_zero_when_dy_is_not_finite():
  # jax-bound's sum of `dy` keeps it computed; an overflowing `dy` must not turn the zeros to NaN.
  model, x = _SinBetweenLinears(False), jnp.ones((3, 9))
  params = model.init(jax.random.key(0), x)

  def free_loss(params, x):
    with bound_definitions.DEFINITIONS["jax-bound"](None):
      return jnp.sum(model.apply(params, x)) * jnp.inf

  grads = jax.jit(jax.grad(free_loss))(params, x)["params"]
  for layer in ("up", "down"):
    np.testing.assert_array_equal(grads[layer]["kernel"], 0.0)


def test_hlo_instructions_counts_every_computations_instructions():
  text = """HloModule m, entry_computation_layout={(f32[2]{0})->f32[2]{0}}

%fused (p: f32[2]) -> f32[2] {
  %p = f32[2]{0} parameter(0)
  ROOT %s = f32[2]{0} sine(%p)
}

ENTRY %main (a: f32[2]) -> f32[2] {
  %a = f32[2]{0} parameter(0)
  add.1 = f32[2]{0} add(%a, %a)
  ROOT %f = f32[2]{0} fusion(add.1), kind=kLoop, calls=%fused
}
"""
  assert bound_definitions.hlo_instructions(text) == 5


def test_tiny_bert_end_to_end(tmp_path):
  bound_definitions._main(["--model", "bert", "--tiny", "--batch", "2", "--workload", "trec",
                           "--reps", "2", "--impl", "interpret", "--out-dir", str(tmp_path)])
  result = json.loads((tmp_path / "bound_definitions_bert_tiny_b2_trec.json").read_text())
  assert result["reps"] == 2
  rows = {row["definition"]: row for row in result["rows"]}
  assert list(rows) == list(bound_definitions.DEFINITIONS)
  for row in rows.values():
    # Slope timings of tiny programs on a CPU: a loaded CI host can give a slope of 0 (the
    # timer's floor), so only that they are times is asserted, not that they are positive.
    assert row["fwd_ms"] >= 0 and row["grad_ms"] >= 0
    assert row["bwd_ms"] == pytest.approx(row["grad_ms"] - row["fwd_ms"])
  # Each looser definition compiles to a smaller program: it skips work jax-bound keeps.
  sizes = [rows[name]["hlo_instructions"] for name in ("no gradient", "zeros, dy unread",
                                                       "jax-bound")]
  assert sizes == sorted(sizes) and len(set(sizes)) == 3
  table = (tmp_path / "bound_definitions_bert_tiny_b2_trec.md").read_text()
  assert "| dense |" in table and "| 1.00× |" in table


def test_definitions_pick_some_after_dense(tmp_path):
  bound_definitions._main(["--model", "bert", "--tiny", "--batch", "2", "--workload", "trec",
                           "--reps", "2", "--definitions", "jax-bound", "--out-dir",
                           str(tmp_path)])
  result = json.loads((tmp_path / "bound_definitions_bert_tiny_b2_trec.json").read_text())
  assert [row["definition"] for row in result["rows"]] == ["dense", "jax-bound"]


@pytest.mark.parametrize("main", [bound_definitions._main, profile_step._main],
                         ids=["bound_definitions", "profile_step"])
def test_an_unknown_workload_is_named(main, tmp_path, capsys):
  with pytest.raises(SystemExit):
    main(["--model", "bert", "--tiny", "--batch", "2", "--workload", "nope",
          "--out-dir", str(tmp_path)])
  assert "--workload: 'nope' is not one of" in capsys.readouterr().err
