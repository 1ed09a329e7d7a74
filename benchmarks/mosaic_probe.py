"""Can a TMA-fed Mosaic GPU kernel stream a weight faster than cuBLAS at a few dozen kept rows?

LLaMA-3.2-3B at batch 1 keeps ~85 of 4096 rows; its dX and dW then stream each weight at ~1.8
TB/s, in our Triton-lowered kernels and in cuBLAS on the same compacted rows alike, where the
H200 reads 4.8 (benchmarks/NOTES.md, "Next (2026-11-30)"). No Triton table entry moved that, so
the next kernel would be of another kind. This probe times the question before any backend is
built: dX of the kept rows, ``dyc @ kernel.T``, as a Mosaic GPU kernel (Pallas' ``plgpu``: TMA
loads into swizzled shared memory, ``max_concurrent_steps`` of them in flight, WGMMA), each
program one column block of ``dX`` and one share of the contraction, so that every SM streams a
share of the weight; beside it XLA's GEMM (cuBLAS) on the same rows. The partial sums are added
by XLA (not timed): a backend would sum them in the kernel, as ours does. dW of the same rows,
``xc.T @ dyc``, likewise: one program per dW tile, its contraction the kept rows, stored by TMA.

Usage (one GPU; writes JSON and markdown)::

    python -m benchmarks.mosaic_probe --out $OUT/mosaic_probe.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

__all__ = ["ProbeConfig", "DX_CONFIGS", "DW_CONFIGS", "SHAPES", "dw", "dw_reference",
           "dx_partials", "dx_reference", "markdown", "TOLERANCE"]


@dataclasses.dataclass(frozen=True)
class ProbeConfig:
  """One launch of :func:`dx_partials` or :func:`dw`.

  Attributes:
    block_k: columns of ``dX`` (rows of the weight, of ``dW``) per program.
    block_n: dX: contraction columns per pipeline step (one TMA load of each operand); dW: its
      columns per program.
    splits: dX: programs that share one column block's contraction, each summing its own share.
    stages: pipeline steps in flight (``max_concurrent_steps``).
  """

  block_k: int = 128
  block_n: int = 64
  splits: int = 4
  stages: int = 4


DX_CONFIGS = {
  "k128_n64_s4": ProbeConfig(),
  "k128_n64_s8": ProbeConfig(splits=8),
  "k128_n128_s4": ProbeConfig(block_n=128, stages=3),
  "k64_n64_s4": ProbeConfig(block_k=64, stages=6),
}
DW_CONFIGS = {  # dW's contraction is the kept rows: `splits` unused, one or two pipeline steps
  "k128_n128": ProbeConfig(block_n=128, splits=1, stages=2),
  "k128_n64": ProbeConfig(splits=1, stages=2),
  "k64_n128": ProbeConfig(block_k=64, block_n=128, splits=1, stages=2),
}
# LLaMA-3.2-3B's weights as (contraction N, dX columns K): dX = dY (M, N) @ kernel (K, N)^T.
SHAPES = {"llama_up": (8192, 3072), "llama_down": (3072, 8192), "llama_qo": (3072, 3072)}
ROWS = (64, 128)  # kept rows, padded to WGMMA's 64-row steps (b1: ~85 kept)
# Largest error over the largest output, per product, against XLA's: dX's float32 sums of exact
# products differ only in order; dW's are each rounded once to bfloat16.
TOLERANCE = {"dX": 1e-5, "dW": 2 ** -7}


def _delay(stages: int) -> int:
  # WGMMA reads its shared-memory operands after it is issued: a slot is handed back to the
  # next TMA load one step late, once the WGMMA that read it has completed. Without this the
  # load overwrites operands still being read (2026-12-02, H200: errors of 5-11 % of the
  # largest output in half the configurations; benchmarks/NOTES.md, "Mosaic GPU probe measured").
  return 1 if stages > 1 else 0


def _store(acc: jax.Array, out_gmem) -> None:
  """``acc`` into the GMEM tile ``out_gmem`` in its dtype, through shared memory and a TMA store."""

  @functools.partial(pl.run_scoped, out_smem=plgpu.SMEM(acc.shape, out_gmem.dtype))
  def store(out_smem):
    out_smem[...] = acc.astype(out_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_gmem)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _dx_partials_kernel(dy_gmem, w_gmem, out_gmem, *, rows: int, block_k: int, block_n: int,
                        steps: int, stages: int):
  col, part = lax.axis_index("k"), lax.axis_index("s")

  def accumulate(acc_ref):
    plgpu.emit_pipeline(
      lambda _, dy_smem, w_smem: plgpu.wgmma(acc_ref, dy_smem,
                                             plgpu.transpose_ref(w_smem, (1, 0))),
      grid=(steps,),
      in_specs=[plgpu.BlockSpec((rows, block_n), lambda j: (0, part * steps + j),
                                delay_release=_delay(stages)),
                plgpu.BlockSpec((block_k, block_n), lambda j: (col, part * steps + j),
                                delay_release=_delay(stages))],
      max_concurrent_steps=stages,
    )(dy_gmem, w_gmem)
    return acc_ref[...]

  acc = pl.run_scoped(accumulate, plgpu.ACC((rows, block_k)))
  _store(acc, out_gmem.at[part, :, pl.ds(col * block_k, block_k)])


def dx_partials(dyc: jax.Array, kernel: jax.Array, config: ProbeConfig = ProbeConfig()):
  """``(splits, M, K)`` float32 partial sums of ``dyc @ kernel.T``.

  Args:
    dyc: ``(M, N)`` kept rows of the output gradient, ``M`` a multiple of 64.
    kernel: ``(K, N)`` weight, the contraction on its minor axis (a linear layer's
      ``(in, out)`` kernel), same dtype.
    config: the launch (:class:`ProbeConfig`).
  """
  m, n = dyc.shape
  k, kernel_n = kernel.shape
  if dyc.dtype != kernel.dtype:
    raise ValueError(f"dx_partials: `dyc` is {dyc.dtype} but `kernel` {kernel.dtype}.")
  if kernel_n != n:
    raise ValueError(f"dx_partials: `kernel` {kernel.shape} contracts {kernel_n} columns, "
                     f"`dyc` {dyc.shape} has {n}.")
  if m % 64:
    raise ValueError(f"dx_partials: `dyc` has {m} rows; pad them to a multiple of 64.")
  if k % config.block_k or n % (config.block_n * config.splits):
    raise ValueError(f"dx_partials: `config` {config} does not tile `kernel` {kernel.shape}.")
  body = functools.partial(
    _dx_partials_kernel, rows=m, block_k=config.block_k, block_n=config.block_n,
    steps=n // (config.block_n * config.splits), stages=config.stages)
  return plgpu.kernel(
    body, out_type=jax.ShapeDtypeStruct((config.splits, m, k), jnp.float32),
    grid=(k // config.block_k, config.splits), grid_names=("k", "s"),
    compiler_params=plgpu.CompilerParams(
      lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )(dyc, kernel)


def _dw_kernel(xc_gmem, dy_gmem, out_gmem, *, block_k: int, block_n: int, block_m: int,
               steps: int, stages: int):
  row, col = lax.axis_index("k"), lax.axis_index("n")

  def accumulate(acc_ref):
    plgpu.emit_pipeline(
      lambda _, x_smem, dy_smem: plgpu.wgmma(acc_ref, plgpu.transpose_ref(x_smem, (1, 0)),
                                             dy_smem),
      grid=(steps,),
      in_specs=[plgpu.BlockSpec((block_m, block_k), lambda j: (j, row),
                                delay_release=_delay(stages)),
                plgpu.BlockSpec((block_m, block_n), lambda j: (j, col),
                                delay_release=_delay(stages))],
      max_concurrent_steps=stages,
    )(xc_gmem, dy_gmem)
    return acc_ref[...]

  acc = pl.run_scoped(accumulate, plgpu.ACC((block_k, block_n)))
  _store(acc, out_gmem.at[pl.ds(row * block_k, block_k), pl.ds(col * block_n, block_n)])


def dw(xc: jax.Array, dyc: jax.Array, config: ProbeConfig = ProbeConfig()) -> jax.Array:
  """``xc.T @ dyc`` ``(K, N)`` in ``xc``'s dtype, accumulated in float32: dW of the kept rows.

  Args:
    xc: ``(M, K)`` kept rows of the layer input, ``M`` a multiple of 64.
    dyc: ``(M, N)`` the same rows of the output gradient, same dtype.
    config: tiles of dW: ``block_k`` × ``block_n``, the rows 64 a pipeline step; ``splits``
      unused (the contraction is the few kept rows).
  """
  m, k = xc.shape
  dy_m, n = dyc.shape
  if xc.dtype != dyc.dtype:
    raise ValueError(f"dw: `xc` is {xc.dtype} but `dyc` {dyc.dtype}.")
  if dy_m != m or m % 64:
    raise ValueError(f"dw: `xc` {xc.shape} and `dyc` {dyc.shape} need the same rows, a "
                     f"multiple of 64.")
  if k % config.block_k or n % config.block_n:
    raise ValueError(f"dw: `config` {config} does not tile dW {(k, n)}.")
  body = functools.partial(_dw_kernel, block_k=config.block_k, block_n=config.block_n,
                           block_m=64, steps=m // 64, stages=min(config.stages, m // 64))
  return plgpu.kernel(
    body, out_type=jax.ShapeDtypeStruct((k, n), xc.dtype),
    grid=(k // config.block_k, n // config.block_n), grid_names=("k", "n"),
    compiler_params=plgpu.CompilerParams(
      lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )(xc, dyc)


def dw_reference(xc: jax.Array, dyc: jax.Array) -> jax.Array:
  """``xc.T @ dyc`` by XLA, in ``xc``'s dtype."""
  return lax.dot_general(xc, dyc, (((0,), (0,)), ((), ())),
                         preferred_element_type=jnp.float32).astype(xc.dtype)


