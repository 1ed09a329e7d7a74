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

import pytest
import torch

from parity_tests.triton_interpreter import INTERPRET

pytestmark = [
  pytest.mark.skipif(INTERPRET, reason="the interpreter replaces the kernels that Triton compiles"),
]
triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)  # an H100 / H200
_POINTER = {torch.bfloat16: "*bf16", torch.float32: "*fp32"}
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
  for dtype, (do_dx, do_dw, with_db), (gather, dx_slots), split in itertools.product(
      _POINTER, _PRODUCTS, _ROWS, (1, 3)):
    if (split > 1 and not do_dw) or (dx_slots and not do_dx):
      continue  # the same program as split 1 / without slots
    yield pytest.param(dtype, do_dx, do_dw, with_db, gather, dx_slots, split,
                       id=f"{dtype}-dx{do_dx:d}-dw{do_dw:d}-db{with_db:d}-gather{gather:d}-slots{dx_slots:d}-split{split}")


@pytest.mark.parametrize("dtype, do_dx, do_dw, with_db, gather, dx_slots, split", list(_grads_cases()))
def test_grads_kernel_compiles(monkeypatch, dtype, do_dx, do_dw, with_db, gather, dx_slots, split):
  from sebp_torch_ref import kernels

  monkeypatch.setattr(kernels, "_dw_split", lambda *_: split)  # sized from a GPU's SM count
  M, N, K = 300, 3072, 768  # BERT-base's FFN down: dX on the narrow tile
  plan = kernels._build_gemm_plan(M, N, K, dtype, do_dx, do_dw, with_db, gather, dx_slots,
                                  torch.device("cuda"), kernels.default_config(dtype, K))
  assert plan.split == (split if do_dw else 1)
  pointer = _POINTER[dtype]
  _compile(kernels._grads_kernel, plan.gemm, dict(
    dy_ptr=pointer, w_ptr=pointer, x_ptr=pointer, dx_ptr=pointer, dw_ptr=pointer, db_ptr=pointer,
    perm_ptr="*i32", count_ptr="*i32", arrivals_ptr="*i32", partial_ptr="*fp32", db_partial_ptr="*fp32"))


@pytest.mark.parametrize("dtype", list(_POINTER), ids=str)
@pytest.mark.parametrize("keep_given, with_db", [(False, False), (False, True), (True, False)])
def test_select_kernel_compiles(dtype, keep_given, with_db):
  from sebp_torch_ref import kernels

  plan = kernels._select_plan(4096)
  _compile(kernels._select_kernel, dict(plan.select, KEEP_GIVEN=keep_given, WITH_DB=with_db),
           dict(dy_ptr=_POINTER[dtype], keep_ptr="*i8", block_counts_ptr="*i32", db_partial_ptr="*fp32"),
           floats=("threshold",))


@pytest.mark.parametrize("dtype", list(_POINTER), ids=str)
@pytest.mark.parametrize("copy_dy, copy_x, with_db", [(False, False, False), (True, True, True),
                                                     (True, False, True), (True, True, False)])
def test_compact_kernel_compiles(dtype, copy_dy, copy_x, with_db):
  from sebp_torch_ref import kernels

  plan = kernels._select_plan(4096)
  pointer = _POINTER[dtype]
  _compile(kernels._compact_kernel, dict(plan.compact, COPY_DY=copy_dy, COPY_X=copy_x, WITH_DB=with_db),
           dict(keep_ptr="*i8", block_counts_ptr="*i32", perm_ptr="*i32", count_ptr="*i32", dy_ptr=pointer,
                x_ptr=pointer, dy_kept_ptr=pointer, x_kept_ptr=pointer, db_partial_ptr="*fp32", db_ptr=pointer))


@pytest.mark.parametrize("dtype", list(_POINTER), ids=str)
def test_rank_key_kernel_compiles(dtype):
  from sebp_torch_ref import kernels

  _compile(kernels._rank_key_kernel, dict(kernels._select_plan(4096).select),
           dict(dy_ptr=_POINTER[dtype], key_ptr="*fp32"), floats=("threshold",))


