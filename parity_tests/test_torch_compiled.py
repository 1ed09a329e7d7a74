"""sebp_linear under torch.compile: one graph, no graph break, the eager gradients.

Under ``torch.compile`` the SEBP layer is the op ``sebp_torch_ref::linear`` whose registered
autograd calls ``sebp_torch_ref::linear_backward`` or, for a Triton layer on CUDA,
``sebp_torch_ref::linear_backward_triton`` (``sebp_torch_ref/compiled.py``). These tests
compile a small patched model with ``fullgraph=True`` (a graph break is an error) and compare its
gradients with the eager SEBP model's and with dense autograd's, on padded batches, under a row
plan and under ``dense_backward()``.

``impl="triton"`` runs on CPU under the Triton interpreter, in a fresh process started by
``test_triton_interpreter`` (the interpreter must be on before Triton is imported), as in
test_torch_sebp_linear.py.
"""

from __future__ import annotations

import contextlib
import copy
import math
import threading

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend

from parity_tests.triton_interpreter import INTERPRET, run_triton_cases
from sebp_torch_ref import apply_sebp, dense_backward, row_plan
from sebp_torch_ref.compiled import _active_first
from sebp_torch_ref.policy import active_first_permutation

IMPLS = ["torch", "triton"]
BACKENDS = ["aot_eager", "inductor"]
SCENARIOS = ["padded", "nonfinite", "plan", "plan_drops", "dense_backward"]
BATCH, SEQ, IN_FEATURES = 3, 11, 45
LENGTHS = [4, 11, 0]  # one short sequence, one full, one all padding


def _skip_unavailable(impl: str) -> None:
    if impl == "triton" and not INTERPRET:
        pytest.skip("runs in test_triton_interpreter's subprocess (TRITON_INTERPRET=1)")
    if INTERPRET and impl != "triton":
        pytest.skip("the interpreter process runs only the Triton cases")


class _Net(torch.nn.Module):
    """Odd widths, a layer without bias and one with a frozen weight (no dW: the op gets no X)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(IN_FEATURES, 31)
        self.mid = torch.nn.Linear(31, 23, bias=False)
        self.frozen = torch.nn.Linear(23, 37)
        self.down = torch.nn.Linear(37, 29)
        self.frozen.weight.requires_grad_(False)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.up(x))
        h = torch.tanh(self.mid(h))
        return self.down(torch.relu(self.frozen(h)) + h.sum(-1, keepdim=True))


def _case(scenario: str):
    """``(x, dy, mask)``: float32 inputs and an output gradient zero on the padding rows (a NaN in
    one padding row for ``"nonfinite"``: a NaN is never dropped; non-zero padding rows for
    ``"plan_drops"``, which a row plan drops by its contract)."""
    gen = torch.Generator().manual_seed(len(scenario))
    x = torch.randn(BATCH, SEQ, IN_FEATURES, generator=gen)
    mask = torch.arange(SEQ)[None, :] < torch.tensor(LENGTHS)[:, None]
    dy = torch.randn(BATCH, SEQ, 29, generator=gen) * mask[..., None]
    if scenario == "nonfinite":
        dy[2, 5, 3] = math.nan
    if scenario == "plan_drops":
        dy += ~mask[..., None]
    return x, dy, mask


def _fresh_padded_case():
    """A padded case for the torch backend's tests, with Dynamo's caches cleared."""
    _skip_unavailable("torch")
    torch._dynamo.reset()
    return _case("padded")


def _grads(model, x, dy, context):
    """Gradients of the parameters that require them, and of ``x``."""
    x = x.clone().requires_grad_()
    with context():
        y = model(x)
    y.backward(dy)
    grads = {name.removeprefix("_orig_mod."): p.grad  # a compiled model's names: _orig_mod.<name>
             for name, p in model.named_parameters() if p.requires_grad}
    grads["x"] = x.grad
    return grads


def _models(impl: str):
    torch.manual_seed(0)
    dense = _Net()
    sebp = copy.deepcopy(dense)
    assert apply_sebp(sebp, impl=impl) == 4
    return dense, sebp


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("impl", IMPLS)
def test_compiled_grads_equal_eager_and_dense(impl, backend, scenario):
    _skip_unavailable(impl)
    torch._dynamo.reset()
    x, dy, mask = _case(scenario)
    context = contextlib.nullcontext
    if scenario.startswith("plan"):
        context = lambda: row_plan(mask)  # noqa: E731
    elif scenario == "dense_backward":
        context = dense_backward
    dense, sebp = _models(impl)
    compiled_model = copy.deepcopy(sebp)
    compiled = torch.compile(compiled_model, backend=backend, fullgraph=True)
    # Every op between the layers is row-wise: the plan's gradient is the dense one of dY * mask.
    want = _grads(dense, x, dy * mask[..., None] if scenario == "plan_drops" else dy, contextlib.nullcontext)
    eager = _grads(sebp, x, dy, context)
    got = _grads(compiled, x, dy, context)
    assert got.keys() == want.keys() == eager.keys()
    assert "frozen.weight" not in got
    for name in want:
        torch.testing.assert_close(got[name], eager[name], rtol=1e-5, atol=1e-5, equal_nan=True, msg=name)
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, equal_nan=True, msg=name)
    if scenario == "nonfinite":
        assert got["down.weight"].isnan().any()  # the NaN row was kept


def _graph_ops(graphs):
    """A counting AOTAutograd backend: records the forward and backward graphs' call targets."""
    def compiler(kind):
        def compile_graph(gm, _):
            graphs.setdefault(kind, []).append({str(node.target) for node in gm.graph.nodes})
            return make_boxed_func(gm.forward)
        return compile_graph
    return aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"))


