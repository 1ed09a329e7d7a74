"""SEBP for every weight contraction: dot_general dimension orders, einsums, DenseGeneral / Einsum /
attention / Embed.attend under swap_dense, LinearGeneral / Einsum / MultiHeadAttention /
Embed.attend under swap_linear, and what the swaps report.

Each case checks three things against plain autodiff of the same model: the exact policy's
gradients equal dense, a lossy policy (``max_rows``) changes them (so the SEBP backward really
ran), and the traced program holds one SEBP rule (``custom_vjp_call``) per swapped layer.
"""

from __future__ import annotations

import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

from parity_tests.impls import impl_params
from parity_tests.jaxprs import count_primitive, count_sebp_rules
from parity_tests.tolerances import assert_close
from sebp_jax import RowPolicy, swap_dense
from sebp_jax.contraction import einsum_matmul, matmul_view
from sebp_jax.linen import SEBPDenseGeneral, SEBPEinsum
from sebp_jax.matmul import SEBPDotGeneral
from sebp_jax.nnx import swap_linear, unswap_linear

# The backends with the SEBP rule ("dense" has none): xla and interpret on CPU, pallas on a GPU.
IMPLS = [p for p in impl_params() if p.values != ("dense",)]
LOSSY = RowPolicy(max_rows=2)


def _rows_mask(shape, real):
  """1.0 on the first ``real`` positions of axis 1 (tokens), 0.0 on the padding."""
  return jnp.asarray(np.arange(shape[1]) < real, jnp.float32).reshape(
    (1, shape[1]) + (1,) * (len(shape) - 2))


def _assert_trees_close(actual, expected, what):
  for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(actual),
                               jax.tree.leaves(expected)):
    assert got.dtype == want.dtype, f"{what}{jax.tree_util.keystr(path)}: dtype"
    assert_close(got, want, what=f"{what}{jax.tree_util.keystr(path)}")


def _trees_differ(a, b) -> bool:
  return any(not np.allclose(x, y, rtol=1e-4, atol=1e-4)
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# --- dot_general in any dimension order ---------------------------------------------------------

# (x shape, w shape, dimension numbers): the activation's token axis is axis 1.
DOT_CASES = {
  "x@w": ((2, 9, 6), (6, 5), (((2,), (0,)), ((), ()))),
  "x@w.T": ((2, 9, 6), (5, 6), (((2,), (1,)), ((), ()))),
  "BTNH,NHD": ((2, 9, 3, 4), (3, 4, 5), (((2, 3), (0, 1)), ((), ()))),
  "BTNH,HND": ((2, 9, 3, 4), (4, 3, 5), (((2, 3), (1, 0)), ((), ()))),
  "BTD,NDH": ((2, 9, 6), (3, 6, 4), (((2,), (1,)), ((), ()))),
  "BTD,NHD": ((2, 9, 6), (3, 4, 6), (((2,), (2,)), ((), ()))),  # stored (N..., K): read as is
  "DBT,DN": ((6, 9, 2), (6, 5), (((0,), (0,)), ((), ()))),  # tokens not in front, K first
}


def _dot_loss(dot_general, dims, real):
  def loss(x, w):
    y = dot_general(x, w, dims)
    g = jnp.cos(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape))
    return jnp.sum(y * g * _rows_mask(y.shape, real))
  return loss


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", DOT_CASES)
def test_dot_general_any_dimension_order(impl, case):
  x_shape, w_shape, dims = DOT_CASES[case]
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal(x_shape), jnp.float32)
  w = jnp.asarray(rng.standard_normal(w_shape), jnp.float32)
  real = 5  # dy rows past the 5th token are zero (all rows real where axis 1 is shorter)
  dense = _dot_loss(lax.dot_general, dims, real)
  sebp = _dot_loss(SEBPDotGeneral(impl=impl), dims, real)
  assert_close(SEBPDotGeneral(impl=impl)(x, w, dims), lax.dot_general(x, w, dims), what="y")
  want = jax.grad(dense, argnums=(0, 1))(x, w)
  _assert_trees_close(jax.grad(sebp, argnums=(0, 1))(x, w), want, "grad")
  assert count_sebp_rules(jax.make_jaxpr(sebp)(x, w)) == 1
  lossy = _dot_loss(SEBPDotGeneral(LOSSY, impl=impl), dims, real)
  assert _trees_differ(jax.grad(lossy, argnums=(0, 1))(x, w), want)