# --------------------------------------------------------------------------- traced launches

class _TargetDriver:
  """Triton's driver as torch's Triton-IR generation asks it: the target only (no GPU here)."""

  def get_current_target(self):
    return TARGET

  def get_active_torch_device(self):
    return torch.device("cuda")


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("rows", ["plan", "plan_dx_slots", "scored", "top_n"])
@pytest.mark.parametrize("need_x, need_w, bias", [(True, True, True), (True, False, False), (False, True, True)])
def test_torch_finds_what_each_traced_launch_writes(monkeypatch, rows, need_x, need_w, bias, split):
  """Under ``torch.compile`` every launch of the ``triton_op``'s body becomes a graph node whose
  written arguments torch finds by analysing the kernel's Triton IR; where that analysis fails,
  torch takes every argument as written and the graph copies them all (``dY``, ``X`` and ``W``
  included) before each launch: a silent slowdown, not an error. For each launch the body makes
  (planned, unplanned, Top-N), the analysis, run here as Inductor runs it (for an sm_90 target),
  succeeds, finds a write, and finds none to the layer's operands or the plan's rows (which the
  launches also pass for the arguments they do not use: dW unsplit has no partial sums)."""
  from torch._higher_order_ops import triton_kernel_wrap
  from torch._subclasses.fake_tensor import FakeTensorMode

  from sebp_torch_ref import kernels

  launches = []

  class _Recorded:
    def __init__(self, kernel):
      self.kernel = kernel

    def __getitem__(self, grid):
      def launch(*args, **kwargs):
        launches.append((self.kernel, {**dict(zip(self.kernel.arg_names, args)), **kwargs}))
      return launch

  def launcher(kernel, traceable):
    assert traceable, f"{kernel.fn.__name__} launched untraced in the triton_op's body"
    return _Recorded(kernel)

  monkeypatch.setattr(kernels, "_launcher", launcher)
  monkeypatch.setattr(kernels, "_dw_split", lambda *_: split)  # sized from a GPU's SM count
  kernels._default_gemm_plan.cache_clear()  # plans cached with another split
  M, N, K = 37, 29, 45
  with FakeTensorMode():
    dy = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    x = torch.empty(M, K, device="cuda", dtype=torch.bfloat16) if need_w else None
    weight = torch.empty(N, K, device="cuda", dtype=torch.bfloat16) if need_x else None
    keep = perm = count = None
    if rows.startswith("plan"):
      keep = torch.ones(M, dtype=torch.bool, device="cuda")
      perm = torch.empty(M, dtype=torch.int32, device="cuda")
      count = torch.empty(1, dtype=torch.int32, device="cuda")
    torch.ops.sebp_torch_ref.linear_backward_triton(
      dy, x, weight, keep, perm, count, 0.0, 5 if rows == "top_n" else None, "triton", False, "layer",
      torch.bfloat16 if bias else None, rows == "plan_dx_slots")
  want = {"_grads_kernel"} | (set() if rows.startswith("plan") else {"_select_kernel", "_compact_kernel"})
  assert {kernel.fn.__name__ for kernel, _ in launches} == want | ({"_rank_key_kernel"} if rows == "top_n" else set())

  monkeypatch.setattr(triton.runtime.driver, "_active", _TargetDriver())
  operands = {id(t) for t in (dy, x, weight, keep, perm, count) if t is not None}
  for kernel, kwargs in launches:
    with monkeypatch.context() as m:  # torch's fallback logs a warning: make it fail the test
      m.setattr(triton_kernel_wrap.log, "warning", lambda *a, **k: pytest.fail(f"{kernel.fn.__name__}: {a[0]}"))
      accesses = triton_kernel_wrap.identify_accessed_tensors(kernel, dict(kwargs), {})
    written = {dep.name for dep in accesses.read_writes.writes if isinstance(kwargs.get(dep.name), torch.Tensor)}
    assert written, kernel.fn.__name__
    assert not [n for n in written if id(kwargs[n]) in operands], (kernel.fn.__name__, written)
