"""``sebp_jax.models.Embed`` (float32-accumulated table gradient) against ``nn.Embed`` and numpy.

The reference gradient is ``np.add.at`` in float64: duplicated ids (a padding id on most
positions, as in a padded batch) must sum, out-of-range ids must read NaN and add nothing.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parity_tests.tolerances import assert_close
from sebp_jax.models.embedding import Embed, embedding_lookup

VOCAB, FEATURES = 37, 13  # odd sizes


def _ids(rng: np.random.Generator, shape: tuple[int, ...], pad_fraction: float) -> np.ndarray:
  ids = rng.integers(1, VOCAB, size=shape)
  return np.where(rng.random(shape) < pad_fraction, 0, ids).astype(np.int32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("pad_fraction", [0.0, 0.9, 1.0])
def test_lookup_gradient_sums_duplicate_rows(dtype, pad_fraction):
  rng = np.random.default_rng(hash((dtype, pad_fraction)) % 2**32)
  table = jnp.asarray(rng.standard_normal((VOCAB, FEATURES)), dtype)
  ids = _ids(rng, (5, 23), pad_fraction)
  dy = jnp.asarray(rng.standard_normal((5, 23, FEATURES)), dtype)

  y, vjp = jax.vjp(lambda t: embedding_lookup(t, jnp.asarray(ids)), table)
  (dtable,) = vjp(dy)

  expected = np.zeros((VOCAB, FEATURES))
  np.add.at(expected, ids.reshape(-1), np.asarray(dy, np.float64).reshape(-1, FEATURES))
  assert dtable.dtype == table.dtype
  assert_close(y, np.asarray(table, np.float64)[ids], dtype=dtype)
  assert_close(dtable, expected, dtype=dtype)


def test_out_of_range_ids_read_nan_and_get_no_gradient():
  table = jnp.ones((VOCAB, FEATURES), jnp.float32)
  ids = jnp.array([0, VOCAB, -VOCAB - 1, 2])
  y, vjp = jax.vjp(lambda t: embedding_lookup(t, ids), table)
  (dtable,) = vjp(jnp.ones_like(y))
  y = np.asarray(y)
  assert np.isnan(y[1:3]).all() and np.isfinite(y[0]).all() and np.isfinite(y[3]).all()
  assert float(dtable.sum()) == 2 * FEATURES  # rows 0 and 2 only


@pytest.mark.parametrize("param_dtype,dtype", [("float32", "float32"), ("float32", "bfloat16"),
                                               ("bfloat16", "bfloat16")])
def test_embed_matches_flax_embed(param_dtype, dtype):
  """Same parameters, output, gradient and ``attend`` as ``nn.Embed`` (the reference runs in
  float32 on the same values: a bfloat16 ``nn.Embed`` sums its gradient in bfloat16)."""
  rng = np.random.default_rng(7)
  ids = jnp.asarray(_ids(rng, (3, 11), 0.5))
  ours = Embed(VOCAB, FEATURES, dtype=jnp.dtype(dtype), param_dtype=jnp.dtype(param_dtype))
  reference = nn.Embed(VOCAB, FEATURES, dtype=jnp.float32, param_dtype=jnp.float32)
  params = ours.init(jax.random.key(0), ids)
  assert (jax.tree.structure(params)
          == jax.tree.structure(reference.init(jax.random.key(0), ids)))
  params32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
  dy = jnp.asarray(rng.standard_normal((3, 11, FEATURES)), dtype)

  def grads(module, p):
    y, vjp = jax.vjp(lambda p: module.apply(p, ids), p)
    return y, vjp(dy.astype(y.dtype))[0]["params"]["embedding"]

  (y, g), (y_ref, g_ref) = grads(ours, params), grads(reference, params32)
  assert g.dtype == jnp.dtype(param_dtype)
  assert_close(y, y_ref, dtype=dtype)
  assert_close(g, g_ref, dtype=dtype)
  query = jnp.asarray(rng.standard_normal((4, FEATURES)), dtype)
  assert_close(ours.apply(params, query, method="attend"),
               reference.apply(params32, query.astype(jnp.float32), method="attend"), dtype=dtype)


def test_embed_rejects_float_ids():
  with pytest.raises(ValueError, match="`inputs`"):
    Embed(VOCAB, FEATURES).init(jax.random.key(0), jnp.zeros((2, 3)))
