"""Registers and shared memory of the torch reference's GEMM launch, and how many of its programs
fit on one SM of an H100 / H200, found on CPU (no GPU time).

The launch plan of :mod:`sebp_torch_ref.kernels` sizes dW's split (about two programs per SM over
the output tiles) and the persistent dX launch (two programs per SM) for two resident programs
per SM. Whether two fit is the compiled kernel's: ``triton.compile`` lowers ``_grads_kernel``
with a plan's constexprs for sm_90, and ``ptxas -v`` reports the registers per thread. The
arguments get the specialisations Triton gives them at run time (pointers and integers divisible
by 16 hinted so, integers equal to 1 made constants): without them the loads are not pipelined
and the counts describe another kernel (2026-11-29: ~255 registers, no ``cp.async``).

Usage: ``python -m benchmarks.launch_resources_torch --out benchmarks/results/<dir>/launch_resources_torch.json``
(a markdown table beside it). The numbers are the installed Triton's; the GPU machine's may differ.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from sebp_torch_ref import kernels

TARGET = GPUTarget("cuda", 90, 32)  # an H100 / H200
SMS = 132
# Per SM of compute capability 9.0: registers, shared memory (228 KB, 1 KB of it reserved per
# program), warps. Registers are allocated per warp in units of 256.
REGISTERS, SHARED, RESERVED, WARPS = 65536, 228 * 1024, 1024, 64
_POINTER = {torch.bfloat16: "*bf16", torch.float32: "*fp32"}
# (name, rows, out features N, in features K, bias): BERT-base b32 and LLaMA-3.2-3B b1 layers.
LAYERS = [
    ("bert_base_attn", 16384, 768, 768, True),
    ("bert_base_ffn_up", 16384, 3072, 768, True),
    ("bert_base_ffn_down", 16384, 768, 3072, True),
    ("llama32_3b_attn_q_o_b1", 4096, 3072, 3072, False),
    ("llama32_3b_attn_k_v_b1", 4096, 1024, 3072, False),
    ("llama32_3b_mlp_up_b1", 4096, 8192, 3072, False),
    ("llama32_3b_mlp_down_b1", 4096, 3072, 8192, False),
]


@dataclasses.dataclass(frozen=True)
class Resources:
    registers: int  # per thread
    spill_bytes: int  # spill stores per thread
    shared_bytes: int  # per program
    num_warps: int
    dw_split: int
    dx_programs: int

    @property
    def programs_per_sm(self) -> int:
        per_warp = -(-self.registers * 32 // 256) * 256
        return min(REGISTERS // (per_warp * self.num_warps),
                   SHARED // (self.shared_bytes + RESERVED), WARPS // self.num_warps)


def _ptxas() -> str:
    ptxas = get_ptxas(TARGET.arch) if "arch" in inspect.signature(get_ptxas).parameters else get_ptxas()
    return getattr(ptxas, "path", ptxas)


def launch_resources(M: int, N: int, K: int, dtype: torch.dtype, *, with_db: bool, gather: bool = True,
                     dx_slots: bool = True, do_dx: bool = True, do_dw: bool = True,
                     split: int | None = None) -> Resources:
    """The GEMM launch of one layer as its plan builds it for a GPU of ``SMS`` SMs (``split``
    overrides dW's), compiled for sm_90: what one program holds."""
    def sms(device):
        return SMS
    saved = kernels._sms, kernels._dw_split
    kernels._sms = sms
    if split is not None:
        kernels._dw_split = lambda *_: split
    try:
        plan = kernels._build_gemm_plan(M, N, K, dtype, do_dx, do_dw, with_db, gather, dx_slots,
                                        torch.device("cuda"), kernels.default_config(dtype, K))
    finally:
        kernels._sms, kernels._dw_split = saved
    constants = dict(plan.gemm)
    options = {k: constants.pop(k) for k in ("num_warps", "num_stages")}
    kernel = kernels._grads_kernel
    ints = dict(M=M, N=N, K=K, dw_programs=plan.dw_programs, dx_programs=plan.dx_programs,
                stride_dym=N, stride_dyn=1, stride_wn=K, stride_wk=1, stride_xm=K, stride_xk=1,
                stride_dxm=K, stride_dxk=1)
    constants.update({name: 1 for name, value in ints.items() if value == 1})
    pointer = _POINTER[dtype]
    pointers = {n: pointer if n in ("dy_ptr", "w_ptr", "x_ptr", "dx_ptr", "dw_ptr", "db_ptr")
                else "*i32" if n in ("perm_ptr", "count_ptr", "arrivals_ptr") else "*fp32"
                for n in kernel.arg_names if n.endswith("_ptr")}
    signature = {n: "constexpr" if n in constants else pointers.get(n, "i32") for n in kernel.arg_names}
    hinted = [n for n in kernel.arg_names
              if n in pointers or (n not in constants and ints.get(n, 1) % 16 == 0)]
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(kernel.arg_names.index(n),): v for n, v in constants.items()},
                       attrs={(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in hinted})
    compiled = triton.compile(source, target=TARGET, options=options)
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/k.ptx", "w") as f:
            f.write(compiled.asm["ptx"])
        report = subprocess.run([_ptxas(), "-v", f"--gpu-name=sm_{TARGET.arch}a",
                                 f"{tmp}/k.ptx", "-o", f"{tmp}/k.cubin"],
                                capture_output=True, text=True, check=True).stderr
    spills = re.search(r"(\d+) bytes spill stores", report)
    return Resources(int(re.search(r"Used (\d+) registers", report).group(1)),
                     int(spills.group(1)) if spills else 0, compiled.metadata.shared,
                     options["num_warps"], plan.split, plan.dx_programs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file for the rows")
    args = parser.parse_args()
    rows = []
    for name, M, N, K, bias in LAYERS:
        res = launch_resources(M, N, K, torch.bfloat16, with_db=bias)
        rows.append(dict(layer=name, M=M, N=N, K=K, bias=bias, **dataclasses.asdict(res),
                         programs_per_sm=res.programs_per_sm, triton=triton.__version__))
        print(rows[-1], flush=True)
    lines = [f"The planned GEMM launch of each layer, bf16, compiled for sm_90 by Triton {triton.__version__} "
             f"on CPU ({SMS} SMs assumed); the launch plan assumes 2 programs per SM.", "",
             "| layer | bias | dW split | dX programs | registers | spill bytes | shared KB | warps | programs per SM |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['layer']} | {r['bias']} | {r['dw_split']} | {r['dx_programs']} | {r['registers']} | "
              f"{r['spill_bytes']} | {r['shared_bytes'] // 1024} | {r['num_warps']} | {r['programs_per_sm']} |"
              for r in rows]
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    with open(args.out.removesuffix(".json") + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