def test_matmul_view_keeps_the_activation_in_place():
  # jnp.einsum lists contracted letters sorted ("HN"), not in the operands' order: the view pairs
  # them in x's order, so neither operand is transposed.
  view = matmul_view((2, 9, 3, 4), (3, 4, 5), (((3, 2), (1, 0)), ((), ())))
  assert view.lhs_perm is None and view.rhs_perm is None
  jaxpr = jax.make_jaxpr(lambda x, w: jnp.einsum("BTNH,NHD->BTD", x, w,
                                                 _dot_general=SEBPDotGeneral(impl="xla")))(
    jnp.ones((2, 9, 3, 4)), jnp.ones((3, 4, 5)))
  assert count_primitive(jaxpr, "transpose") == 0


@pytest.mark.parametrize("impl", ["xla", "interpret"])
@pytest.mark.parametrize("case", ["x@w.T", "BTD,NHD"])
def test_a_weight_stored_out_by_in_is_never_transposed(impl, case):
  # x @ w.T (a tied output embedding): the backward reads w as stored and writes its gradient in
  # that layout, so the compiled gradient holds no copy or transpose of a weight-sized array
  # (before, dW was made (K, N) and transposed: a layout-changing copy on the CPU).
  x_shape, w_shape, dims = DOT_CASES[case]
  x = jnp.ones(x_shape).at[:, 5:].set(0.0)
  w = jnp.ones(w_shape)
  assert matmul_view(x_shape, w_shape, dims).rhs_nk
  loss = lambda x, w: jnp.sum(SEBPDotGeneral(impl=impl)(x, w, dims) ** 2)  # noqa: E731
  moved = _moves_of_size(jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w), w.size)
  assert not moved, moved


def _moves_of_size(lowered, size: int) -> list[str]:
  """Shapes of the copies and transposes of ``size`` float32 elements in the compiled program."""
  text = lowered.compile().as_text()
  return [shape for shape in re.findall(r"= f32\[([\d,]+)\]\S* (?:copy|transpose)\(", text)
          if np.prod([int(d) for d in shape.split(",")]) == size]


class _TiedHead(nn.Module):
  @nn.compact
  def __call__(self, ids):
    embed = nn.Embed(53, 16, name="embed")
    return embed.attend(jnp.tanh(embed(ids)))


