"""Every launch configuration of the reference's Triton kernels compiles for an sm_90 GPU, on CPU.

The interpreter (the other CPU tests) runs the kernels' Python, not Triton's compiler, so a
configuration that the compiler rejects (a constexpr branch, a mask of the wrong type, a shape
``tl.dot`` refuses) would otherwise first fail on a GPU. ``triton.compile`` lowers an
``ASTSource`` for a ``GPUTarget`` through Triton IR to PTX and a cubin without a GPU or a driver.
The configurations are the ones the launch plans of :mod:`sebp_torch_ref.kernels` build (their
constexprs and launch options), for both GEMM operand widths.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from parity_tests.triton_interpreter import INTERPRET

pytestmark = [
  pytest.mark.skipif(INTERPRET, reason="the interpreter replaces the kernels that Triton compiles"),
]
triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from benchmarks.launch_resources_torch import POINTER_TYPES, grads_pointer_types  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)  # an H100 / H200
_LAUNCH_OPTIONS = ("num_warps", "num_stages")


def _compile(kernel, constants: dict, pointers: dict[str, str], floats: tuple[str, ...] = ()) -> None:
  """Compiles ``kernel`` with ``constants`` (constexprs and launch options); every other argument
  is a pointer typed by ``pointers`` (by name) or an int32, or a float32 where named in ``floats``."""
  options = {k: constants[k] for k in _LAUNCH_OPTIONS if k in constants}
  constexprs = {k: v for k, v in constants.items() if k not in _LAUNCH_OPTIONS}
  missing = [n for n in kernel.arg_names if n.endswith("_ptr") and n not in pointers]
  assert not missing, missing  # an untyped pointer would be compiled as an int
  signature = {n: "constexpr" if n in constexprs else pointers.get(n, "fp32" if n in floats else "i32")
               for n in kernel.arg_names}
  source = ASTSource(fn=kernel, signature=signature,
                     constexprs={(kernel.arg_names.index(n),): v for n, v in constexprs.items()})
  compiled = triton.compile(source, target=TARGET, options=options)
  assert compiled.asm["ptx"] and compiled.asm["cubin"]


# (DO_DX, DO_DW, WITH_DB): db is summed by dW's programs only.
_PRODUCTS = [(True, True, True), (True, True, False), (True, False, False), (False, True, True),
             (False, True, False)]
# (GATHER, DX_SLOTS): planned (rows read through perm; dX in place or in the plan's order), or
# the unplanned compacted copies.
_ROWS = [(True, False), (True, True), (False, False)]


def _grads_cases():
  for dtype, (do_dx, do_dw, with_db), (gather, dx_slots), split, dx_first, steal in itertools.product(
      POINTER_TYPES, _PRODUCTS, _ROWS, (1, 3), (True, False), (False, True)):
    if (split > 1 and not do_dw) or (dx_slots and not do_dx) or (not dx_first and not (do_dx and do_dw)):
      continue  # the same program as split 1 / without slots / in the other order
    if steal and (dx_first or split == 1 or not (do_dx and do_dw)):
      continue  # dX's tiles are taken from a counter only behind dW's split programs
    yield pytest.param(dtype, do_dx, do_dw, with_db, gather, dx_slots, split, dx_first, steal,
                       id=f"{dtype}-dx{do_dx:d}-dw{do_dw:d}-db{with_db:d}-gather{gather:d}-slots{dx_slots:d}"
                          f"-split{split}-dxfirst{dx_first:d}-steal{steal:d}")


@pytest.mark.parametrize("dtype, do_dx, do_dw, with_db, gather, dx_slots, split, dx_first, steal",
                         list(_grads_cases()))
def test_grads_kernel_compiles(monkeypatch, dtype, do_dx, do_dw, with_db, gather, dx_slots, split, dx_first,
                               steal):
  from sebp_torch_ref import kernels

  monkeypatch.setattr(kernels, "_dw_split", lambda *_: split)  # sized from a GPU's SM count
  monkeypatch.setattr(kernels, "_sms", lambda device: 132)  # an H100's or H200's
  monkeypatch.setattr(kernels, "_DX_FIRST_WAVES", 0 if dx_first else math.inf)
  monkeypatch.setattr(kernels, "_DX_STEAL", steal)
  M, N, K = 300, 3072, 768  # BERT-base's FFN up, a few kept rows
  plan = kernels._build_gemm_plan(M, N, K, dtype, do_dx, do_dw, with_db, gather, dx_slots,
                                  torch.device("cuda"), kernels.default_config(dtype))
  assert plan.split == (split if do_dw else 1) and plan.gemm["DX_FIRST"] == dx_first
  assert plan.gemm["DX_STEAL"] == steal
  _compile(kernels._grads_kernel, plan.gemm, grads_pointer_types(dtype))


def _layer_torch_variants():
  from benchmarks.layer_torch import _LAUNCH_VARIANTS

  return [pytest.param(options, id=name) for name, options in _LAUNCH_VARIANTS.items()]


@pytest.mark.parametrize("options", _layer_torch_variants())
def test_layer_torch_launch_variants_compile(monkeypatch, options):
  """Each launch A/B that ``benchmarks.layer_torch`` times on the GPU names attributes the kernels
  module has and lowers for sm_90, on BERT-base's FFN up under a row plan (bias, dX in the plan's
  order): a typo or a tile that does not compile fails here, not in a device call."""
  from benchmarks.kernel_options import launch_options
  from sebp_torch_ref import kernels

  monkeypatch.setattr(kernels, "_sms", lambda device: 132)
  with launch_options(tuple(options.items())):
    plan = kernels._default_gemm_plan(300, 3072, 768, torch.bfloat16, True, True, True, True, True,
                                      torch.device("cuda"))
  _compile(kernels._grads_kernel, plan.gemm, grads_pointer_types(torch.bfloat16))


@pytest.mark.parametrize("dtype", list(POINTER_TYPES), ids=str)
@pytest.mark.parametrize("keep_given, with_db", [(False, False), (False, True), (True, False)])
def test_select_kernel_compiles(dtype, keep_given, with_db):
  from sebp_torch_ref import kernels

  plan = kernels._select_plan(4096)
  _compile(kernels._select_kernel, dict(plan.select, KEEP_GIVEN=keep_given, WITH_DB=with_db),
           dict(dy_ptr=POINTER_TYPES[dtype], keep_ptr="*i8", block_counts_ptr="*i32", db_partial_ptr="*fp32"),
           floats=("threshold",))


@pytest.mark.parametrize("dtype", list(POINTER_TYPES), ids=str)
@pytest.mark.parametrize("copy_dy, copy_x, with_db", [(False, False, False), (True, True, True),
                                                     (True, False, True), (True, True, False)])
def test_compact_kernel_compiles(dtype, copy_dy, copy_x, with_db):
  from sebp_torch_ref import kernels

  plan = kernels._select_plan(4096)
  pointer = POINTER_TYPES[dtype]
  _compile(kernels._compact_kernel, dict(plan.compact, COPY_DY=copy_dy, COPY_X=copy_x, WITH_DB=with_db),
           dict(keep_ptr="*i8", block_counts_ptr="*i32", perm_ptr="*i32", count_ptr="*i32", dy_ptr=pointer,
                x_ptr=pointer, dy_kept_ptr=pointer, x_kept_ptr=pointer, db_partial_ptr="*fp32", db_ptr=pointer))


@pytest.mark.parametrize("dtype", list(POINTER_TYPES), ids=str)
def test_rank_key_kernel_compiles(dtype):
  from sebp_torch_ref import kernels

  _compile(kernels._rank_key_kernel, dict(kernels._select_plan(4096).select),
           dict(dy_ptr=POINTER_TYPES[dtype], key_ptr="*fp32"), floats=("threshold",))


@pytest.mark.parametrize("with_db", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("split", [1, 7])
@pytest.mark.parametrize("layer", ["bert_base_attn", "bert_base_ffn_down", "llama32_3b_mlp_up_b1"])
def test_bf16_launch_fits_two_programs_per_sm(layer, with_db, split):
  """The launch plan sizes dW's split and the persistent dX launch for two programs per SM, so two
  must fit on every layer: registers at most 128 per thread at 8 warps. Before the dW fix-up went
  a quarter tile at a time and db's column sums through the MMA, BERT's launches held 164-172
  registers (NOTES_torch, "Why: one program per SM"); up to v29 the 128-row dX tile of layers
  whose dX is wider than 1024 held 166-170 (v29 on the GPU, NOTES_torch "v29 measured")."""
  from benchmarks.launch_resources_torch import LAYERS, launch_resources

  _, M, N, K, _ = next(entry for entry in LAYERS if entry[0] == layer)
  resources, plan = launch_resources(M, N, K, torch.bfloat16, with_db=with_db, split=split)
  assert plan.split == split and resources.spill_bytes == 0
  assert resources.programs_per_sm >= 2, resources


@pytest.mark.parametrize("layer, dx_first", [("bert_base_attn", False), ("bert_base_ffn_up", False),
                                             ("llama32_3b_attn_q_o_b1", True), ("llama32_3b_mlp_up_b1", True)])
def test_dx_programs_go_first_where_dw_fills_two_waves(monkeypatch, layer, dx_first):
  """On an H200 (132 SMs, 264 slots) BERT's dW launches hold 36-288 programs: dW's go first, dX's
  fill the wave's tail; LLaMA-3B's q/o and MLP hold 576 and 1,536 (2.2 and 5.8 waves): dX's go
  first, or their long column streams start only once dW has nearly run (NOTES_torch "v30
  measured")."""
  from benchmarks.launch_resources_torch import LAYERS
  from sebp_torch_ref import kernels

  monkeypatch.setattr(kernels, "_sms", lambda device: 132)
  _, M, N, K, with_db = next(entry for entry in LAYERS if entry[0] == layer)
  plan = kernels._build_gemm_plan(M, N, K, torch.bfloat16, True, True, with_db, True, True,
                                  torch.device("cuda"), kernels.default_config(torch.bfloat16))
  assert plan.gemm["DX_FIRST"] == dx_first, plan.dw_programs
  assert plan.gemm["DX_FIRST"] == (plan.dw_programs >= 2 * 264)
