"""Bytes the collectives of a compiled multi-device training program move, dense against SEBP,
read from the compiled HLO without running it.

``benchmarks.multi_device`` times the programs; this counts what they send. It compiles the
``grad`` program of :func:`benchmarks.multi_device.programs` (LLaMA-3.2-3B with its exact layer
shapes, FSDP over a 1-D ``"data"`` mesh, 2 sequences of 4,096 tokens per device) for each
variant, from abstract parameters (nothing is allocated or run), and sums the result sizes of
its all-gathers, all-reduces, reduce-scatters, all-to-alls and collective permutes: per device,
what each receives or reduces. On CPU the program compiles for forced host devices in seconds::

    python -m benchmarks.collective_bytes --devices 2 --llama-layers 2 --out-dir /tmp/cb

The CPU compiler keeps float32 where a GPU's keeps bfloat16 and has no reduce-scatter pass (its
reductions stay all-reduces): compare the variants with each other, not with NCCL's bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import sys
from typing import Sequence

__all__ = ["COLLECTIVES", "collective_bytes", "variant_bytes", "main"]

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
               "s64": 8, "u64": 8, "f64": 8}
# A collective's result type: a synchronous collective's, or the ``-done`` half's of an async pair
# (its ``-start`` holds the operands beside the results, and in a GPU program its operands'
# types are not printed).
_INSTRUCTION = re.compile(r"= (.*?) (" + "|".join(COLLECTIVES) + r")(?:-done)?\(")
_ARRAY = re.compile(r"\b(" + "|".join(_ITEM_BYTES) + r")\[([\d,]*)\]")


def collective_bytes(hlo_text: str) -> dict[str, int]:
  """Bytes of the results of each kind of collective in a compiled HLO module's text (a tuple
  result summed over its arrays). A GPU program runs most collectives as async ``-start`` /
  ``-done`` pairs, and whether XLA keeps one async or makes it synchronous depends on what it can
  overlap: both forms count the same.

  >>> collective_bytes("%ag = bf16[4,8]{1,0} all-gather(bf16[2,8]{1,0} %p), dimensions={0}")
  {'all-gather': 64}
  >>> collective_bytes("%ags = ((bf16[2,8]{1,0}), bf16[4,8]{1,0}) all-gather-start(%p), "
  ...                  "dimensions={0}\\n%agd = bf16[4,8]{1,0} all-gather-done(%ags)")
  {'all-gather': 64}
  """
  totals: dict[str, int] = {}
  for result, kind in _INSTRUCTION.findall(hlo_text):
    size = 0
    for dtype, dims in _ARRAY.findall(result):
      count = 1
      for dim in filter(None, dims.split(",")):
        count *= int(dim)
      size += _ITEM_BYTES[dtype] * count
    totals[kind] = totals.get(kind, 0) + size
  return totals


def variant_bytes(layers: int, devices: int, scan_layers: bool = False) -> dict[str, dict]:
  """:func:`collective_bytes` of the FSDP ``grad`` program of ``dense``, ``sebp`` and
  ``sebp-dense-head`` (SEBP leaving the tied head to autodiff) on ``devices`` devices."""
  import jax
  import jax.numpy as jnp
  import optax
  from jax.sharding import NamedSharding, PartitionSpec as P

  from benchmarks import llama, multi_device
  from sebp_jax.sharding import fsdp_spec

  spec = llama.build(False, layers=layers, scan_layers=scan_layers)
  module = spec.jax_module()
  mesh = jax.make_mesh((devices,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:devices])
  shapes = jax.eval_shape(lambda: module.init(jax.random.key(0), jnp.ones((1, 8), jnp.int32)))
  params = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(
    leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, fsdp_spec(leaf.shape, "data", devices))),
    shapes)
  tokens = jax.ShapeDtypeStruct((multi_device.MODELS["llama"].per_device_batch * devices,
                                 spec.seq_len), jnp.int32, sharding=NamedSharding(mesh, P("data")))
  batch = {"input_ids": tokens, "attention_mask": tokens, "labels": tokens}
  results = {}
  for name, variant, dense_head in (("dense", "dense", False), ("sebp", "sebp", False),
                                    ("sebp-dense-head", "sebp", True)):
    _, grad, _ = multi_device.programs(spec, module, variant, mesh, optax.adamw(1e-4),
                                       dense_head)
    results[name] = collective_bytes(grad.lower(params, batch).compile().as_text())
  return results


def _markdown(result: dict) -> str:
  lines = [f"# Collective bytes per device: LLaMA-3.2-3B ({result['layers']} layers"
           f"{', scanned' if result['scan_layers'] else ''}), FSDP over {result['devices']} "
           "CPU devices, grad program", "",
           "MiB of collective results per device and call, from the compiled HLO (not run). "
           f"jax {result['jax']}.", "",
           "| variant | " + " | ".join(COLLECTIVES) + " | total |",
           "|---" * (len(COLLECTIVES) + 2) + "|"]
  for name, totals in result["variants"].items():
    cells = [f"{totals.get(kind, 0) / 2 ** 20:.1f}" for kind in COLLECTIVES]
    lines.append(f"| {name} | " + " | ".join(cells) + f" | {sum(totals.values()) / 2 ** 20:.1f} |")
  return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.collective_bytes",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=2)
  parser.add_argument("--llama-layers", type=int, default=2, metavar="L")
  parser.add_argument("--scan-layers", action="store_true")
  parser.add_argument("--out-dir", type=pathlib.Path, default=None)
  args = parser.parse_args(argv)
  if args.devices < 2:
    parser.error(f"--devices must be >= 2, got {args.devices}")
  # Read when JAX starts its backends: set before the first JAX computation.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={args.devices}")
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax

  if jax.device_count() < args.devices:
    raise SystemExit(f"--devices {args.devices}: only {jax.device_count()} devices here")
  result = {"benchmark": "collective_bytes", "layers": args.llama_layers,
            "scan_layers": args.scan_layers, "devices": args.devices, "jax": jax.__version__,
            "variants": variant_bytes(args.llama_layers, args.devices, args.scan_layers)}
  text = _markdown(result)
  print(text)
  if args.out_dir is not None:
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"collective_bytes_l{args.llama_layers}{'_scan' if args.scan_layers else ''}"
    (args.out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out_dir / f"{stem}.md").write_text(text)
  return result


if __name__ == "__main__":
  main(sys.argv[1:])
