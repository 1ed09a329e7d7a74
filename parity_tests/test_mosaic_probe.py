"""``benchmarks/mosaic_probe.py``: the Mosaic GPU dX probe lowers for CUDA in every configuration
(on a CPU too: Mosaic GPU lowers without a GPU), refuses shapes it cannot tile, and on a Hopper
GPU equals XLA's product."""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from benchmarks import mosaic_probe  # noqa: E402


@pytest.mark.parametrize("rows", mosaic_probe.ROWS)
@pytest.mark.parametrize("shape", sorted(mosaic_probe.SHAPES))
@pytest.mark.parametrize("config", sorted(mosaic_probe.CONFIGS))
def test_every_configuration_lowers_for_cuda(config, shape, rows):
  n, k = mosaic_probe.SHAPES[shape]
  dyc = jax.ShapeDtypeStruct((rows, n), jnp.bfloat16)
  kernel = jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
  probe = jax.jit(lambda a, b: mosaic_probe.dx_partials(a, b, mosaic_probe.CONFIGS[config]))
  text = probe.trace(dyc, kernel).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


@pytest.mark.parametrize("dyc, kernel, message", [
  ((100, 512), (256, 512), "`dyc` has 100 rows"),
  ((64, 512), (256, 384), "contracts 384 columns"),
  ((64, 512), (200, 512), "does not tile"),
])
def test_shapes_it_cannot_tile_are_refused_by_name(dyc, kernel, message):
  with pytest.raises(ValueError, match=message):
    mosaic_probe.dx_partials(jnp.zeros(dyc, jnp.bfloat16), jnp.zeros(kernel, jnp.bfloat16))
  with pytest.raises(ValueError, match="`dyc` is float32 but `kernel` bfloat16"):
    mosaic_probe.dx_partials(jnp.zeros((64, 512)), jnp.zeros((256, 512), jnp.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("config", sorted(mosaic_probe.CONFIGS))
def test_the_probe_equals_xlas_product(config):
  if "H100" not in jax.devices()[0].device_kind and "H200" not in jax.devices()[0].device_kind:
    pytest.skip("Mosaic GPU's WGMMA needs a Hopper GPU")
  keys = jax.random.split(jax.random.key(0), 2)
  dyc = jax.random.normal(keys[0], (64, 1024), jnp.bfloat16)
  kernel = jax.random.normal(keys[1], (256, 1024), jnp.bfloat16)
  got = mosaic_probe.dx_partials(dyc, kernel, mosaic_probe.CONFIGS[config]).sum(0)
  want = mosaic_probe.dx_reference(dyc, kernel)
  assert float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))) < 1e-5