@pytest.mark.parametrize("impl", IMPLS)
def test_one_graph_with_the_sebp_backward_op(impl):
    """No graph break, planned or not; the forward traced into the graph's own ops (the layer's
    ``triton_op`` has none of its own), the SEBP backward op inside the compiled backward."""
    _skip_unavailable(impl)
    torch._dynamo.reset()
    x, dy, mask = _case("padded")
    _, sebp = _models(impl)
    for context in (contextlib.nullcontext, lambda: row_plan(mask)):
        with context():
            explanation = torch._dynamo.explain(sebp)(x)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        assert explanation.graph_count == 1
    graphs = {}
    compiled = torch.compile(sebp, backend=_graph_ops(graphs), fullgraph=True)
    with row_plan(mask):
        compiled(x.requires_grad_()).backward(dy)
    assert len(graphs["forward"]) == len(graphs["backward"]) == 1
    assert not any(op.startswith("sebp_torch_ref") for op in graphs["forward"][0])
    assert {"aten.addmm.default", "aten.mm.default"} <= graphs["forward"][0]
    assert "sebp_torch_ref.linear_backward.default" in graphs["backward"][0]
    # A planned Triton layer's dX comes in the plan's order and a gather in the graph puts it in
    # place (which Inductor can fuse into dX's consumers); the torch backend returns dX in place.
    assert ("aten.index.Tensor" in graphs["backward"][0]) == (impl == "triton")


def test_steps_reuse_the_compiled_graphs():
    """A new mask per step runs the graph traced under a plan (no recompilation); each of the
    three modes (no plan, plan, dense backward) is traced once."""
    x, dy, _ = _fresh_padded_case()
    dense, sebp = _models("torch")
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(sebp, backend=counter, fullgraph=True)
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        mask = torch.rand(BATCH, SEQ, generator=gen) < 0.5
        dy_step = dy * mask[..., None]
        want = _grads(dense, x, dy_step, contextlib.nullcontext)
        for context in (contextlib.nullcontext, lambda: row_plan(mask), dense_backward):
            for model in (dense, compiled):
                model.zero_grad()
            got = _grads(compiled, x, dy_step, context)
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, msg=f"{step} {name}")
    assert counter.frame_count == 3