def dx_reference(dyc: jax.Array, kernel: jax.Array) -> jax.Array:
  """``dyc @ kernel.T`` by XLA (cuBLAS on a GPU), accumulated in float32."""
  return lax.dot_general(dyc, kernel, (((1,), (1,)), ((), ())),
                         preferred_element_type=jnp.float32)


def _timed(shape: str, rows: int, product: str, fn, reference, sets, configs: dict,
           weight_bytes: int) -> list[dict]:
  """Rows of one product: XLA's, then ``fn`` under each of ``configs``, each checked against
  ``reference`` on the first input set (within :data:`TOLERANCE`) before it is timed over all
  of them."""
  from benchmarks.timing import device_time_ms

  want = reference(*sets[0]).astype(jnp.float32)
  results = [{"shape": shape, "rows": rows, "product": product, "kernel": "xla (cuBLAS)",
              "error": 0.0, "ms": device_time_ms(reference, sets)}]
  for name, config in configs.items():
    row = {"shape": shape, "rows": rows, "product": product, "kernel": f"mosaic {name}"}
    try:
      got = fn(*sets[0], config).astype(jnp.float32)
      got = got.sum(0) if got.ndim == 3 else got  # dX's partial sums
      row["error"] = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
      if row["error"] < TOLERANCE[product]:  # a wrong result's time is not a result
        row["ms"] = device_time_ms(functools.partial(fn, config=config), sets)
      else:
        row["failed"] = f"wrong: error above {TOLERANCE[product]:.1e}"
    except Exception as e:  # noqa: BLE001 - a configuration that fails to compile is a result
      row["failed"] = f"{type(e).__name__}: {str(e)[:200]}"
    results.append(row)
  for row in results:
    if "ms" in row:
      row["weight_tb_s"] = weight_bytes / (row["ms"] * 1e-3) / 1e12
  return results