class _NnxTiedHead(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(53, 16, rngs=rngs)

  def __call__(self, ids):
    return self.embed.attend(jnp.tanh(self.embed(ids)))


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_swapped_embed_attend_never_transposes_the_embedding(api):
  # The tied output projection through swap_dense / swap_linear: its gradient comes back in the
  # embedding's (vocabulary, features) layout as written, with no transposed copy of it (which
  # XLA fused into the optimizer update of a LLaMA step: benchmarks/NOTES.md, "v12").
  ids = jnp.asarray(np.random.default_rng(0).integers(0, 53, (2, 11)))
  mask = jnp.asarray(np.arange(11) < 6, jnp.float32)[None, :, None]
  if api == "linen":
    model = _TiedHead()
    params = model.init(jax.random.key(0), ids)

    def loss(params):
      with swap_dense(impl="xla"):
        return jnp.sum(model.apply(params, ids) ** 2 * mask)
    lowered = jax.jit(jax.grad(loss)).lower(params)
  else:
    model = _NnxTiedHead(nnx.Rngs(0))
    swap_linear(model, impl="xla")
    graphdef, state = nnx.split(model)
    loss = lambda state: jnp.sum(nnx.merge(graphdef, state)(ids) ** 2 * mask)  # noqa: E731
    lowered = jax.jit(jax.grad(loss)).lower(state)
  assert not _moves_of_size(lowered, 53 * 16)


def test_batched_contractions_stay_dense():
  q, k = jnp.ones((2, 5, 3, 4)), jnp.ones((2, 7, 3, 4))
  scores = lambda q, k: jnp.einsum("bqhd,bkhd->bhqk", q, k,  # noqa: E731
                                   _dot_general=SEBPDotGeneral(impl="xla"))
  assert count_sebp_rules(jax.make_jaxpr(lambda q: scores(q, k).sum())(q)) == 0


def test_preferred_element_type_is_honoured():
  # bfloat16 operands, float32 result: the product is not rounded to bfloat16 (as dense), and
  # the gradients come back in bfloat16: the dense backward of the float32 output gradient
  # rounded to bfloat16 (the backends take one dtype, as documented).
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((2, 9, 16)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((16, 8)), jnp.bfloat16)
  dims = (((2,), (0,)), ((), ()))
  sebp = SEBPDotGeneral(impl="xla")
  y = sebp(x, w, dims, preferred_element_type=jnp.float32)
  assert y.dtype == jnp.float32
  np.testing.assert_array_equal(y, lax.dot_general(x, w, dims, preferred_element_type=jnp.float32))
  loss = lambda dg: lambda x, w: jnp.sum(dg(x, w, dims, preferred_element_type=jnp.float32) ** 2)
  got = jax.grad(loss(sebp), argnums=(0, 1))(x, w)
  assert [g.dtype for g in got] == [jnp.bfloat16, jnp.bfloat16]
  _, vjp = jax.vjp(lambda x, w: lax.dot_general(x, w, dims), x, w)
  want = vjp((2 * y).astype(jnp.bfloat16))
  for g, r in zip(got, want):
    assert_close(g, r, jnp.bfloat16)
  assert count_sebp_rules(jax.make_jaxpr(loss(sebp))(x, w)) == 1


def test_out_sharding_is_applied_not_dropped():
  mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  spec = jax.sharding.PartitionSpec("data", None, None)
  x, w = jnp.ones((2, 9, 6)), jnp.ones((6, 5))
  with jax.set_mesh(mesh):
    x = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))

    def f(x):
      return SEBPDotGeneral(impl="xla")(x, w, (((2,), (0,)), ((), ())),
                                        out_sharding=jax.sharding.NamedSharding(mesh, spec))

    jaxpr = jax.make_jaxpr(f)(x)
    assert count_sebp_rules(jaxpr) == 1
    assert count_primitive(jaxpr, "reshard") + count_primitive(jaxpr, "sharding_constraint") >= 1
    assert jax.typeof(f(x)).sharding.spec == spec


# --- einsums ------------------------------------------------------------------------------------

EINSUMS = {  # equation: (input shape, kernel shape); tokens are the input's axis 1
  "BTD,DNH->BTNH": ((2, 9, 6), (6, 3, 4)),
  "BTNH,NHD->BTD": ((2, 9, 3, 4), (3, 4, 6)),
  "BTD,NDH->BTNH": ((2, 9, 6), (3, 6, 4)),
  "...F,NHF->...NH": ((2, 9, 6), (2, 5, 6)),
  "BTD,DN->NTB": ((2, 9, 6), (6, 5)),  # kernel letters first: jnp.einsum would flip operands
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("equation", EINSUMS)
def test_weight_einsums(impl, equation):
  x_shape, w_shape = EINSUMS[equation]
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.standard_normal(x_shape) * (np.arange(9) < 4)[:, None].reshape(
    (1, 9) + (1,) * (len(x_shape) - 2)), jnp.float32)
  w = jnp.asarray(rng.standard_normal(w_shape), jnp.float32)

  def loss(dot_general):
    def f(x, w):
      y = einsum_matmul(equation, x, w, dot_general=dot_general)
      return jnp.sum(jnp.sin(y) * jnp.cos(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape)))
    return f

  want = jax.grad(lambda x, w: loss(lax.dot_general)(x, w), argnums=(0, 1))(x, w)
  np.testing.assert_allclose(einsum_matmul(equation, x, w, dot_general=SEBPDotGeneral(impl=impl)),
                             jnp.einsum(equation, x, w), rtol=1e-6, atol=1e-6)
  sebp = loss(SEBPDotGeneral(impl=impl))
  _assert_trees_close(jax.grad(sebp, argnums=(0, 1))(x, w), want, "grad")
  assert count_sebp_rules(jax.make_jaxpr(sebp)(x, w)) == 1
  # x's padded tokens make rows of dy zero only where the tokens are the rows: the lossy policy
  # (2 rows of 18) changes the weight gradient.
  lossy = jax.grad(loss(SEBPDotGeneral(LOSSY, impl=impl)), argnums=1)(x, w)
  assert not np.allclose(lossy, want[1], rtol=1e-4, atol=1e-4)