def test_plan_of_another_thread_is_not_seen():
    """The compiled path reads the plan per thread, as eager code reads its ContextVar: a plan
    entered by another thread leaves this thread's compiled step unplanned (scoring dY)."""
    x, dy, mask = _fresh_padded_case()
    dense, sebp = _models("torch")
    compiled = torch.compile(sebp, backend="aot_eager", fullgraph=True)
    dy = dy + (~mask[..., None]) * 1.0  # non-zero outside the mask: a plan here would drop it
    want = _grads(dense, x, dy, contextlib.nullcontext)
    entered, release = threading.Event(), threading.Event()

    def hold_plan():
        with row_plan(torch.zeros(BATCH, SEQ, dtype=torch.bool)):
            entered.set()
            release.wait(60)

    holder = threading.Thread(target=hold_plan)
    holder.start()
    try:
        assert entered.wait(60)
        got = _grads(compiled, x, dy, contextlib.nullcontext)
    finally:
        release.set()
        holder.join()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, msg=name)


def test_compiled_under_autocast():
    """Under autocast, as eagerly: a bfloat16 output and float32 gradients of the float32 weights."""
    x, dy, mask = _fresh_padded_case()
    _, sebp = _models("torch")
    compiled = torch.compile(copy.deepcopy(sebp), backend="inductor", fullgraph=True)
    grads = []
    for model in (sebp, compiled):
        with torch.autocast("cpu", dtype=torch.bfloat16), row_plan(mask):
            y = model(x)
        assert y.dtype == torch.bfloat16
        y.backward(dy.bfloat16())
        grads.append([p.grad for p in model.parameters() if p.requires_grad])
    for want, got in zip(*grads):
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7 * want.abs().max().item())


def test_plan_check_names_the_layer():
    """``row_plan(check=True)`` raises from the compiled backward, naming the layer."""
    x, dy, mask = _fresh_padded_case()
    _, sebp = _models("torch")
    compiled = torch.compile(sebp, backend="aot_eager", fullgraph=True)
    with row_plan(mask, check=True):
        y = compiled(x)
    with pytest.raises(ValueError, match="layer down has"):
        y.backward(dy + 1.0)


@pytest.mark.parametrize("rows, density", [(0, 0.5), (1, 0.0), (1, 1.0), (37, 0.0), (37, 0.4), (37, 1.0)])
def test_graph_permutation_is_the_eager_one(rows, density):
    """The compiled path's plan permutation (a sort, which CSE shares) is the eager one."""
    if INTERPRET:
        pytest.skip("the interpreter process runs only the Triton cases")
    keep = torch.rand(rows, generator=torch.Generator().manual_seed(rows)) < density
    for got, want in zip(_active_first(keep), active_first_permutation(keep)):
        assert got.dtype == want.dtype == torch.int32
        assert torch.equal(got, want)


@pytest.mark.parametrize("impl, check, device, want", [
    ("triton", False, "cuda", "linear_backward_triton"),  # planned or not
    ("triton", True, "cuda", "linear_backward"),  # a plan's check reads dY on the host
    ("triton", False, "cpu", "linear_backward"),
    ("torch", False, "cuda", "linear_backward"),  # reads count on the host
])
def test_backward_op_choice(impl, check, device, want):
    """Which op a compiled layer's backward calls: the ``triton_op`` that Inductor launches only
    for an unchecked Triton layer on CUDA (CUDA tensors faked: no GPU needed)."""
    if INTERPRET:
        pytest.skip("under the interpreter every layer takes the custom op (the module's docstring)")
    pytest.importorskip("triton")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from sebp_torch_ref.compiled import _backward_op

    with FakeTensorMode():
        dy = torch.empty(6, 5, device=device)
    op = _backward_op(dy, impl, check)
    assert op is getattr(torch.ops.sebp_torch_ref, want)


ROWS = ["plan", "plan_dx_slots", "scored", "top_n"]
GRADS_ASKED = [(True, True, True), (True, False, False), (False, True, True)]  # need_x, need_w, bias
M, N, K = 37, 29, 45


