"""``sebp_jax.models.rms_norm`` (hand-written backward) against float64 numpy and HF's torch module.

The float64 reference differentiates ``s * x / sqrt(mean(x²) + eps)`` by hand; HF's
``LlamaRMSNorm`` (torch autograd, float32) is the module the LLaMA checkpoints were trained with.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parity_tests.tolerances import assert_close
from sebp_jax.models.rms_norm import RMSNorm, rms_norm

EPS = 1e-5
SHAPE = (3, 7, 13)  # odd sizes


def _reference(x: np.ndarray, scale: np.ndarray, dy: np.ndarray):
  """Output and ``(dx, dscale)`` in float64."""
  x, scale, dy = (np.asarray(a, np.float64) for a in (x, scale, dy))
  r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS)
  dh = dy * scale
  dx = r * dh - x * r**3 * np.mean(dh * x, axis=-1, keepdims=True)
  rows = tuple(range(x.ndim - 1))
  return scale * x * r, dx, np.sum(dy * x * r, axis=rows)


def _inputs(dtype: str, seed: int = 0):
  rng = np.random.default_rng(seed)
  x, dy = (jnp.asarray(rng.standard_normal(SHAPE), dtype) for _ in range(2))
  scale = jnp.asarray(1 + 0.5 * rng.standard_normal(SHAPE[-1]), dtype)
  return x, scale, dy


def _vjp(x, scale, dy, dtype):
  y, vjp = jax.vjp(lambda x, s: rms_norm(x, s, EPS, jnp.dtype(dtype)), x, scale)
  return (y, *vjp(dy.astype(y.dtype)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gradients_match_float64(dtype):
  x, scale, dy = _inputs(dtype)
  y, dx, dscale = _vjp(x, scale, dy, dtype)
  y_ref, dx_ref, dscale_ref = _reference(x, scale, dy)
  assert (y.dtype, dx.dtype, dscale.dtype) == (jnp.dtype(dtype),) * 3
  assert_close(y, y_ref, dtype=dtype)
  assert_close(dx, dx_ref, dtype=dtype)
  assert_close(dscale, dscale_ref, dtype=dtype)


def test_matches_hf_llama_rms_norm():
  torch = pytest.importorskip("torch")
  modeling = pytest.importorskip("transformers.models.llama.modeling_llama")
  x, scale, dy = _inputs("float32", seed=1)
  hf = modeling.LlamaRMSNorm(SHAPE[-1], eps=EPS)
  with torch.no_grad():
    hf.weight.copy_(torch.tensor(np.asarray(scale)))
  x_t = torch.tensor(np.asarray(x), requires_grad=True)
  y_t = hf(x_t)
  y_t.backward(torch.tensor(np.asarray(dy)))

  y, dx, dscale = _vjp(x, scale, dy, "float32")
  assert_close(y, y_t.detach().numpy(), dtype="float32")
  assert_close(dx, x_t.grad.numpy(), dtype="float32")
  assert_close(dscale, hf.weight.grad.numpy(), dtype="float32")


def test_zero_row_is_finite_and_nan_stays_in_its_row():
  x, scale, dy = _inputs("float32", seed=2)
  x = x.at[0, 0].set(0.0).at[1, 2, 4].set(jnp.nan)
  _, dx, dscale = _vjp(x, scale, dy, "float32")
  dx = np.asarray(dx)
  assert np.isfinite(dx[0, 0]).all()
  nan_rows = np.isnan(dx).any(axis=-1)
  assert nan_rows[1, 2] and nan_rows.sum() == 1
  assert np.isnan(np.asarray(dscale)).all()  # every column sums the NaN row


def test_scale_gradient_reads_its_operands_through_a_barrier():
  """The backward's whole point (module docstring): the column reduction gets its operands from
  ``optimization_barrier``, so XLA cannot fuse it with the input gradient's pass."""
  x, scale, dy = _inputs("float32")
  jaxpr = jax.make_jaxpr(lambda x, s: _vjp(x, s, dy, "float32"))(x, scale)
  assert "optimization_barrier" in str(jaxpr)


@pytest.mark.parametrize("param_dtype,dtype", [("float32", None), ("float32", "bfloat16"),
                                               ("bfloat16", "bfloat16")])
def test_module_parameter_and_dtypes(param_dtype, dtype):
  x, _, _ = _inputs("float32")
  norm = RMSNorm(EPS, dtype=dtype and jnp.dtype(dtype), param_dtype=jnp.dtype(param_dtype))
  params = norm.init(jax.random.key(0), x)
  scale = params["params"]["scale"]
  assert scale.shape == (SHAPE[-1],) and scale.dtype == jnp.dtype(param_dtype)
  grads = jax.grad(lambda p: norm.apply(p, x).astype(jnp.float32).sum())(params)
  assert grads["params"]["scale"].dtype == jnp.dtype(param_dtype)
  assert norm.apply(params, x).dtype == jnp.dtype(dtype or "float32")