def _measure(shape: str, rows: int, reps: int) -> list[dict]:
  n, k = SHAPES[shape]
  keys = jax.random.split(jax.random.key(rows), 3 * reps)
  # Distinct weights per call: none of them stays in L2 for the next (H200's is 50 MB).
  dys = [jax.random.normal(keys[3 * i], (rows, n), jnp.bfloat16) for i in range(reps)]
  kernels = [jax.random.normal(keys[3 * i + 1], (k, n), jnp.bfloat16) / n ** 0.5
             for i in range(reps)]
  xs = [jax.random.normal(keys[3 * i + 2], (rows, k), jnp.bfloat16) for i in range(reps)]
  weight_bytes = k * n * 2  # dX reads it, dW writes it
  return (_timed(shape, rows, "dX", dx_partials, dx_reference, list(zip(dys, kernels)),
                 DX_CONFIGS, weight_bytes)
          + _timed(shape, rows, "dW", dw, dw_reference, list(zip(xs, dys)), DW_CONFIGS,
                   weight_bytes))


def markdown(result: dict) -> str:
  """The probe's rows as a table."""
  lines = [f"# Mosaic GPU dX probe: {result['device']}, bfloat16, jax {result['jax']}", "",
           "dX (`dyc @ kernel.T`, Mosaic: float32 partial sums, not added) and dW (`xc.T @ "
           "dyc`) of the kept rows; device time of one call over distinct inputs; TB/s: the "
           "weight's bytes (read by dX, written by dW) over the time.",
           "", "| shape | rows | product | kernel | ms | weight TB/s | max rel error | failed |",
           "|---|---|---|---|---|---|---|---|"]
  for r in result["rows"]:
    lines.append(
      f"| {r['shape']} | {r['rows']} | {r['product']} | {r['kernel']} "
      f"| {r.get('ms', float('nan')):.4f} | {r.get('weight_tb_s', float('nan')):.2f} "
      f"| {r.get('error', float('nan')):.1e} | {r.get('failed', '')} |")
  return "\n".join(lines) + "\n"


def _main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.mosaic_probe")
  parser.add_argument("--out", type=pathlib.Path, required=True, help="JSON file")
  parser.add_argument("--reps", type=int, default=8, help="distinct input sets per timing")
  args = parser.parse_args(argv)
  if jax.devices()[0].platform != "gpu":
    parser.error("needs a GPU (Mosaic GPU kernels run on Hopper)")
  result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": []}
  for shape in SHAPES:
    for rows in ROWS:
      measured = _measure(shape, rows, args.reps)
      result["rows"] += measured
      args.out.write_text(json.dumps(result, indent=1) + "\n")  # a cut-short run keeps its rows
      args.out.with_suffix(".md").write_text(markdown(result))
      print("\n".join(markdown(result).splitlines()[-len(measured):]), flush=True)


if __name__ == "__main__":
  _main()
