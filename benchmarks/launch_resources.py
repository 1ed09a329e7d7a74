"""Registers and shared memory of the Pallas (Triton-lowered) backward's kernels, and how many of
each kernel's programs fit on one SM of an H100 / H200, found on CPU (no GPU time).

The backward of one layer is exported for CUDA with the tiles :func:`block_config` picks on a
Hopper GPU of :data:`~benchmarks.ptx_resources.SMS` SMs; each Pallas kernel in it carries its
Triton IR (MLIR bytecode, in the custom call's ``backend_config``), which jaxlib's own MLIR turns
back into text, Triton compiles for sm_90 and :mod:`benchmarks.ptx_resources` reads. A launch of
more programs than fit at once runs in waves: ``waves`` is its grid over the programs that fit
on all SMs (1.09: a second wave of 9 % of the programs, as long as the first).

Usage: ``python -m benchmarks.launch_resources --out <dir>/launch_resources.json`` (a markdown
table beside it). Reads jaxlib internals (``jax._src.lib``); the IR is this jax's lowering and the
counts this Triton's, which may differ from the GPU machine's.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import tempfile
from unittest import mock

import jax
import jax.numpy as jnp
import triton
from jax import export
from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib.mlir import ir as mlir
from jax._src.lib.triton import dialect as triton_dialect

from benchmarks.ptx_resources import SMS, TARGET, Resources, resources, write_report
from sebp_jax.backends import pallas as pallas_backend
from sebp_jax.policy import RowPolicy

# (name, rows M, in features K, out features N): BERT-base b32 and LLaMA-3.2-3B b1 / b4 layers.
LAYERS = [
    ("bert_base_attn", 16384, 768, 768),
    ("bert_base_ffn_up", 16384, 768, 3072),
    ("bert_base_ffn_down", 16384, 3072, 768),
    ("llama32_3b_attn_q_o_b1", 4096, 3072, 3072),
    ("llama32_3b_attn_k_v_b1", 4096, 3072, 1024),
    ("llama32_3b_mlp_up_b1", 4096, 3072, 8192),
    ("llama32_3b_mlp_down_b1", 4096, 8192, 3072),
    ("llama32_3b_mlp_up_b4", 16384, 3072, 8192),
]
_TRITON_CALL = "@__gpu$xla.gpu.triton("


@dataclasses.dataclass(frozen=True)
class Launch:
    kernel: str
    grid: int  # programs launched
    num_stages: int
    resources: Resources

    @property
    def waves(self) -> float:
        return self.grid / (self.resources.programs_per_sm * SMS)


def _unescape(text: str) -> bytes:
    """An MLIR string attribute's bytes (``\\XX`` hex escapes)."""
    out, i = bytearray(), 0
    while i < len(text):
        if text[i] != "\\":
            out += text[i].encode()
            i += 1
        elif text[i + 1] in '\\"':
            out.append(ord(text[i + 1]))
            i += 2
        else:
            out.append(int(text[i + 1:i + 3], 16))
            i += 3
    return bytes(out)


def _triton_calls(module: str):
    """``(backend_config fields, Triton IR text)`` of each Pallas kernel in an exported module."""
    start = 0
    while (call := module.find(_TRITON_CALL, start)) >= 0:
        begin = module.find('ir = "', call) + len('ir = "')
        end = begin
        while module[end] != '"':
            end += 2 if module[end] == "\\" else 1
        config = module[module.find("backend_config", call):begin] + module[end:module.find("}", end)]
        fields = dict(re.findall(r'(\w+) = "?(\w+)"?', config))
        # JAX's own context knows the upstream dialects the kernels use besides Triton's (the
        # `gpu` dialect's barrier, in dW's split fix-up).
        context = jax_mlir.make_ir_context()
        triton_dialect.register_dialect(context)
        with context:
            ir = mlir.Module.parse(_unescape(module[begin:end])).operation.get_asm(enable_debug_info=False)
        yield fields, ir
        start = end


def layer_launches(num_rows: int, in_features: int, out_features: int, dtype=jnp.bfloat16):
    """Each kernel launch of one layer's backward (default policy) with Hopper's tiles, and the
    :class:`~sebp_jax.backends.pallas.BlockConfig` they come from."""
    with mock.patch.multiple(pallas_backend, _gpu_generation=lambda: "hopper", _sm_count=lambda: SMS):
        config = pallas_backend.block_config(num_rows, in_features, out_features, dtype)
    shapes = [jax.ShapeDtypeStruct(s, dtype) for s in
              ((num_rows, in_features), (in_features, out_features), (num_rows, out_features))]
    backward = jax.jit(lambda x, k, dy: pallas_backend.backward(x, k, dy, policy=RowPolicy(), config=config))
    module = export.export(backward, platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*shapes).mlir_module()
    launches = []
    for fields, ir in _triton_calls(module):
        warps, stages = int(fields["num_warps"]), int(fields["num_stages"])
        with tempfile.TemporaryDirectory() as tmp:
            with open(f"{tmp}/kernel.ttir", "w") as f:
                f.write(ir)
            compiled = triton.compile(f"{tmp}/kernel.ttir", target=TARGET,
                                      options=dict(num_warps=warps, num_stages=stages))
        grid = int(fields["grid_x"]) * int(fields["grid_y"]) * int(fields["grid_z"])
        launches.append(Launch(fields["name"], grid, stages, resources(compiled, warps)))
    return launches, config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file for the rows")
    args = parser.parse_args()
    rows = []
    for name, M, K, N in LAYERS:
        launches, config = layer_launches(M, K, N)
        for launch in launches:
            rows.append(dict(layer=name, M=M, K=K, N=N, kernel=launch.kernel, grid=launch.grid,
                             num_stages=launch.num_stages, **dataclasses.asdict(launch.resources),
                             shared_kb=launch.resources.shared_bytes // 1024,
                             programs_per_sm=launch.resources.programs_per_sm, waves=round(launch.waves, 2),
                             config=dataclasses.asdict(config), jax=jax.__version__, triton=triton.__version__))
            print({k: v for k, v in rows[-1].items() if k != "config"}, flush=True)
    write_report(args.out, rows, f"Each kernel of one layer's Pallas backward (bf16, Hopper tiles, {SMS} SMs), "
                 f"Triton IR from jax {jax.__version__}, compiled for sm_90 by Triton {triton.__version__} on "
                 "CPU. waves: programs launched over the programs that fit on all SMs at once.",
                 dict(layer="layer", kernel="kernel", grid="programs", num_warps="warps", num_stages="stages",
                      registers="registers", spill_bytes="spill bytes", shared_kb="shared KB",
                      programs_per_sm="per SM", waves="waves"))

if __name__ == "__main__":
    main()
