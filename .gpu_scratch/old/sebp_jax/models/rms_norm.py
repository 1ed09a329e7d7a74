"""RMSNorm (in Hugging Face LLaMA's order) whose scale gradient XLA:GPU reduces on its own.

Autodiff of RMSNorm gives two passes over the ``(rows, hidden)`` output gradient: the input
gradient (elementwise after a per-row mean) and the scale gradient, a sum over rows (a column
reduction). XLA:GPU fuses the two into one multi-output fusion driven by its column-reduction
emitter, which writes the elementwise output at a fraction of memory speed: in LLaMA-3.2-3B's
batch-1 step on an H100 that fusion took 111 µs per norm (6.1 ms of the step) where reading its
five operands and writing the gradient once takes ~45 µs (``benchmarks/NOTES.md``, "v15").
:func:`rms_norm`'s backward computes the same two gradients, but hands the column reduction its
operands through ``lax.optimization_barrier``, so the two passes share no operand XLA could
fuse them on; the barrier copies nothing.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ["RMSNorm", "rms_norm"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def rms_norm(x: jax.Array, scale: jax.Array, eps: float, dtype: Any) -> jax.Array:
  """``scale * x / rms(x)`` over the last axis, as HF's ``LlamaRMSNorm`` computes it: normalised in
  float32, cast to ``dtype``, then scaled by ``scale`` cast to ``dtype``.

  Args:
    x: ``(..., hidden)``.
    scale: ``(hidden,)``.
    eps: added to the mean square.
    dtype: the dtype of the result.
  """
  return _scaled(x, _inverse_rms(x, eps), scale, dtype)


def _inverse_rms(x, eps):
  h = x.astype(jnp.float32)
  return jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)


def _normalised(x, inverse_rms, dtype):
  return (x.astype(jnp.float32) * inverse_rms).astype(dtype)


def _scaled(x, inverse_rms, scale, dtype):
  normalised = _normalised(x, inverse_rms, dtype)
  return scale.astype(dtype) * normalised


def _rms_norm_fwd(x, scale, eps, dtype):
  inverse_rms = _inverse_rms(x, eps)
  # x and scale are alive anyway (the step's input, a parameter); only the per-row float32
  # inverse is extra, as in autodiff's own residuals.
  return _scaled(x, inverse_rms, scale, dtype), (x, inverse_rms, scale)


def _rms_norm_bwd(eps, dtype, residuals, dy):
  del eps
  x, inverse_rms, scale = residuals
  h = x.astype(jnp.float32) * inverse_rms
  # The input gradient: d/dx of x * r(x) with r = rsqrt(mean(x²) + eps).
  dh = (dy * scale.astype(dtype)).astype(jnp.float32)
  dx = inverse_rms * (dh - h * jnp.mean(dh * h, axis=-1, keepdims=True))
  # The scale gradient, from operands of its own (see the module docstring), summed in float32.
  dy_apart, x_apart = jax.lax.optimization_barrier((dy, x))
  rows = tuple(range(dy.ndim - 1))
  normalised = _normalised(x_apart, inverse_rms, dtype)
  dscale = jnp.sum((dy_apart * normalised).astype(jnp.float32), axis=rows)
  return dx.astype(x.dtype), dscale.astype(scale.dtype)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


class RMSNorm(nn.Module):
  """RMSNorm with :func:`rms_norm`'s backward; parameter ``scale`` ``(hidden,)``, initialised to
  ones.

  Attributes:
    eps: added to the mean square.
    dtype: the dtype of the result (``None``: ``x``'s).
    param_dtype: the dtype of ``scale``.

  >>> import jax, jax.numpy as jnp
  >>> norm = RMSNorm(eps=1e-5)
  >>> x = jnp.ones((2, 3, 8))
  >>> params = norm.init(jax.random.key(0), x)
  >>> norm.apply(params, x).shape
  (2, 3, 8)
  """

  eps: float
  dtype: Any = None
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """``(..., hidden)`` → ``(..., hidden)``."""
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
    return rms_norm(x, scale, self.eps, jnp.dtype(self.dtype or x.dtype))