def _fake_backward_args(rows: str, need_x: bool, need_w: bool, bias: bool) -> tuple:
    """The backward ops' arguments as fake CUDA tensors (inside a ``FakeTensorMode``), bfloat16:
    under a row plan (``"plan"``; ``"plan_dx_slots"``: its dX in the plan's order) or without one
    (``"scored"``: rows scored from dY; ``"top_n"``: ranked for a Top-N policy)."""
    dy = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    x = torch.empty(M, K, device="cuda", dtype=torch.bfloat16) if need_w else None
    weight = torch.empty(N, K, device="cuda", dtype=torch.bfloat16) if need_x else None
    keep = perm = count = None
    if rows.startswith("plan"):
        keep = torch.ones(M, dtype=torch.bool, device="cuda")
        perm = torch.empty(M, dtype=torch.int32, device="cuda")
        count = torch.empty(1, dtype=torch.int32, device="cuda")
    return (dy, x, weight, keep, perm, count, 0.0, 5 if rows == "top_n" else None, "triton", False,
            "layer", torch.bfloat16 if bias else None, rows == "plan_dx_slots")


@pytest.fixture
def dw_split(monkeypatch):
    """Sets dW's row split of the launch plans (sized from a GPU's SM count otherwise) and the SM
    count the dX launch is sized from (an H100's or H200's: fake CUDA tensors have no device to
    ask), with no plan cached under another split before or after the test; skips where the
    ``triton_op`` never runs."""
    if INTERPRET:
        pytest.skip("under the interpreter the triton_op is never called")
    pytest.importorskip("triton")
    from sebp_torch_ref import kernels

    def set_split(split: int) -> None:
        monkeypatch.setattr(kernels, "_dw_split", lambda *_: split)
        monkeypatch.setattr(kernels, "_sms", lambda device: 132)
        kernels._default_gemm_plan.cache_clear()

    yield set_split
    kernels._default_gemm_plan.cache_clear()


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("need_x, need_w, bias", GRADS_ASKED)
def test_triton_op_body_traces_with_fake_cuda_tensors(dw_split, need_x, need_w, bias, rows):
    """The ``triton_op``'s body, which Inductor traces on CUDA, runs on fake CUDA tensors (no GPU):
    the gradients asked for, in order, of the shapes and dtypes the custom op's fake gives."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    dw_split(2)
    with FakeTensorMode():
        args = _fake_backward_args(rows, need_x, need_w, bias)
        got = torch.ops.sebp_torch_ref.linear_backward_triton(*args)
        want = torch.ops.sebp_torch_ref.linear_backward(*args)  # its registered fake
    assert [(g.shape, g.dtype, g.device.type) for g in got] == [(w.shape, w.dtype, "cuda") for w in want]
    assert got[0].shape[0] == (M + (rows == "plan_dx_slots") if need_x else N)


class _TargetDriver:
    """Triton's driver as torch's Triton-IR generation asks it: an sm_90 target (no GPU here)."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cuda")


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("need_x, need_w, bias", GRADS_ASKED)
def test_torch_finds_what_each_traced_launch_writes(monkeypatch, dw_split, rows, need_x, need_w, bias,
                                                    split):
    """Under ``torch.compile`` every launch of the ``triton_op``'s body becomes a graph node whose
    written arguments torch finds by analysing the kernel's Triton IR; where that analysis fails,
    torch takes every argument as written and the graph copies them all (``dY``, ``X`` and ``W``
    included) before each launch: a silent slowdown, not an error. For each launch the body makes
    (planned, unplanned, Top-N; dW split or not), the analysis, run here as Inductor runs it (for
    an sm_90 target), succeeds, finds a write, and finds none to the layer's operands or the
    plan's rows (which the launches also pass for the arguments they do not use)."""
    import triton
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
    dw_split(split)
    with FakeTensorMode():
        args = _fake_backward_args(rows, need_x, need_w, bias)
        torch.ops.sebp_torch_ref.linear_backward_triton(*args)
    want = {"_grads_kernel"} | (set() if rows.startswith("plan") else {"_select_kernel", "_compact_kernel"})
    want |= {"_rank_key_kernel"} if rows == "top_n" else set()
    assert {kernel.fn.__name__ for kernel, _ in launches} == want

    monkeypatch.setattr(triton.runtime.driver, "_active", _TargetDriver())
    operands = {id(t) for t in args if isinstance(t, torch.Tensor)}
    for kernel, kwargs in launches:
        name = kernel.fn.__name__
        with monkeypatch.context() as m:  # torch's fallback logs a warning: make it fail the test
            m.setattr(triton_kernel_wrap.log, "warning", lambda *a, **k: pytest.fail(f"{name}: {a[0]}"))
            accesses = triton_kernel_wrap.identify_accessed_tensors(kernel, dict(kwargs), {})
        written = {dep.name for dep in accesses.read_writes.writes
                   if isinstance(kwargs.get(dep.name), torch.Tensor)}
        assert written, name
        assert not [n for n in written if id(kwargs[n]) in operands], (name, written)


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("rows", ROWS)
def test_traced_gradients_are_written_only_by_the_kernels(monkeypatch, dw_split, rows, split):
    """In the ``triton_op``'s body as AOTAutograd traces it (functionalized), every gradient is
    the kernel's write into a fresh ``empty`` buffer: nothing else writes into part of it first.
    Any torch write there (say a ``zero_()`` of ``dx_slots``' zero row) becomes a ``slice_scatter``
    into the empty buffer, which Inductor lowers to a kernel that writes the whole buffer: the
    bytes SEBP exists not to write (``benchmarks/NOTES_torch.md``, "v24 and v25 measured")."""
    import triton
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import dispatch_functionalize
    from torch.fx.experimental.proxy_tensor import make_fx

    monkeypatch.setattr(triton.runtime.driver, "_active", _TargetDriver())
    dw_split(split)
    with FakeTensorMode():
        args = _fake_backward_args(rows, True, True, True)
        at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

        def backward(*tensors):
            full = list(args)
            for i, t in zip(at, tensors):
                full[i] = t
            return torch.ops.sebp_torch_ref.linear_backward_triton(*full)

        graph = make_fx(dispatch_functionalize(backward))(*(args[i] for i in at)).graph
    outputs = next(node for node in graph.nodes if node.op == "output").args[0]
    assert len(outputs) == 3  # dX, dW, db
    for output in outputs:
        launch, name = output.args  # getitem(the launch's written buffers, the kernel's argument)
        assert launch.target is torch.ops.higher_order.triton_kernel_wrapper_functional, output
        assert launch.kwargs["kwargs"][name].target is torch.ops.aten.empty.memory_format, name


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs CUDA (Triton compiled)")
@pytest.mark.parametrize("scenario", ["plan", "plan_drops", "padded"])
def test_inductor_launches_the_triton_kernels(scenario):
    """On CUDA a Triton layer's compiled backward is the ``triton_op``: Inductor's code launches
    the kernels itself (a planned layer's GEMM launch; an unplanned one's select, compact and GEMM
    launches), with no call of the custom op, and the gradients are eager SEBP's and dense
    autograd's (of ``dY * mask`` for ``plan_drops``)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    x, dy, mask = (t.cuda() for t in _case(scenario))
    context = contextlib.nullcontext if scenario == "padded" else lambda: row_plan(mask)
    dense, sebp = (model.cuda() for model in _models("triton"))
    compiled = torch.compile(copy.deepcopy(sebp), backend="inductor", fullgraph=True)
    want = _grads(dense, x, dy * mask[..., None], contextlib.nullcontext)
    eager = _grads(sebp, x, dy, context)
    got, code = run_and_get_code(_grads, compiled, x, dy, context)
    backward_code = code[-1]
    kernels = ["_grads_kernel"] + (["_select_kernel", "_compact_kernel"] if scenario == "padded" else [])
    assert all(kernel in backward_code for kernel in kernels)
    assert "linear_backward" not in backward_code  # neither op: the kernels are launched inline
    for name in want:
        torch.testing.assert_close(got[name], eager[name], rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.skipif(INTERPRET, reason="this is the launcher")
def test_triton_interpreter():
    """Runs this module's Triton cases on CPU in a fresh process under ``TRITON_INTERPRET=1``."""
    run_triton_cases(__file__, "triton")