# --- linen models in the styles of Gemma, MaxText and flax's attention -------------------------

class GemmaStyle(nn.Module):
  """Gemma's layout: Einsum projections with per-head kernels, a gated MLP einsum, tied head."""

  @nn.compact
  def __call__(self, ids):
    embed = nn.Embed(31, 8, name="embedder")
    x = embed(ids)
    q = nn.Einsum((2, 8, 4), "BTD,NDH->BTNH", use_bias=False, name="q_einsum")(x)
    kv = nn.Einsum((2, 2, 8, 4), "BSD,CKDH->CBSKH", use_bias=False, name="kv_einsum")(x)
    logits = jnp.einsum("BTNH,BSNH->BNTS", q, kv[0])
    attn = jnp.einsum("BNTS,BSNH->BTNH", nn.softmax(logits), kv[1])
    x = x + nn.Einsum((2, 4, 8), "BTNH,NHD->BTD", use_bias=False, name="attn_vec_einsum")(attn)
    gate = nn.Einsum((2, 16, 8), "...F,NHF->...NH", use_bias=False, name="gating_einsum")(x)
    x = x + nn.Einsum((16, 8), "...H,HF->...F", use_bias=False, name="linear")(
      nn.gelu(gate[..., 0, :]) * gate[..., 1, :])
    return embed.attend(x)


class MaxTextStyle(nn.Module):
  """MaxText's layout: DenseGeneral projections to (heads, head_dim) and back."""

  @nn.compact
  def __call__(self, x):
    dense = lambda features, axis, name: nn.DenseGeneral(features, axis, name=name)  # noqa: E731
    q, k, v = (dense((2, 4), -1, n)(x) for n in ("query", "key", "value"))
    logits = jnp.einsum("btnh,bsnh->bnts", q, k)
    attn = jnp.einsum("bnts,bsnh->btnh", nn.softmax(logits), v)
    x = x + dense(x.shape[-1], (-2, -1), "out")(attn)
    return dense(3, -1, "head")(x)


class FlaxAttentionStyle(nn.Module):
  """nn.MultiHeadDotProductAttention (DenseGeneral projections inside) and a Dense head."""

  @nn.compact
  def __call__(self, x):
    x = x + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8, name="attn")(x)
    return nn.Dense(3, name="head")(x)


