"""Backward of one linear layer on CUDA (bf16): dense cuBLAS vs SEBP vs the ideal.

The torch side of the layer benchmark: the same shapes, active fractions and ideal as the Pallas
one, written as JSON rows that stand beside the JAX results in one table.

* ``dense``: autograd of ``F.linear`` (cuBLAS dX and dW over all M rows).
* ``sebp_triton`` / ``sebp_torch``: autograd of ``sebp_linear`` with that backend (exact policy).
* ``sebp_triton_gather``: ``sebp_triton`` with the kept rows of dY and X read in place through the
  permutation instead of copied to contiguous buffers first (what it does for an LM head's
  vocabulary-wide gradient): whether the copies pay for themselves.
* ``sebp_triton_plan``: the one launch a layer runs under a row plan (what the compiled models
  run per layer): :func:`~sebp_torch_ref.kernels.sebp_gemms` on the full ``dY`` and ``X``, read
  through the plan's permutation, ``dX`` in the plan's order; the plan (the active prefixes) made
  once, outside the timing.
* ``sebp_triton_plan_per_tile``: the same launch with one dX program per tile of all ``M`` rows, as
  before v27's persistent dX programs, ``sebp_triton_plan_min_slice_8``: dW's split using a slice
  per 8 kept row blocks at least (the default is 16), ``sebp_triton_plan_dw_first`` and
  ``sebp_triton_plan_dx_first``: dW's or dX's programs first in the grid on every layer (the
  default puts dX's first where dW's fill two waves of the GPU or more),
  ``sebp_triton_plan_dx_shares``: dX's programs behind dW's each looping over a fixed share of
  the tiles instead of taking their next from a counter,
  ``sebp_triton_plan_dx_k64``: dX's tile 64 columns wide (the default's is 128). A/Bs of the
  launch's plan; their eager times also rebuild it per call, so compare graph times.
* ``ideal``: autograd of ``F.linear`` on rows compacted beforehand (cuBLAS on the active rows only,
  no selection): the floor SEBP aims at.

Active rows are a right-padded prefix of each sequence; ``dY`` holds nonzero random data there and
zeros elsewhere. Times are medians of ``triton.testing.do_bench``, twice: ``bwd_ms`` calls the
backward eagerly (Python, autograd and launch overhead included, as in an eager training step),
``bwd_ms_cuda_graph`` replays it from a CUDA graph (GPU time only; ``sebp_torch`` reads ``count``
on the host, so it cannot be captured and has none).

Usage: ``python -m benchmarks.layer_torch --out benchmarks/results/torch_layer_<card>.json
[--check] [--tune]``; a markdown table is written beside the JSON (``.md``). Imports nothing from
``sebp_jax``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.testing

from benchmarks.kernel_options import launch_options
from sebp_torch_ref import sebp_linear
from sebp_torch_ref import kernels
from sebp_torch_ref.policy import RowPolicy


@dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    seq: int
    in_features: int  # K
    out_features: int  # N

    @property
    def rows(self) -> int:
        return self.batch * self.seq


SHAPES = [
    Shape("bert_base_attn", 32, 512, 768, 768),
    Shape("bert_base_ffn_up", 32, 512, 768, 3072),
    Shape("bert_base_ffn_down", 32, 512, 3072, 768),
    *[
        Shape(f"llama32_3b_{name}_b{batch}", batch, 4096, k, n)
        for batch in (1, 8)
        for name, k, n in [
            ("mlp_up", 3072, 8192),
            ("mlp_down", 8192, 3072),
            ("attn_q_o", 3072, 3072),
            ("attn_k_v", 3072, 1024),
        ]
    ],
    # The tied LM head at b1, a planned layer in the LLaMA step too (dX reads all 128,256 columns
    # of W per row block: its few programs behind dW's were v27's +1.5 ms, NOTES_torch "v30").
    Shape("llama32_3b_lm_head_b1", 1, 4096, 3072, 128256),
]
FRACTIONS = (1.0, 0.5, 0.2, 0.1, 0.05, 0.02)
# The planned launch as the kernels module plans it, and its A/Bs (benchmarks.kernel_options): private
# attributes of the launch plan replaced.
_LAUNCH_VARIANTS = {
    "sebp_triton_plan": {},
    "sebp_triton_plan_per_tile": dict(_dx_programs=lambda tiles, device: tiles),
    "sebp_triton_plan_min_slice_8": dict(_MIN_SLICE_BLOCKS=8),
    "sebp_triton_plan_dw_first": dict(_DX_FIRST_WAVES=math.inf),
    "sebp_triton_plan_dx_first": dict(_DX_FIRST_WAVES=0),
    "sebp_triton_plan_dx_shares": dict(_DX_STEAL=False),
    # dX's tile 64 columns wide instead of 128: twice the live tiles where few rows are kept.
    "sebp_triton_plan_dx_k64": dict(_TILES={**kernels._TILES, ("dx", 2): dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64)}),
}
IMPLS = ("dense", "sebp_triton", "sebp_triton_gather", *_LAUNCH_VARIANTS, "sebp_torch", "ideal")
DTYPE = torch.bfloat16


def make_case(shape: Shape, fraction: float, seed: int = 0):
    """``x (B, S, K)``, ``weight (N, K)``, ``dy (B, S, N)`` and the active prefix length."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    active = max(1, round(fraction * shape.seq))
    x = torch.randn(shape.batch, shape.seq, shape.in_features, device="cuda", generator=gen).to(DTYPE)
    weight = torch.randn(shape.out_features, shape.in_features, device="cuda", generator=gen)
    weight = (weight / math.sqrt(shape.in_features)).to(DTYPE)
    dy = torch.randn(shape.batch, shape.seq, shape.out_features, device="cuda", generator=gen).to(DTYPE)
    dy[:, active:] = 0
    return x.requires_grad_(), weight.requires_grad_(), dy, active


