"""Host time per layer of the torch reference's backward, against GPU time per layer.

A BERT-base-shaped stack of linear layers (per block: q, k, v, attention out ``768 -> 768``, FFN up
``768 -> 3072``, FFN down ``3072 -> 768``; ``--blocks`` blocks), batch ``--batch`` x ``--seq``
tokens right-padded to ``--real`` real tokens (``dY`` non-zero on the real rows only), run
forward and backward ``--steps`` times per path:

* ``nn.Linear``: torch's own layer (cuBLAS, autograd's C++ backward);
* ``dense``: :class:`~sebp_torch_ref.SEBPLinear` with ``impl="dense"`` (the reference's Python
  autograd Function around the same two GEMMs: its glue alone);
* ``triton``: ``impl="triton"``, every layer selecting its rows from ``dY``;
* ``triton+plan``: ``impl="triton"`` under :func:`~sebp_torch_ref.row_plan` of the padding mask.

Per path, with ``backward()`` run as autograd runs it by default (column ``backward on``:
``worker``, the GPU's nodes handed to autograd's worker thread for the device) and on the calling
thread (``caller``, under ``torch.autograd.set_multithreading_enabled(False)``): **host µs per
layer** of the forward and of the backward, ``perf_counter`` around the calls that issue the work,
with no synchronisation inside (the host's cost of issuing the launches); and **GPU µs per
layer** of the backward, CUDA events around a backward issued while the GPU is held by a sleep
kernel, so that the launches queue up first and the events time the kernels back to back,
without the host's gaps. Where host µs exceed GPU µs, an eager step waits on
Python, not on the GPU. ``--profile`` writes a cProfile top-20 (by own time) of the Triton path's
host work: the layers' :func:`sebp_torch_ref.kernels.sebp_grads` calls replayed on the main
thread (the autograd engine runs CUDA backward functions on its own thread, which cProfile does
not see). For ``triton+plan`` the table's last line splits the backward's host time per layer,
without a profiler: the layers' planned gradient calls (``linear_grads``) replayed on the main
thread, and within them the one GEMM launch (Triton's ``JITFunction.run`` and the driver's call);
the rest of the backward's host time is autograd's and the ``Function``'s. ``--kernel-grid``
measures each Triton path a second time with every launch through ``kernel[grid]`` instead of
:class:`~sebp_torch_ref.launch.CachedLaunch` (column ``launch``): the cached launch's A/B, in one
process.

GPU (BERT-base, 3 % real tokens)::

    python -m benchmarks.host_overhead_torch --out benchmarks/results/host_overhead_torch.json \\
        --profile benchmarks/results/host_overhead_torch_profile.txt

CPU check at tiny sizes: ``TRITON_INTERPRET=1 python -m benchmarks.host_overhead_torch --tiny
--out /tmp/h.json`` (host times only; they measure the interpreter, not launches).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pathlib
import pstats
import statistics
import time

import torch
from torch import nn

from benchmarks.kernel_options import KERNEL_GRID, launch_options
from sebp_torch_ref import RowPolicy, SEBPLinear, row_plan

__all__ = ["PATHS", "bert_stack", "measure"]

PATHS = ("nn.Linear", "dense", "triton", "triton+plan")
BERT_BLOCK = ((768, 768), (768, 768), (768, 768), (768, 768), (768, 3072), (3072, 768))  # (in, out)
TINY_BLOCK = ((48, 48), (48, 96), (96, 48))
_SLEEP_CYCLES = 400_000_000  # ~0.2 s at 2 GHz: longer than any stack's host time


def bert_stack(path: str, blocks: int, layer_shapes, device, dtype) -> nn.Sequential:
    """``blocks`` copies of ``layer_shapes`` as one chain of linear layers on ``device``."""
    torch.manual_seed(0)
    layers = []
    for _ in range(blocks):
        for k, n in layer_shapes:
            linear = nn.Linear(k, n, device=device, dtype=dtype)
            if path != "nn.Linear":
                impl = "dense" if path == "dense" else "triton"
                linear = SEBPLinear.from_linear(linear, RowPolicy(), impl)
            layers.append(linear)
    return nn.Sequential(*layers)


def _padded_batch(batch: int, seq: int, real: float, width: int, device, dtype):
    """``(x, mask)``: input ``(batch, seq, width)`` and the right-padding mask, about ``real`` of
    the tokens real (each sequence's length drawn from ``[real/2, 2 real] * seq``)."""
    gen = torch.Generator().manual_seed(0)
    mean = max(1, round(real * seq))
    lengths = torch.randint(max(1, mean // 2), min(seq, 2 * mean) + 1, (batch,), generator=gen)
    mask = torch.arange(seq)[None, :] < lengths[:, None]
    x = torch.randn(batch, seq, width, generator=gen).to(device, dtype)
    return x, mask.to(device)


def _hold_gpu() -> None:
    """Holds the GPU with a sleep kernel, so that the launches issued next queue up behind it
    (``torch.cuda._sleep`` is private; without it, GPU times include the host's gaps)."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        sleep(_SLEEP_CYCLES)


def measure(path: str, stack: nn.Sequential, x: torch.Tensor, mask: torch.Tensor, steps: int,
            caller_thread: bool = False) -> dict:
    """Host µs per layer (forward, backward) and GPU µs per layer (backward) of ``steps`` steps;
    ``caller_thread``: ``backward()`` with autograd's worker threads off."""
    cuda = x.device.type == "cuda"
    layers = len(stack)
    params = list(stack.parameters())
    dy_mask = mask[..., None].to(x.dtype)
    fwd_host, bwd_host, bwd_gpu = [], [], []
    for step in range(steps + 1):  # the first step compiles and warms the allocator
        leaf = x.detach().requires_grad_()
        plan = row_plan(mask) if path == "triton+plan" else contextlib.nullcontext()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with plan:
            y = stack(leaf)
        t1 = time.perf_counter()
        dy = torch.randn_like(y) * dy_mask
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            _hold_gpu()
            start.record()
        t2 = time.perf_counter()
        with torch.autograd.set_multithreading_enabled(not caller_thread):
            y.backward(dy)
        t3 = time.perf_counter()
        if cuda:
            end.record()
            torch.cuda.synchronize()
        if step:
            fwd_host.append((t1 - t0) / layers * 1e6)
            bwd_host.append((t3 - t2) / layers * 1e6)
            if cuda:
                bwd_gpu.append(start.elapsed_time(end) / layers * 1e3)
        for p in params:
            p.grad = None
    return {
        "path": path, "backward": "caller" if caller_thread else "worker", "layers": layers,
        "fwd_host_us": statistics.median(fwd_host), "bwd_host_us": statistics.median(bwd_host),
        "bwd_gpu_us": statistics.median(bwd_gpu) if bwd_gpu else None,
    }


def _layer_operands(stack: nn.Sequential, x: torch.Tensor, mask: torch.Tensor) -> list[tuple]:
    """Each layer's backward operands ``(dY, X, W, db's dtype)``, 2-D, with ``dY`` zero outside
    ``mask``."""
    operands = []
    h = x
    with torch.no_grad():
        for layer in stack:
            y = layer(h)
            dy = torch.randn_like(y) * mask[..., None].to(y.dtype)
            operands.append((dy.reshape(-1, y.shape[-1]), h.reshape(-1, h.shape[-1]), layer.weight,
                             layer.bias.dtype))
            h = y
    return operands


def profile_triton_host(stack: nn.Sequential, x: torch.Tensor, mask: torch.Tensor, calls: int) -> str:
    """cProfile top-20 (own time) of the Triton path's per-layer host work: each layer's
    ``sebp_grads`` call, on the main thread, with that layer's ``dY``, ``X`` and ``W``."""
    from sebp_torch_ref import kernels

    operands = _layer_operands(stack, x, mask)
    for dy, xx, w, bias_dtype in operands:  # compile and warm up
        kernels.sebp_grads(dy, xx, w, RowPolicy(), bias_dtype)
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        for dy, xx, w, bias_dtype in operands:
            kernels.sebp_grads(dy, xx, w, RowPolicy(), bias_dtype)
    profiler.disable()
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    out.write(f"sebp_grads host work: {calls} x {len(operands)} layer calls\n")
    stats.sort_stats("tottime").print_stats(20)
    return out.getvalue()


class _TimedLaunches:
    """Stands in for :func:`sebp_torch_ref.kernels._launcher`: the same launches, each one's host
    time appended to ``seconds``."""

    def __init__(self, launcher, seconds: list[float]) -> None:
        self.launcher, self.seconds = launcher, seconds

    def __call__(self, kernel, traceable: bool) -> "_TimedGrid":
        return _TimedGrid(self.launcher(kernel, traceable), self.seconds)


class _TimedGrid:
    """``kernel[grid](...)`` as ``launch`` runs it, timed."""

    def __init__(self, launch, seconds: list[float]) -> None:
        self.launch, self.seconds = launch, seconds

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            start = time.perf_counter()
            self.launch[grid](*args, **kwargs)
            self.seconds.append(time.perf_counter() - start)
        return run


def planned_host_split(stack: nn.Sequential, x: torch.Tensor, mask: torch.Tensor, calls: int) -> dict:
    """Host µs per layer of the planned Triton backward outside autograd (each layer's
    :func:`~sebp_torch_ref.grads.linear_grads` under a plan of ``mask``, on the main thread) and,
    within it, of its GEMM launch; medians over ``calls`` replays of every layer."""
    from unittest import mock

    from sebp_torch_ref import kernels
    from sebp_torch_ref.grads import linear_grads
    from sebp_torch_ref.plan import RowPlan

    plan = RowPlan(mask, check=False)
    operands = _layer_operands(stack, x, mask)

    def replay():
        for dy, xx, w, bias_dtype in operands:
            linear_grads(dy, xx, w, bias_dtype, RowPolicy(), "triton", plan, None)

    replay()  # compiles, warms the allocator and makes the plan's rows
    cuda = x.device.type == "cuda"
    grads_us, launch_us = [], []
    for _ in range(calls):
        launches: list[float] = []
        if cuda:
            torch.cuda.synchronize()
        with mock.patch.object(kernels, "_launcher", _TimedLaunches(kernels._launcher, launches)):
            start = time.perf_counter()
            replay()
            total = time.perf_counter() - start
        grads_us.append(total / len(operands) * 1e6)
        launch_us.append(sum(launches) / len(operands) * 1e6)
    if cuda:
        torch.cuda.synchronize()
    return {"grads_host_us": statistics.median(grads_us), "launch_host_us": statistics.median(launch_us),
            "launches_per_layer": len(launches) / len(operands)}


def markdown_table(result: dict) -> str:
    lines = [
        f"Host vs GPU time per layer, {result['device']}, {result['dtype']}, {result['layers']} layers, "
        f"batch {result['batch']} x {result['seq']}, {100 * result['real_fraction']:.1f} % real tokens, "
        f"torch {result['torch']}, triton {result['triton']}",
        "",
        "| path | launch | backward on | fwd host µs/layer | bwd host µs/layer | bwd GPU µs/layer | "
        "bwd host / GPU |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        gpu = r["bwd_gpu_us"]
        ratio = f"{r['bwd_host_us'] / gpu:.2f}" if gpu else "n/a"
        gpu_text = f"{gpu:.1f}" if gpu is not None else "n/a"
        lines.append(f"| {r['path']} | {r['launch']} | {r['backward']} | {r['fwd_host_us']:.1f} | "
                     f"{r['bwd_host_us']:.1f} | {gpu_text} | {ratio} |")
    for r in result["rows"]:
        split = r.get("split")
        if split is not None:
            lines += ["", f"{r['path']} ({r['launch']}, backward on the {r['backward']} thread) backward, "
                          f"host µs per layer: {r['bwd_host_us']:.1f}, "
                          f"of which autograd and the Function {r['bwd_host_us'] - split['grads_host_us']:.1f}, "
                          f"linear_grads {split['grads_host_us']:.1f} (the GEMM launch "
                          f"{split['launch_host_us']:.1f}, {split['launches_per_layer']:g} a layer; the rest "
                          f"{split['grads_host_us'] - split['launch_host_us']:.1f})"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    import triton

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=pathlib.Path, help="JSON file (a .md beside it)")
    parser.add_argument("--profile", type=pathlib.Path, help="write the cProfile top-20 here")
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--real", type=float, default=0.03, help="mean fraction of real tokens")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--tiny", action="store_true", help="CPU check: 1 tiny block, batch 2 x 16, 2 steps")
    parser.add_argument("--kernel-grid", action="store_true",
                        help="each Triton path also with every launch through kernel[grid]")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    shapes = BERT_BLOCK
    if args.tiny:
        shapes, args.blocks, args.batch, args.seq, args.steps = TINY_BLOCK, 1, 2, 16, 2
    x, mask = _padded_batch(args.batch, args.seq, args.real, shapes[0][0], device, dtype)
    result = {
        "device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": str(dtype).replace("torch.", ""),
        "torch": torch.__version__, "triton": triton.__version__, "batch": args.batch, "seq": args.seq,
        "real_fraction": float(mask.float().mean()), "layers": args.blocks * len(shapes), "rows": [],
    }
    replays = 1 if args.tiny else 5  # of every layer's gradients, for the split and the profile
    for path in args.paths:
        triton_path = path.startswith("triton")
        launches = ["cached", "kernel[grid]"] if triton_path and args.kernel_grid else ["cached"]
        stack = bert_stack(path, args.blocks, shapes, device, dtype)
        for launch in launches:
            with launch_options(KERNEL_GRID if launch == "kernel[grid]" else ()):
                # linear_grads' host time does not depend on the thread: split once, beside both.
                split = planned_host_split(stack, x, mask, calls=replays) if path == "triton+plan" else None
                for caller_thread in (False, True):
                    row = dict(measure(path, stack, x, mask, args.steps, caller_thread),
                               launch=launch if triton_path else "")
                    if split is not None:
                        row["split"] = split
                    result["rows"].append(row)
                if path == "triton" and launch == "cached" and args.profile is not None:
                    args.profile.parent.mkdir(parents=True, exist_ok=True)
                    args.profile.write_text(profile_triton_host(stack, x, mask, calls=replays))
        del stack
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    table = markdown_table(result)
    args.out.with_suffix(".md").write_text(table)
    print(table, flush=True)


if __name__ == "__main__":
    main()