def _linen_case(name):
  rng = np.random.default_rng(3)
  if name == "gemma":
    model, inputs = GemmaStyle(), jnp.asarray(rng.integers(0, 31, (2, 7)))
    layers = 6  # q, kv, attn_vec, gating, linear, embedder/attend
  elif name == "maxtext":
    model, inputs = MaxTextStyle(), jnp.asarray(rng.standard_normal((2, 7, 8)), jnp.float32)
    layers = 5
  else:
    model, inputs = FlaxAttentionStyle(), jnp.asarray(rng.standard_normal((2, 7, 8)), jnp.float32)
    layers = 5  # query, key, value, out, head
  params = model.init(jax.random.key(0), inputs)
  mask = _rows_mask((2, 7, 1), 4)

  def loss(p):
    y = model.apply(p, inputs)
    return jnp.sum(jnp.sin(y) * mask)

  return loss, params, layers


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ["gemma", "maxtext", "flax_attention"])
def test_swap_dense_on_linen_models(impl, name):
  loss, params, layers = _linen_case(name)
  want = jax.grad(loss)(params)

  def sebp(policy):
    def f(p):
      with swap_dense(policy, impl=impl) as report:
        out = loss(p)
      assert len(report) == layers and not report.dense, str(report)
      return out
    return f

  assert count_sebp_rules(jax.make_jaxpr(sebp(RowPolicy()))(params)) == layers
  _assert_trees_close(jax.grad(sebp(RowPolicy()))(params), want, "grad")
  assert _trees_differ(jax.grad(sebp(LOSSY))(params), want)


def test_swap_dense_reports_paths_kinds_and_shapes():
  loss, params, _ = _linen_case("gemma")
  with swap_dense(impl="xla") as report:
    jax.eval_shape(lambda p: loss(p), params)  # a fresh trace
  assert [(layer.path, layer.kind, layer.kernel_shape) for layer in report] == [
    (("q_einsum",), "Einsum", (2, 8, 4)), (("kv_einsum",), "Einsum", (2, 2, 8, 4)),
    (("attn_vec_einsum",), "Einsum", (2, 4, 8)), (("gating_einsum",), "Einsum", (2, 16, 8)),
    (("linear",), "Einsum", (16, 8)), (("embedder", "attend"), "Embed.attend", (31, 8))]


def test_sebp_dense_general_and_einsum_equal_flax_layers():
  x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 7, 3, 4)), jnp.float32)
  for sebp, dense in [(SEBPDenseGeneral(5, axis=(-2, -1), impl="xla"), nn.DenseGeneral(5, (-2, -1))),
                      (SEBPEinsum((3, 4, 5), "BTNH,NHD->BTD", impl="xla"),
                       nn.Einsum((3, 4, 5), "BTNH,NHD->BTD"))]:
    params = dense.init(jax.random.key(0), x)
    assert jax.tree.structure(sebp.init(jax.random.key(0), x)) == jax.tree.structure(params)
    loss = lambda m: lambda p: jnp.sum(jnp.sin(m.apply(p, x)) * _rows_mask((2, 7, 5), 3))  # noqa
    _assert_trees_close(jax.grad(loss(sebp))(params), jax.grad(loss(dense))(params), "grad")
    assert count_sebp_rules(jax.make_jaxpr(loss(sebp))(params)) == 1


def test_sebp_layers_reject_batched_contractions():
  with pytest.raises(ValueError, match="`batch_dims`"):
    SEBPDenseGeneral(4, batch_dims=(0,))
  with pytest.raises(ValueError, match="batched matmul"):
    SEBPEinsum((3, 4, 5), "BNH,NHD->BND").init(jax.random.key(0), jnp.ones((2, 3, 4)))


def test_swap_dense_reports_and_warns_about_layers_it_leaves_dense():
  layer = nn.DenseGeneral(4, axis=-1, batch_dims=(0,))
  x = jnp.ones((3, 5, 6))
  params = layer.init(jax.random.key(0), x)
  with pytest.warns(UserWarning, match="DenseGeneral at <root> stays dense: `batch_dims`"):
    with swap_dense(impl="xla") as report:
      jaxpr = jax.make_jaxpr(jax.grad(lambda p: layer.apply(p, x).sum()))(params)
  assert len(report) == 0 and [l.kind for l in report.dense] == ["DenseGeneral"]
  assert count_sebp_rules(jaxpr) == 0