def backward_fn(impl: str, x, weight, dy, active: int):
    """A closure running the backward of ``impl`` once (the forward graph is built here)."""
    if impl in _LAUNCH_VARIANTS:
        return _planned_launch(x, weight, dy, active, _LAUNCH_VARIANTS[impl])
    if impl == "ideal":
        x = x.detach()[:, :active].reshape(-1, x.shape[-1]).contiguous().requires_grad_()
        dy = dy[:, :active].reshape(-1, dy.shape[-1]).contiguous()
        y = F.linear(x, weight)
    elif impl == "dense":
        y = F.linear(x, weight)
    else:
        y = sebp_linear(x, weight, impl=impl.removeprefix("sebp_").removesuffix("_gather"))
    grad = lambda: torch.autograd.grad(y, (x, weight), dy, retain_graph=True)  # noqa: E731
    return _reading_through_perm(grad) if impl == "sebp_triton_gather" else grad


def _reading_through_perm(fn):
    """``fn`` run with the Triton backward's compacted copies switched off (a column limit of 0)."""
    def run():
        saved = kernels._MAX_COPIED_COLUMNS
        kernels._MAX_COPIED_COLUMNS = 0
        try:
            return fn()
        finally:
            kernels._MAX_COPIED_COLUMNS = saved
    return run


def _planned_launch(x, weight, dy, active: int, options: dict):
    """The GEMM launch of a planned layer (``sebp_triton_plan``), with ``options``' attributes in
    place of the kernels module's (then a launch plan built per call)."""
    x2, dy2 = x.detach().reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    keep = (torch.arange(x.shape[1], device=x.device) < active).repeat(x.shape[0])
    perm, count = kernels.permutation_of(keep)

    def run():
        with launch_options(tuple(options.items())):
            return kernels.sebp_gemms(dy2, weight.detach(), x2, perm, count, DTYPE, compacted=False,
                                      dx_slots=True)
    return run


