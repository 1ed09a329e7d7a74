"""``benchmarks/mosaic_probe.py``: the Mosaic GPU dX and dW probes lower for CUDA in every
configuration (on a CPU too: Mosaic GPU lowers without a GPU), refuse shapes they cannot tile,
and on a Hopper GPU equal XLA's products."""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from benchmarks import mosaic_probe  # noqa: E402


def _probes():
  return ([("dX", name) for name in sorted(mosaic_probe.DX_CONFIGS)]
          + [("dW", name) for name in sorted(mosaic_probe.DW_CONFIGS)])


def _probe(product: str, name: str):
  if product == "dX":
    return lambda dyc, kernel: mosaic_probe.dx_partials(dyc, kernel,
                                                        mosaic_probe.DX_CONFIGS[name])
  return lambda xc, dyc: mosaic_probe.dw(xc, dyc, mosaic_probe.DW_CONFIGS[name])


@pytest.mark.parametrize("rows", mosaic_probe.ROWS)
@pytest.mark.parametrize("shape", sorted(mosaic_probe.SHAPES))
@pytest.mark.parametrize("product, config", _probes())
def test_every_configuration_lowers_for_cuda(product, config, shape, rows):
  n, k = mosaic_probe.SHAPES[shape]
  dyc = jax.ShapeDtypeStruct((rows, n), jnp.bfloat16)
  other = jax.ShapeDtypeStruct((k, n) if product == "dX" else (rows, k), jnp.bfloat16)
  args = (dyc, other) if product == "dX" else (other, dyc)
  text = jax.jit(_probe(product, config)).trace(*args).lower(
    lowering_platforms=("cuda",)).as_text()
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


@pytest.mark.parametrize("xc, dyc, message", [
  ((64, 256), (128, 512), "need the same rows"),
  ((96, 256), (96, 512), "need the same rows, a multiple of 64"),
  ((64, 200), (64, 512), "does not tile"),
])
def test_dw_refuses_shapes_it_cannot_tile_by_name(xc, dyc, message):
  with pytest.raises(ValueError, match=message):
    mosaic_probe.dw(jnp.zeros(xc, jnp.bfloat16), jnp.zeros(dyc, jnp.bfloat16))
  with pytest.raises(ValueError, match="`xc` is float32 but `dyc` bfloat16"):
    mosaic_probe.dw(jnp.zeros((64, 256)), jnp.zeros((64, 512), jnp.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("product, config", _probes())
def test_the_probes_equal_xlas_products(product, config):
  if not any(card in jax.devices()[0].device_kind for card in ("H100", "H200")):
    pytest.skip("Mosaic GPU's WGMMA needs a Hopper GPU")
  # A contraction as long as LLaMA-3.2-3B's up projection's: 32 pipeline steps a program, so that
  # a load overwriting operands a WGMMA still reads shows (it did, at 4 steps it did not).
  keys = jax.random.split(jax.random.key(0), 3)
  dyc = jax.random.normal(keys[0], (128, 8192), jnp.bfloat16)
  if product == "dX":
    kernel = jax.random.normal(keys[1], (256, 8192), jnp.bfloat16)
    got = _probe(product, config)(dyc, kernel).sum(0)
    want = mosaic_probe.dx_reference(dyc, kernel)
  else:
    xc = jax.random.normal(keys[2], (128, 256), jnp.bfloat16)
    got = _probe(product, config)(xc, dyc).astype(jnp.float32)
    want = mosaic_probe.dw_reference(xc, dyc).astype(jnp.float32)
  error = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
  assert error < mosaic_probe.TOLERANCE[product]


def test_markdown_gives_each_row_and_what_failed():
  result = {"device": "NVIDIA H200", "jax": "0.11.2", "rows": [
    {"shape": "llama_up", "rows": 64, "product": "dX", "kernel": "xla (cuBLAS)", "error": 0.0,
     "ms": 0.028, "weight_tb_s": 1.8},
    {"shape": "llama_up", "rows": 64, "product": "dX", "kernel": "mosaic k128_n64_s4",
     "failed": "ValueError: exceeds available shared memory"}]}
  lines = mosaic_probe.markdown(result).splitlines()
  assert "| llama_up | 64 | dX | xla (cuBLAS) | 0.0280 | 1.80 | 0.0e+00 |  |" in lines
  assert lines[-1].endswith("| ValueError: exceeds available shared memory |")