def test_nested_swap_dense_inner_wins():
  # The outer context selects every layer (exact), the inner one the query projection (lossy):
  # the inner decides for the query, the outer for the rest. Only the query's own gradient
  # changes (dropping its rows touches dW_query and dx upstream of it, nothing else here).
  loss, params, _ = _linen_case("maxtext")
  want = jax.grad(loss)(params)
  with swap_dense(impl="xla") as outer:
    with swap_dense(LOSSY, impl="xla", where=lambda path: path == ("query",)) as inner:
      got = jax.grad(lambda p: loss(p))(params)
  assert [l.path for l in inner] == [("query",)]
  assert [l.path for l in outer] == [("key",), ("value",), ("out",), ("head",)]
  for name in ("key", "value", "out", "head"):
    _assert_trees_close(got["params"][name], want["params"][name], name)
  assert _trees_differ(got["params"]["query"], want["params"]["query"])


def test_where_is_validated_and_warns_when_it_selects_nothing():
  with pytest.raises(TypeError, match=r"`where` must be None or a callable.*got str 'Dense_0'"):
    with swap_dense(where="Dense_0"):
      pass
  loss, params, _ = _linen_case("maxtext")
  with pytest.warns(UserWarning, match=r"`where` selected none of the 5 layer"):
    with swap_dense(where=lambda path: path == ("nothing",)) as report:
      jax.eval_shape(lambda p: loss(p), params)  # a fresh trace
  assert len(report) == 0
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    with swap_dense(where=lambda path: path == ("head",)) as report:
      jax.eval_shape(lambda p: loss(p), params)  # a fresh trace
  assert len(report) == 1


# --- nnx ----------------------------------------------------------------------------------------

