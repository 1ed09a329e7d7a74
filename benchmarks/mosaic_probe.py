"""Can a TMA-fed Mosaic GPU kernel stream a weight faster than cuBLAS at a few dozen kept rows?

LLaMA-3.2-3B at batch 1 keeps ~85 of 4096 rows; its dX and dW then stream each weight at ~1.8
TB/s, in our Triton-lowered kernels and in cuBLAS on the same compacted rows alike, where the
H200 reads 4.8 (benchmarks/NOTES.md, "Next (2026-11-30)"). No Triton table entry moved that, so
the next kernel would be of another kind. This probe times the question before any backend is
built: dX of the kept rows, ``dyc @ kernel.T``, as a Mosaic GPU kernel (Pallas' ``plgpu``: TMA
loads into swizzled shared memory, ``max_concurrent_steps`` of them in flight, WGMMA), each
program one column block of ``dX`` and one share of the contraction, so that every SM streams a
share of the weight; beside it XLA's GEMM (cuBLAS) on the same rows. The partial sums are added
by XLA afterwards (timed apart): a backend would sum them in the kernel, as ours does.

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

__all__ = ["ProbeConfig", "CONFIGS", "SHAPES", "dx_partials", "dx_reference", "markdown"]


@dataclasses.dataclass(frozen=True)
class ProbeConfig:
  """One launch of :func:`dx_partials`.

  Attributes:
    block_k: columns of ``dX`` (rows of the weight) per program.
    block_n: contraction columns per pipeline step (one TMA load of each operand).
    splits: programs that share one column block's contraction, each summing its own share.
    stages: pipeline steps in flight (``max_concurrent_steps``).
  """

  block_k: int = 128
  block_n: int = 64
  splits: int = 4
  stages: int = 4


CONFIGS = {
  "k128_n64_s4": ProbeConfig(),
  "k128_n64_s8": ProbeConfig(splits=8),
  "k128_n128_s4": ProbeConfig(block_n=128, stages=3),
  "k64_n64_s4": ProbeConfig(block_k=64, stages=6),
}
# LLaMA-3.2-3B's weights as (contraction N, dX columns K): dX = dY (M, N) @ kernel (K, N)^T.
SHAPES = {"llama_up": (8192, 3072), "llama_down": (3072, 8192), "llama_qo": (3072, 3072)}
ROWS = (64, 128)  # kept rows, padded to WGMMA's 64-row steps (b1: ~85 kept)


def _dx_partials_kernel(dy_gmem, w_gmem, out_gmem, *, rows: int, block_k: int, block_n: int,
                        steps: int, stages: int):
  col, part = lax.axis_index("k"), lax.axis_index("s")

  def accumulate(acc_ref):
    plgpu.emit_pipeline(
      lambda _, dy_smem, w_smem: plgpu.wgmma(acc_ref, dy_smem,
                                             plgpu.transpose_ref(w_smem, (1, 0))),
      grid=(steps,),
      in_specs=[plgpu.BlockSpec((rows, block_n), lambda j: (0, part * steps + j)),
                plgpu.BlockSpec((block_k, block_n), lambda j: (col, part * steps + j))],
      max_concurrent_steps=stages,
    )(dy_gmem, w_gmem)
    return acc_ref[...]

  acc = pl.run_scoped(accumulate, plgpu.ACC((rows, block_k)))

  @functools.partial(pl.run_scoped, out_smem=plgpu.SMEM((rows, block_k), jnp.float32))
  def store(out_smem):
    out_smem[...] = acc
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[part, :, pl.ds(col * block_k, block_k)])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


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


def dx_reference(dyc: jax.Array, kernel: jax.Array) -> jax.Array:
  """``dyc @ kernel.T`` by XLA (cuBLAS on a GPU), accumulated in float32."""
  return lax.dot_general(dyc, kernel, (((1,), (1,)), ((), ())),
                         preferred_element_type=jnp.float32)


def _measure(shape: str, rows: int, reps: int) -> list[dict]:
  from benchmarks.timing import device_time_ms

  n, k = SHAPES[shape]
  keys = jax.random.split(jax.random.key(rows), 2 * reps)
  # Distinct weights per call: none of them stays in L2 for the next (H200's is 50 MB).
  sets = [(jax.random.normal(keys[2 * i], (rows, n), jnp.bfloat16),
           jax.random.normal(keys[2 * i + 1], (k, n), jnp.bfloat16) / n ** 0.5)
          for i in range(reps)]
  weight_bytes = k * n * 2
  reference = dx_reference(*sets[0])
  results = [{"shape": shape, "rows": rows, "kernel": "xla (cuBLAS)", "error": 0.0,
              "ms": device_time_ms(dx_reference, sets)}]
  for name, config in CONFIGS.items():
    row = {"shape": shape, "rows": rows, "kernel": f"mosaic {name}"}
    try:
      got = dx_partials(*sets[0], config).sum(0)
      row["error"] = float(jnp.max(jnp.abs(got - reference)) / jnp.max(jnp.abs(reference)))
      row["ms"] = device_time_ms(functools.partial(dx_partials, config=config), sets)
      row["summed_ms"] = device_time_ms(
        lambda a, b, c=config: dx_partials(a, b, c).sum(0).astype(jnp.bfloat16), sets)
    except Exception as e:  # noqa: BLE001 - a configuration that fails to compile is a result
      row["failed"] = f"{type(e).__name__}: {str(e)[:200]}"
    results.append(row)
  for row in results:
    if "ms" in row:
      row["weight_tb_s"] = weight_bytes / (row["ms"] * 1e-3) / 1e12
  return results


def markdown(result: dict) -> str:
  """The probe's rows as a table."""
  lines = [f"# Mosaic GPU dX probe: {result['device']}, bfloat16, jax {result['jax']}", "",
           "dX of the kept rows (`dyc @ kernel.T`); device time of one call over distinct "
           "inputs; TB/s: the weight's bytes over the kernel's time (partial sums not added).",
           "", "| shape | rows | kernel | ms | summed ms | weight TB/s | max rel error | failed |",
           "|---|---|---|---|---|---|---|---|"]
  for r in result["rows"]:
    lines.append(
      f"| {r['shape']} | {r['rows']} | {r['kernel']} | {r.get('ms', float('nan')):.4f} "
      f"| {r.get('summed_ms', float('nan')):.4f} | {r.get('weight_tb_s', float('nan')):.2f} "
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
      result["rows"] += _measure(shape, rows, args.reps)
      args.out.write_text(json.dumps(result, indent=1) + "\n")  # a cut-short run keeps its rows
      args.out.with_suffix(".md").write_text(markdown(result))
      print(markdown(result).splitlines()[-1], flush=True)


if __name__ == "__main__":
  _main()
