"""Registers and shared memory of the torch reference's GEMM launch, and how many of its programs
fit on one SM of an H100 / H200, found on CPU (no GPU time).

The launch plan of :mod:`sebp_torch_ref.kernels` sizes dW's split (about two programs per SM over
the output tiles) and the persistent dX launch (two programs per SM) for two resident programs
per SM. ``triton.compile`` lowers ``_grads_kernel`` with a plan's constexprs for sm_90 and
:mod:`benchmarks.ptx_resources` reads what one program holds. The arguments get the
specialisations Triton gives them at run time (pointers and integers divisible by 16 hinted so,
integers equal to 1 made constants): without them the loads are not pipelined and the counts
describe another kernel (2026-11-29: ~255 registers, no ``cp.async``).

Usage: ``python -m benchmarks.launch_resources_torch --out <dir>/launch_resources_torch.json`` (a
markdown table beside it). The numbers are the installed Triton's; the GPU machine's may differ.
Imports nothing from ``sebp_jax``.
"""

from __future__ import annotations

import argparse
import dataclasses
from unittest import mock

import torch
import triton
from triton.compiler import ASTSource

from benchmarks.ptx_resources import SMS, TARGET, Resources, resources, write_report
from sebp_torch_ref import kernels

# Triton's pointer type of an operand of each dtype the kernels take.
POINTER_TYPES = {torch.bfloat16: "*bf16", torch.float32: "*fp32"}
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


def grads_pointer_types(dtype: torch.dtype) -> dict[str, str]:
    """Triton's type of each pointer argument of the GEMM launch (``kernels._grads_kernel``), by
    name, for operands of ``dtype``."""
    operand = POINTER_TYPES[dtype]
    return dict(dy_ptr=operand, w_ptr=operand, x_ptr=operand, dx_ptr=operand, dw_ptr=operand, db_ptr=operand,
                perm_ptr="*i32", count_ptr="*i32", counters_ptr="*i32", partial_ptr="*fp32",
                db_partial_ptr="*fp32")


def launch_resources(M: int, N: int, K: int, dtype: torch.dtype, *, with_db: bool, gather: bool = True,
                     dx_slots: bool = True, split: int | None = None) -> tuple[Resources, kernels._GemmPlan]:
    """The GEMM launch (dX and dW) of one layer as its plan builds it for a GPU of ``SMS`` SMs
    (``split`` overrides dW's), compiled for sm_90: what one program holds, and the plan."""
    sizing = dict(_sms=lambda device: SMS, **({} if split is None else dict(_dw_split=lambda *_: split)))
    with mock.patch.multiple(kernels, **sizing):
        plan = kernels._build_gemm_plan(M, N, K, dtype, True, True, with_db, gather, dx_slots,
                                        torch.device("cuda"), kernels.default_config(dtype))
    constants = dict(plan.gemm)
    options = {k: constants.pop(k) for k in ("num_warps", "num_stages")}
    kernel = kernels._grads_kernel
    ints = dict(M=M, N=N, K=K, dw_programs=plan.dw_programs, dx_programs=plan.dx_programs,
                stride_dym=N, stride_dyn=1, stride_wn=K, stride_wk=1, stride_xm=K, stride_xk=1,
                stride_dxm=K, stride_dxk=1)
    constants.update({name: 1 for name, value in ints.items() if value == 1})
    pointers = grads_pointer_types(dtype)
    signature = {n: "constexpr" if n in constants else pointers.get(n, "i32") for n in kernel.arg_names}
    hinted = [n for n in kernel.arg_names if n in pointers or (n not in constants and ints.get(n, 1) % 16 == 0)]
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(kernel.arg_names.index(n),): v for n, v in constants.items()},
                       attrs={(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in hinted})
    return resources(triton.compile(source, target=TARGET, options=options), options["num_warps"]), plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file for the rows")
    args = parser.parse_args()
    rows = []
    for name, M, N, K, bias in LAYERS:
        res, plan = launch_resources(M, N, K, torch.bfloat16, with_db=bias)
        rows.append(dict(layer=name, M=M, N=N, K=K, bias=bias, dw_split=plan.split, dx_programs=plan.dx_programs,
                         **dataclasses.asdict(res), shared_kb=res.shared_bytes // 1024,
                         programs_per_sm=res.programs_per_sm, triton=triton.__version__))
        print(rows[-1], flush=True)
    write_report(args.out, rows, f"The planned GEMM launch of each layer, bf16, compiled for sm_90 by Triton "
                 f"{triton.__version__} on CPU ({SMS} SMs assumed); the launch plan assumes 2 programs per SM.",
                 dict(layer="layer", bias="bias", dw_split="dW split", dx_programs="dX programs",
                      registers="registers", spill_bytes="spill bytes", shared_kb="shared KB", num_warps="warps",
                      programs_per_sm="programs per SM"))

if __name__ == "__main__":
    main()