def graph_backward_fn(impl: str, x, weight, dy, active: int):
    """``backward_fn`` captured in a CUDA graph; returns the replay function.

    Forward, warm-up and capture all run on one side stream: autograd runs each backward op on its
    forward op's stream, which must be the capturing one.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn = backward_fn(impl, x, weight, dy, active)
        for _ in range(3):
            fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    return graph.replay


def check(shape: Shape) -> None:
    """SEBP gradients against the dense ones (the inactive rows of dY are exactly zero)."""
    for fraction in (1.0, 0.2, 0.02):
        x, weight, dy, active = make_case(shape, fraction, seed=1)
        want = backward_fn("dense", x, weight, dy, active)()
        for impl in ("sebp_triton", "sebp_triton_gather", *_LAUNCH_VARIANTS, "sebp_torch"):
            got = backward_fn(impl, x, weight, dy, active)()
            if impl in _LAUNCH_VARIANTS:  # dX in the plan's order: back to every row
                rows = torch.arange(shape.rows, device=x.device)
                kept_place = (rows // shape.seq) * active + rows % shape.seq
                got = (got[0][torch.where(rows % shape.seq < active, kept_place, shape.rows)].reshape(x.shape),
                       got[1])
            for name, g, w in zip(("dx", "dw"), got, want):
                scale = w.float().abs().max().item()
                torch.testing.assert_close(
                    g.float(), w.float(), rtol=2e-2, atol=1e-2 * scale,
                    msg=lambda m: f"{shape.name} {fraction} {impl} {name}: {m}",
                )
    print(f"check ok: {shape.name}")


TUNE_CANDIDATES = [
    (dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk), dict(num_warps=w, num_stages=st))
    for bm, bn, bk, w, st in [
        (128, 64, 128, 8, 3), (128, 64, 128, 4, 4), (64, 64, 128, 4, 4), (128, 32, 128, 4, 4),
        (128, 64, 256, 8, 3), (64, 128, 128, 8, 3), (32, 128, 128, 4, 4), (64, 128, 64, 4, 4),
        (64, 64, 64, 4, 4), (128, 128, 128, 8, 3),
        # The 128-row dX tile (128, 64, 128) holds ~168 registers at 8 warps, one program per SM;
        # these two fit two (101 and 116 registers, ptxas on CPU: benchmarks/NOTES_torch.md; the
        # second is the default dX tile since v30).
        (128, 64, 64, 8, 3), (64, 64, 128, 8, 3),
    ]
]


def tune(shape: Shape, fraction: float) -> None:
    """Times every candidate tile for each GEMM of the launch alone; prints the best few."""
    x, weight, dy, _ = make_case(shape, fraction)
    x2, dy2 = x.detach().reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    perm, count = kernels.select_rows(dy2, RowPolicy())
    # The compacted operands the GEMMs read: kept rows first, in perm order.
    dy_kept, x_kept = dy2[perm.long()].contiguous(), x2[perm.long()].contiguous()
    default = kernels.default_config(DTYPE)
    for kernel in ("dx", "dw"):
        operands = (weight.detach(), None) if kernel == "dx" else (None, x_kept)
        results = []
        for tile, launch in TUNE_CANDIDATES:
            cfg = {**default, kernel: tile, "launch": launch}
            fn = lambda: kernels.sebp_gemms(dy_kept, *operands, perm, count, DTYPE, compacted=True, config=cfg)  # noqa: E731
            try:
                results.append((triton.testing.do_bench(fn, return_mode="median"), tile, launch))
            except Exception as error:  # out of shared memory etc.: a candidate, not the code, fails
                print(f"  {kernel} {tile} {launch}: {type(error).__name__}")
        results.sort(key=lambda r: r[0])
        default_ms = next((ms for ms, t, l in results if t == default[kernel] and l == default["launch"]), float("nan"))
        best = ", ".join(f"{ms:.3f}ms {tuple(t.values())}+{tuple(l.values())}" for ms, t, l in results[:3])
        print(f"tune {shape.name} f={fraction} {kernel}: default {default_ms:.3f}ms; best {best}")


def compiled_launches() -> list[dict]:
    """Each variant of the GEMM launch's kernel compiled in this process, as the GPU loaded it:
    registers and spills per thread, shared memory and warps, with the constexprs that tell the
    variants apart (a check of ``benchmarks.launch_resources_torch``'s reading on CPU)."""
    kernel, rows = kernels._grads_kernel, []
    for cache, *_ in kernel.device_caches.values():
        for compiled in cache.values():
            names = {kernel.arg_names[key[0] if isinstance(key, tuple) else key]: value
                     for key, value in compiled.src.constants.items()}
            rows.append(dict(
                n_regs=compiled.n_regs, n_spills=compiled.n_spills, shared=compiled.metadata.shared,
                num_warps=compiled.metadata.num_warps,
                **{k: names[k] for k in ("DX_BLOCK_M", "DX_BLOCK_K", "SPLIT", "WITH_DB", "GATHER", "DX_SLOTS")
                   if k in names}))
    return rows


def markdown_table(rows: list[dict]) -> str:
    """One line per (shape, fraction): eager and CUDA-graph times of every impl, and the speedup."""
    by_case: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        by_case.setdefault((row["shape"], row["M"], row["K"], row["N"], row["active_fraction"]), {})[row["impl"]] = row
    graphed = [i for i in IMPLS if i != "sebp_torch"]
    lines = [
        f"Backward of one linear layer, bf16, {rows[0]['device']}, torch {torch.__version__}, "
        f"triton {triton.__version__}; ms, median of do_bench. "
        "Eager: called from Python; graph: replayed from a CUDA graph (GPU time only).",
        "",
        "| shape | M | K | N | active | " + " | ".join(f"{i} eager" for i in IMPLS) + " | "
        + " | ".join(f"{i} graph" for i in graphed) + " | dense/sebp_triton (graph) |",
        "|" + "---|" * (5 + len(IMPLS) + len(graphed) + 1),
    ]
    for (shape, m, k, n, fraction), impls in by_case.items():
        eager = " | ".join(f"{impls[i]['bwd_ms']:.3f}" for i in IMPLS)
        graph = " | ".join(f"{impls[i]['bwd_ms_cuda_graph']:.3f}" for i in graphed)
        speedup = impls["dense"]["bwd_ms_cuda_graph"] / impls["sebp_triton"]["bwd_ms_cuda_graph"]
        lines.append(f"| {shape} | {m} | {k} | {n} | {fraction:.0%} | {eager} | {graph} | {speedup:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file for the rows")
    parser.add_argument("--check", action="store_true", help="verify SEBP against dense first")
    parser.add_argument("--tune", action="store_true", help="time kernel block configs first")
    parser.add_argument("--shapes", default="", help="comma-separated substrings of shape names")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("layer_torch needs a CUDA GPU.")
    shapes = [s for s in SHAPES if not args.shapes or any(p in s.name for p in args.shapes.split(","))]
    device = torch.cuda.get_device_name()
    if args.check:
        for shape in shapes:
            check(shape)
    if args.tune:
        for shape, fraction in itertools.product(shapes, (1.0, 0.1)):
            tune(shape, fraction)
    rows = []
    graphed = [i for i in IMPLS if i != "sebp_torch"]
    print(f"\n{device}, torch {torch.__version__}, triton {triton.__version__}, bf16, backward ms (median)")
    print(
        f"{'shape':28} {'M':>6} {'K':>5} {'N':>5} {'frac':>5} | eager: "
        + " ".join(f"{i:>11}" for i in IMPLS)
        + " | cuda graph: " + " ".join(f"{i:>11}" for i in graphed) + f" | {'dense/sebp':>10}"
    )
    for shape in shapes:
        for fraction in FRACTIONS:
            x, weight, dy, active = make_case(shape, fraction)
            eager, graph = {}, {}
            for impl in IMPLS:
                eager[impl] = triton.testing.do_bench(backward_fn(impl, x, weight, dy, active), return_mode="median")
                if impl in graphed:
                    try:
                        replay = graph_backward_fn(impl, x, weight, dy, active)
                        graph[impl] = triton.testing.do_bench(replay, return_mode="median")
                        del replay
                    except RuntimeError as error:  # a capture failure is a result to report
                        print(f"{shape.name} {fraction} {impl}: CUDA graph capture failed: {error}")
                        graph[impl] = math.nan
                rows.append(dict(
                    framework="torch", impl=impl, shape=shape.name, M=shape.rows, K=shape.in_features,
                    N=shape.out_features, active_fraction=fraction, bwd_ms=eager[impl],
                    bwd_ms_cuda_graph=graph.get(impl), device=device, dtype="bfloat16",
                ))
            print(
                f"{shape.name:28} {shape.rows:>6} {shape.in_features:>5} {shape.out_features:>5} {fraction:>5} | "
                + "       " + " ".join(f"{eager[i]:>11.4f}" for i in IMPLS)
                + " |             " + " ".join(f"{graph[i]:>11.4f}" for i in graphed)
                + f" | {graph['dense'] / graph['sebp_triton']:>10.2f}"
            )
            del x, weight, dy
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    table_path = args.out.removesuffix(".json") + ".md"
    with open(table_path, "w") as f:
        f.write(markdown_table(rows))
    print(f"wrote {len(rows)} rows to {args.out} and a table to {table_path}")
    launches = compiled_launches()
    with open(table_path, "a") as f:
        f.write("\nThe GEMM launch's compiled variants, as loaded on this GPU:\n\n"
                + "\n".join(f"* {launch}" for launch in launches) + "\n")
    print("\n".join(str(launch) for launch in launches))


if __name__ == "__main__":
    main()