class NnxModel(nnx.Module):
  """nnx.MultiHeadAttention, an Einsum, a LinearGeneral, a Linear with a float32 result from
  bfloat16-free float32 params, and the tied Embed.attend."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(31, 8, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(2, 8, qkv_features=8, decode=False, rngs=rngs)
    self.gate = nnx.Einsum("BTD,DNH->BTNH", (8, 2, 4), rngs=rngs)
    self.proj = nnx.LinearGeneral((2, 4), 8, axis=(-2, -1), rngs=rngs)
    self.mlp = nnx.Linear(8, 8, preferred_element_type=jnp.float32, rngs=rngs)

  def __call__(self, ids):
    x = self.embed(ids)
    x = x + self.attn(x)
    x = x + self.proj(nnx.gelu(self.gate(x)))
    x = x + self.mlp(x)
    return self.embed.attend(x)


NNX_LAYERS = [("attn", "query"), ("attn", "key"), ("attn", "value"), ("attn", "out"),
              ("gate",), ("proj",), ("mlp",), ("embed", "attend")]


def _nnx_loss(model, ids):
  return jnp.sum(jnp.sin(model(ids)) * _rows_mask((2, 7, 1), 4))


@pytest.mark.parametrize("impl", IMPLS)
def test_swap_linear_on_nnx_model(impl):
  ids = jnp.asarray(np.random.default_rng(5).integers(0, 31, (2, 7)))
  model = NnxModel(nnx.Rngs(0))
  want = nnx.grad(_nnx_loss)(model, ids)
  report = swap_linear(model, impl=impl)
  assert sorted(l.path for l in report) == sorted(NNX_LAYERS) and not report.dense
  kinds = {l.path: l.kind for l in report}
  assert kinds[("attn", "query")] == "LinearGeneral" and kinds[("embed", "attend")] == "Embed.attend"
  graphdef, state = nnx.split(model)
  jaxpr = jax.make_jaxpr(lambda s: _nnx_loss(nnx.merge(graphdef, s), ids))(state)
  assert count_sebp_rules(jaxpr) == len(NNX_LAYERS)
  got = nnx.jit(nnx.grad(_nnx_loss))(model, ids)
  _assert_trees_close(nnx.to_pure_dict(got), nnx.to_pure_dict(want), "grad")
  swap_linear(model, LOSSY, impl=impl)
  assert _trees_differ(nnx.to_pure_dict(nnx.grad(_nnx_loss)(model, ids)), nnx.to_pure_dict(want))

  undone = unswap_linear(model)
  assert sorted(l.path for l in undone) == sorted(NNX_LAYERS)
  graphdef, state = nnx.split(model)
  jaxpr = jax.make_jaxpr(lambda s: _nnx_loss(nnx.merge(graphdef, s), ids))(state)
  assert count_sebp_rules(jaxpr) == 0
  assert type(model.embed) is nnx.Embed and model.mlp.dot_general is lax.dot_general


def test_swap_linear_names_bad_arguments_and_leaves_batched_layers_dense():
  with pytest.raises(TypeError, match="`model` must be an nnx.Module, got Dense"):
    swap_linear(nn.Dense(3))
  with pytest.raises(TypeError, match="`model` must be an nnx.Module, got dict"):
    swap_linear({"kernel": jnp.ones((2, 2))})
  model = NnxModel(nnx.Rngs(0))
  with pytest.raises(TypeError, match="`where` must be None or a callable"):
    swap_linear(model, where="mlp")
  with pytest.warns(UserWarning, match="selected none of the 8 layer"):
    assert len(swap_linear(model, where=lambda path: False)) == 0
  batched = nnx.LinearGeneral(4, 5, batch_axis={0: 3}, rngs=nnx.Rngs(0))
  with pytest.warns(UserWarning, match="LinearGeneral at <root> stays dense: `batch_axis`"):
    report = swap_linear(batched)
  assert len(report) == 0 and len(report.dense) == 1 and batched.dot_general is None


# --- the LLaMA model built from Gemma-style Einsum layers (the benchmark's einsum variants) ------

def _einsum_params(config, dense_params):
  """The Dense-built LLaMA's parameters in the Einsum-built model's shapes (reshapes only)."""
  cfg = config
  heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads,
           "v_proj": cfg.num_key_value_heads}

  def reshape(path, leaf):
    names = [getattr(p, "key", "") for p in path]
    if names[-2] in heads:
      n = heads[names[-2]]
      return leaf.reshape((-1, n, cfg.head_dim) if names[-1] == "kernel" else (n, cfg.head_dim))
    if names[-2] == "o_proj" and names[-1] == "kernel":
      return leaf.reshape(cfg.num_attention_heads, cfg.head_dim, -1)
    return leaf

  return jax.tree_util.tree_map_with_path(reshape, dense_params)


@pytest.mark.parametrize("impl", IMPLS)
def test_einsum_built_llama_equals_dense_built_and_swaps_every_layer(impl):
  from sebp_jax.models import LlamaConfig, LlamaForCausalLM, causal_lm_loss

  kw = dict(vocab_size=61, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
            attention_impl="xla")
  dense_cfg, einsum_cfg = LlamaConfig(**kw), LlamaConfig(**kw, projections="einsum")
  ids = jnp.asarray(np.random.default_rng(6).integers(1, 61, (2, 9)))
  mask = jnp.asarray(np.arange(9) < np.array([[9], [4]]), jnp.int32)
  labels = jnp.where(mask == 1, ids, -100)
  dense_model, einsum_model = LlamaForCausalLM(dense_cfg), LlamaForCausalLM(einsum_cfg)
  params = dense_model.init(jax.random.key(0), ids, mask)
  einsum_params = _einsum_params(dense_cfg, params)
  assert jax.tree.structure(einsum_params) == jax.tree.structure(
    jax.eval_shape(einsum_model.init, jax.random.key(0), ids, mask))
  assert_close(einsum_model.apply(einsum_params, ids, mask), dense_model.apply(params, ids, mask),
               what="logits")

  def loss(p):
    return causal_lm_loss(einsum_model.apply(p, ids, mask), labels)

  want = _einsum_params(dense_cfg, jax.grad(lambda p: causal_lm_loss(
    dense_model.apply(p, ids, mask), labels))(params))

  def sebp(p):
    with swap_dense(impl=impl) as report:
      out = loss(p)
    assert len(report) == 8 and {l.kind for l in report} == {"Einsum"}, str(report)
    return out

  assert count_sebp_rules(jax.make_jaxpr(sebp)(einsum_params)) == 8
  _assert_trees_close(jax.grad(sebp)(einsum_params), want, "grad")


# --- the escape hatch: modules that call jax.lax.dot_general themselves -------------------------

class LaxConv1D(nn.Module):
  """Hugging Face's Flax GPT-2 ``FlaxConv1D``: a ``(features, in)`` kernel, transposed, through
  ``jax.lax.dot_general`` called directly."""

  features: int

  @nn.compact
  def __call__(self, x):
    kernel = self.param("kernel", nn.initializers.normal(0.5), (self.features, x.shape[-1]))
    return lax.dot_general(x, kernel.T, (((x.ndim - 1,), (0,)), ((), ()))) + self.param(
      "bias", nn.initializers.zeros, (self.features,))


class GPT2Style(nn.Module):
  @nn.compact
  def __call__(self, x):
    return LaxConv1D(3, name="c_proj")(nn.gelu(LaxConv1D(12, name="c_fc")(x)))


@pytest.mark.parametrize("impl", IMPLS)
def test_lax_modules_route_their_own_lax_dot_general_calls(impl):
  x = jnp.asarray(np.random.default_rng(7).standard_normal((2, 7, 8)), jnp.float32)
  model = GPT2Style()
  params = model.init(jax.random.key(0), x)
  loss = lambda p: jnp.sum(jnp.sin(model.apply(p, x)) * _rows_mask((2, 7, 1), 4))  # noqa: E731
  want = jax.grad(loss)(params)
  original = lax.dot_general

  def sebp(policy):
    def f(p):
      with swap_dense(policy, impl=impl, lax_modules=(LaxConv1D,)) as report:
        out = loss(p)
      assert [(l.path, l.kind) for l in report] == [
        (("c_fc",), "LaxConv1D (lax.dot_general)"), (("c_proj",), "LaxConv1D (lax.dot_general)")]
      return out
    return f

  assert count_sebp_rules(jax.make_jaxpr(sebp(RowPolicy()))(params)) == 2
  assert lax.dot_general is original  # restored
  _assert_trees_close(jax.grad(sebp(RowPolicy()))(params), want, "grad")
  assert _trees_differ(jax.grad(sebp(LOSSY))(params), want)
  with swap_dense(impl=impl):  # not named: untouched
    assert count_sebp_rules(jax.make_jaxpr(lambda p: loss(p))(params)) == 0
  with pytest.raises(TypeError, match="`lax_modules` must be a tuple of flax.linen Module"):
    with swap_dense(lax_modules=LaxConv1D):
      pass


class PerTokenStack(nn.Module):
  """DenseGeneral to heads, an Einsum back, an Einsum MLP: no layer mixes tokens, so padded
  tokens' output-gradient rows are zero in every layer."""

  @nn.compact
  def __call__(self, x):
    h = nn.DenseGeneral((2, 4), name="up")(x)
    x = x + nn.Einsum((2, 4, 8), "BTNH,NHD->BTD", name="down")(nn.gelu(h))
    return nn.Einsum((8, 3), "...D,DF->...F", name="head")(x)


@pytest.mark.parametrize("impl", IMPLS)
def test_row_plan_reaches_general_contractions(impl):
  from sebp_jax import row_plan

  rng = np.random.default_rng(8)
  mask = jnp.asarray(np.arange(7) < np.array([[7], [3]]))
  x = jnp.asarray(rng.standard_normal((2, 7, 8)), jnp.float32) * mask[..., None]
  model = PerTokenStack()
  params = model.init(jax.random.key(0), x)
  loss = lambda p: jnp.sum(jnp.sin(model.apply(p, x)) * mask[..., None])  # noqa: E731
  want = jax.grad(loss)(params)

  def planned(p):
    with swap_dense(impl=impl, rows=row_plan(mask, check=True)) as report:
      out = loss(p)
    assert len(report) == 3
    return out

  assert count_sebp_rules(jax.make_jaxpr(planned)(params)) == 3
  _assert_trees_close(jax.grad(planned)(params), want, "grad")
