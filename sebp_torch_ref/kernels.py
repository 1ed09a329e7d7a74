"""Triton kernels of the SEBP backward: compact the kept rows first, then GEMMs on contiguous rows.

One backward (:func:`sebp_grads`) is four launches, five where dW is split, and no host
synchronisation: the number of kept rows ``count`` stays a device scalar. Every grid is sized from
the shapes alone (for all ``M`` rows); a program whose rows lie past ``count`` returns at once, as
in vLLM's fused-MoE kernels, so the work follows ``count`` while the launches stay static and the
whole backward can be captured in a CUDA graph.

1. **select** (a grid over row blocks of ``dY``): one read of ``dY`` gives each row's keep flag
   (float32 ``max |dY|`` against the threshold, NaN/Inf always kept), the number of kept rows per
   block and, when the bias needs it, the block's column sums of ``dY`` (``db``'s partial sums).
   ``max_rows`` policies rank rows with torch ops first and pass the flags in.
2. **compact** (the same grid): each block adds up the counts of the blocks before it, writes its
   rows' places in the active-first permutation ``perm`` (kept rows first, each part in row
   order) and copies its kept rows of ``dY`` and ``X`` to those places of two contiguous buffers.
3. **dX** ``(M, K) = dY (M, N) @ W (N, K)``: a grid over (column blocks of K, row blocks of the
   compacted prefix). A block inside ``[0, count)`` multiplies its contiguous ``dY`` rows by ``W``
   (read through ``perm`` instead where ``dY`` is too wide to copy: an LM head's vocabulary)
   and scatters the result to rows ``perm[...]`` of ``dX``; a block past ``count`` stores zeros to
   the dropped rows it holds. Every row of ``dX`` is written exactly once (no memset, no atomics).
4. **dW** ``(N, K) = dY_kept^T @ X_kept`` on the contiguous rows: a grid over output tiles times
   ``split`` slices of the rows. ``split`` is sized on the host from the tile count and the number
   of SMs (the most the GPU can use); on the device each slice takes ``cdiv(blocks, split)`` of the
   ``cdiv(count, BLOCK_M)`` row blocks, so few kept rows use few slices and slices with no rows
   return at once. With ``split > 1`` the slices write float32 partial sums and a fifth launch adds
   the used ones (a fixed order: results do not depend on scheduling).

Accumulation is float32; results are stored in the output's dtype. float32 operands use IEEE
products (no TF32), like a default cuBLAS float32 matmul. Tiles come from per-kernel, per-dtype
tables with a per-shape rule (:func:`default_config`).

The kernels also run on CPU under the Triton interpreter: ``TRITON_INTERPRET=1`` must be set
before Triton is first imported.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .policy import RowPolicy, keep_mask

__all__ = [
    "check_device", "default_config", "interpreter_enabled", "sebp_dw", "sebp_dx", "sebp_grads",
    "select_rows",
]


def interpreter_enabled() -> bool:
    """True when Triton runs kernels with its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


# ----------------------------------------------------------------------------- kernels

@triton.jit
def _select_kernel(
    dy_ptr, keep_ptr, block_counts_ptr, db_partial_ptr, threshold, M, N,
    stride_dym, stride_dyn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KEEP_GIVEN: tl.constexpr, WITH_DB: tl.constexpr,
):
    """keep[i] = max_j |dy_ij| > threshold (float32), or row i holds a NaN/Inf; the block's count
    of kept rows; and (``WITH_DB``) the block's column sums of ``dy``."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    in_rows = rows < M
    score = tl.zeros((BLOCK_M,), dtype=tl.float32)
    nonfinite = tl.zeros((BLOCK_M,), dtype=tl.int32)
    if WITH_DB or not KEEP_GIVEN:
        for n0 in range(0, N, BLOCK_N):
            ns = n0 + tl.arange(0, BLOCK_N)
            a = tl.load(
                dy_ptr + rows[:, None].to(tl.int64) * stride_dym + ns[None, :] * stride_dyn,
                mask=in_rows[:, None] & (ns[None, :] < N),
                other=0.0,
            ).to(tl.float32)
            if WITH_DB:
                tl.store(db_partial_ptr + pid * N + ns, tl.sum(a, axis=0), mask=ns < N)
            if not KEEP_GIVEN:
                a = tl.abs(a)
                # tl.max need not propagate NaN, so NaN/Inf are flagged explicitly (a != a is NaN).
                bad = (a != a) | (a == float("inf"))
                nonfinite = tl.maximum(nonfinite, tl.max(bad.to(tl.int32), axis=1))
                score = tl.maximum(score, tl.max(tl.where(bad, 0.0, a), axis=1))
    if KEEP_GIVEN:
        keep = tl.load(keep_ptr + rows, mask=in_rows, other=0) != 0
    else:
        keep = (score > threshold) | (nonfinite > 0)
        tl.store(keep_ptr + rows, keep.to(tl.int8), mask=in_rows)
    tl.store(block_counts_ptr + pid, tl.sum((keep & in_rows).to(tl.int32)))


@triton.jit
def _copy_rows(src_ptr, dst_ptr, rows, dest, kept, width, stride_m, stride_k, BLOCK: tl.constexpr):
    """dst[dest[i], :] = src[rows[i], :] for the kept rows i (dst contiguous, ``width`` columns)."""
    for c0 in range(0, width, BLOCK):
        cs = c0 + tl.arange(0, BLOCK)
        mask = kept[:, None] & (cs[None, :] < width)
        values = tl.load(src_ptr + rows[:, None].to(tl.int64) * stride_m + cs[None, :] * stride_k, mask=mask)
        tl.store(dst_ptr + dest[:, None].to(tl.int64) * width + cs[None, :], values, mask=mask)


@triton.jit
def _compact_kernel(
    keep_ptr, block_counts_ptr, perm_ptr, count_ptr,
    dy_ptr, x_ptr, dy_kept_ptr, x_kept_ptr,
    M, N, K, num_blocks,
    stride_dym, stride_dyn, stride_xm, stride_xk,
    BLOCK_M: tl.constexpr, BLOCK_COPY: tl.constexpr, COUNTS_CHUNK: tl.constexpr,
    COPY_DY: tl.constexpr, COPY_X: tl.constexpr,
):
    """perm and count from the blocks' counts; the kept rows of dY and X copied to their slots."""
    pid = tl.program_id(0)
    # Kept rows in all blocks and in the blocks before this one (a few hundred int32: every
    # program reads them all rather than waiting on a separate scan).
    total = tl.zeros((), dtype=tl.int32)
    before = tl.zeros((), dtype=tl.int32)
    for b0 in range(0, num_blocks, COUNTS_CHUNK):
        blocks = b0 + tl.arange(0, COUNTS_CHUNK)
        counts = tl.load(block_counts_ptr + blocks, mask=blocks < num_blocks, other=0)
        total += tl.sum(counts)
        before += tl.sum(tl.where(blocks < pid, counts, 0))
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    in_rows = rows < M
    keep = tl.load(keep_ptr + rows, mask=in_rows, other=0).to(tl.int32)
    kept_through = before + tl.cumsum(keep, axis=0)  # kept rows in [0, i]
    # Kept row i goes to slot kept_through - 1; dropped row i after all kept rows, at
    # total + (dropped rows before i) = total + i - kept_through.
    dest = tl.where(keep > 0, kept_through - 1, total + rows - kept_through)
    tl.store(perm_ptr + dest, rows, mask=in_rows)
    if pid == 0:
        tl.store(count_ptr, total)
    kept = (keep > 0) & in_rows
    if COPY_DY:
        _copy_rows(dy_ptr, dy_kept_ptr, rows, dest, kept, N, stride_dym, stride_dyn, BLOCK_COPY)
    if COPY_X:
        _copy_rows(x_ptr, x_kept_ptr, rows, dest, kept, K, stride_xm, stride_xk, BLOCK_COPY)


@triton.jit
def _dx_kernel(
    dy_ptr, w_ptr, perm_ptr, count_ptr, dx_ptr,
    M, N, K,
    stride_dym, stride_dyn, stride_wn, stride_wk, stride_dxm, stride_dxk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GATHER_DY: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """``GATHER_DY``: ``dy`` is the full gradient, read at rows ``perm[slot]``; otherwise it is
    the compacted copy, read at row ``slot``."""
    # K blocks vary fastest so that programs sharing a block of dY rows run together.
    pid_k = tl.program_id(0)
    pid_m = tl.program_id(1)
    count = tl.load(count_ptr)
    slots = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    rows = tl.load(perm_ptr + slots, mask=slots < M, other=0).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    if pid_m * BLOCK_M < count:
        kept = slots < count
        if GATHER_DY:
            dy_rows = dy_ptr + rows[:, None] * stride_dym
        else:
            dy_rows = dy_ptr + slots[:, None].to(tl.int64) * stride_dym
        for n0 in range(0, N, BLOCK_N):
            ns = n0 + tl.arange(0, BLOCK_N)
            dy = tl.load(dy_rows + ns[None, :] * stride_dyn, mask=kept[:, None] & (ns[None, :] < N), other=0.0)
            w = tl.load(
                w_ptr + ns[:, None] * stride_wn + cols[None, :] * stride_wk,
                mask=(ns[:, None] < N) & (cols[None, :] < K),
                other=0.0,
            )
            if UPCAST:
                dy, w = dy.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(dy, w, acc, input_precision=INPUT_PRECISION)
    # Slots in [count, M) hold dropped rows: their accumulator stayed zero.
    tl.store(
        dx_ptr + rows[:, None] * stride_dxm + cols[None, :] * stride_dxk,
        acc.to(dx_ptr.dtype.element_ty),
        mask=(slots[:, None] < M) & (cols[None, :] < K),
    )


@triton.jit
def _split_rows(count, BLOCK_M: tl.constexpr, SPLIT: tl.constexpr):
    """Row blocks per slice and slices in use when ``count`` rows are split ``SPLIT`` ways."""
    blocks = tl.cdiv(count, BLOCK_M)
    per_split = tl.maximum(tl.cdiv(blocks, SPLIT), 1)
    return per_split, tl.cdiv(blocks, per_split)


@triton.jit
def _dw_kernel(
    dy_ptr, x_kept_ptr, perm_ptr, count_ptr, out_ptr,
    N, K, stride_dym, stride_dyn, stride_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    GATHER_DY: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """``GATHER_DY`` as in ``_dx_kernel``; ``x_kept`` is always the compacted copy."""
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    count = tl.load(count_ptr)
    per_split, used = _split_rows(count, BLOCK_M, SPLIT)
    # With one slice the output is dW itself and every tile is stored (zeros if no row is kept).
    if (pid_s < used) | (SPLIT == 1):
        start = pid_s * per_split * BLOCK_M
        end = tl.minimum(count, start + per_split * BLOCK_M)
        ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for m0 in range(start, end, BLOCK_M):
            slots = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
            kept = slots < end
            if GATHER_DY:
                dy_rows = tl.load(perm_ptr + slots, mask=kept, other=0).to(tl.int64)
            else:
                dy_rows = slots
            dy = tl.load(
                dy_ptr + dy_rows[:, None] * stride_dym + ns[None, :] * stride_dyn,
                mask=kept[:, None] & (ns[None, :] < N),
                other=0.0,
            )
            x = tl.load(
                x_kept_ptr + slots[:, None] * K + ks[None, :],
                mask=kept[:, None] & (ks[None, :] < K),
                other=0.0,
            )
            if UPCAST:
                dy, x = dy.to(tl.float32), x.to(tl.float32)
            acc = tl.dot(tl.trans(dy), x, acc, input_precision=INPUT_PRECISION)
        tl.store(
            out_ptr + pid_s * stride_split + ns[:, None] * K + ks[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=(ns[:, None] < N) & (ks[None, :] < K),
        )


@triton.jit
def _split_sum_kernel(
    partial_ptr, count_ptr, out_ptr, size,
    BLOCK_M: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
):
    """out = the sum of the used slices of ``partial`` (SPLIT, size), in slice order."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    _, used = _split_rows(tl.load(count_ptr), BLOCK_M, SPLIT)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, used):
        acc += tl.load(partial_ptr + s * size + offs, mask=offs < size, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=offs < size)


# ----------------------------------------------------------------------------- tiles

# Per kernel and operand width. BLOCK_M spans rows of dY, BLOCK_N its columns (out features),
# BLOCK_K in features: the dX tile is (BLOCK_M, BLOCK_K) looping over N, the dW tile is
# (BLOCK_N, BLOCK_K) looping over the kept rows. "narrow" rows apply where the dX output has at
# most 1024 columns (BERT-base's 768): smaller tiles give the few kept rows more programs.
_TILES = {
    ("dx", 2): dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, num_warps=8, num_stages=3),
    ("dx", 2, "narrow"): dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
    ("dw", 2): dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3),
    ("dx", 4): dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=3),
    ("dw", 4): dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3),
}
# Under the interpreter the cost is per program and per op, not per FLOP: small blocks keep the
# CPU tests fast while still splitting odd shapes into several partial blocks.
_INTERPRETER_TILES = dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K=32)
_SELECT_TILES = dict(BLOCK_M=32, BLOCK_N=256, num_warps=4)
_INTERPRETER_SELECT_TILES = dict(BLOCK_M=16, BLOCK_N=64)
_MAX_SPLIT = 8
_INTERPRETER_SMS = 8  # a pretend GPU, so that the CPU tests run dW with several slices


def default_config(kernel: str, dtype: torch.dtype, interpret: bool = False, out_columns: int | None = None) -> dict:
    """Block sizes and launch options of ``kernel`` (``"dx"`` or ``"dw"``) for an operand dtype.

    ``out_columns``: the dX kernel's ``K``, which picks the narrow tiles where it is small.
    ``benchmarks/layer_torch.py --tune`` times alternatives.
    """
    if interpret:
        return dict(_INTERPRETER_TILES)
    if kernel == "dx" and out_columns is not None and out_columns <= 1024:
        return dict(_TILES.get((kernel, dtype.itemsize, "narrow"), _TILES[kernel, dtype.itemsize]))
    return dict(_TILES[kernel, dtype.itemsize])


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _dw_split(tiles: int, row_blocks: int, device: torch.device, interpret: bool) -> int:
    """Row slices of dW: about two programs per SM over the output tiles, at most one per block."""
    sms = _INTERPRETER_SMS if interpret else _multiprocessors(device)
    return max(1, min(_MAX_SPLIT, round(2 * sms / tiles), row_blocks))


def _dot_options(dtype: torch.dtype, interpret: bool) -> dict:
    """``tl.dot`` options: IEEE float32 products, and float32 operands under the interpreter.

    Triton's interpreter computes ``tl.dot`` on bfloat16 operands wrongly (seen with Triton 3.9),
    so there the operands are widened first: products of 16-bit floats are exact in float32, so
    the result is the same up to summation order, and every gather, mask and store is still the
    kernel's own.
    """
    upcast = interpret and dtype != torch.float32
    return dict(INPUT_PRECISION="ieee" if upcast or dtype == torch.float32 else "tf32", UPCAST=upcast)


def check_device(*tensors: torch.Tensor) -> bool:
    """Whether the interpreter runs a launch on ``tensors``; raises if neither CUDA nor it can."""
    interpret = interpreter_enabled()
    if not interpret and any(t.device.type != "cuda" for t in tensors):
        raise ValueError(
            "impl='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before Triton is "
            f"imported to run the kernels on CPU; got tensors on {tensors[0].device}."
        )
    return interpret


# ----------------------------------------------------------------------------- launches

def _select(dy: torch.Tensor, policy: RowPolicy, with_db: bool, interpret: bool):
    """``(keep int8 (M,), block_counts int32 (blocks,), db_partial float32 (blocks, N) | None,
    BLOCK_M)`` of the select launch."""
    M, N = dy.shape
    tiles = dict(_INTERPRETER_SELECT_TILES if interpret else _SELECT_TILES)
    num_blocks = triton.cdiv(M, tiles["BLOCK_M"])
    keep_given = policy.max_rows is not None and policy.max_rows < M
    if keep_given:
        keep = keep_mask(dy, policy).view(torch.int8)
    else:
        keep = torch.empty(M, dtype=torch.int8, device=dy.device)
    block_counts = torch.empty(num_blocks, dtype=torch.int32, device=dy.device)
    db_partial = torch.empty((num_blocks, N), dtype=torch.float32, device=dy.device) if with_db else None
    _select_kernel[(num_blocks,)](
        dy, keep, block_counts, block_counts if db_partial is None else db_partial, policy.threshold, M, N,
        dy.stride(0), dy.stride(1), KEEP_GIVEN=keep_given, WITH_DB=with_db, **tiles,
    )
    return keep, block_counts, db_partial, tiles["BLOCK_M"]


def _compact(dy, x, keep, block_counts, block_m, copy_dy: bool, interpret: bool):
    """``(perm, count, dy_kept, x_kept)``: the copies are ``(M, ·)`` buffers whose first ``count``
    rows are the kept rows (``None`` where not asked for)."""
    M, N = dy.shape
    K = 0 if x is None else x.shape[1]
    perm = torch.empty(M, dtype=torch.int32, device=dy.device)
    count = torch.empty(1, dtype=torch.int32, device=dy.device)
    dy_kept = torch.empty_like(dy, memory_format=torch.contiguous_format) if copy_dy else None
    x_kept = None if x is None else torch.empty((M, K), dtype=x.dtype, device=x.device)
    num_blocks = block_counts.shape[0]
    _compact_kernel[(num_blocks,)](
        keep, block_counts, perm, count,
        dy, dy if x is None else x, perm if dy_kept is None else dy_kept, perm if x_kept is None else x_kept,
        M, N, K, num_blocks,
        dy.stride(0), dy.stride(1), *((0, 0) if x is None else x.stride()),
        BLOCK_M=block_m, BLOCK_COPY=64 if interpret else 256, COUNTS_CHUNK=64 if interpret else 1024,
        COPY_DY=copy_dy, COPY_X=x is not None, num_warps=4,
    )
    return perm, count, dy_kept, x_kept


def select_rows(dy: torch.Tensor, policy: RowPolicy) -> tuple[torch.Tensor, torch.Tensor]:
    """``(perm, count)`` of :func:`~sebp_torch_ref.policy.active_first_permutation` applied to
    :func:`~sebp_torch_ref.policy.keep_mask`: the select and compact launches, copying nothing.

    Args:
        dy: ``(M, N)`` output gradient.
        policy: the :class:`RowPolicy`; ``max_rows`` policies rank rows with torch ops first.

    Returns:
        ``perm`` ``(M,)`` int32 and ``count`` ``(1,)`` int32, both on ``dy``'s device.
    """
    interpret = check_device(dy)
    if dy.shape[0] == 0:
        return (torch.empty(0, dtype=torch.int32, device=dy.device),
                torch.zeros(1, dtype=torch.int32, device=dy.device))
    keep, block_counts, _, block_m = _select(dy, policy, False, interpret)
    perm, count, _, _ = _compact(dy, None, keep, block_counts, block_m, False, interpret)
    return perm, count


def sebp_dx(
    dy: torch.Tensor, weight: torch.Tensor, perm: torch.Tensor, count: torch.Tensor, *,
    compacted: bool, config: dict | None = None,
) -> torch.Tensor:
    """``dX = (dY * keep[:, None]) @ W`` with dropped rows zero.

    Args:
        dy: ``(M, N)``: the output gradient (``compacted=False``: its kept rows are read through
            ``perm``) or its compacted copy (``compacted=True``: the first ``count`` rows are the
            kept rows in ``perm`` order; the rest is never read).
        weight: ``(N, K)`` weight in torch layout (out, in), same dtype as ``dy``.
        perm: ``(M,)`` int32 active-first permutation.
        count: ``(1,)`` int32 number of kept rows (device tensor).
        compacted: which of the two ``dy`` is.
        config: block sizes and launch options; ``None`` takes :func:`default_config`.

    Returns:
        ``(M, K)`` in ``dy``'s dtype.
    """
    interpret = check_device(dy, weight, perm, count)
    M, N = dy.shape
    K = weight.shape[1]
    dx = torch.empty((M, K), dtype=dy.dtype, device=dy.device)
    if M == 0 or K == 0:
        return dx
    cfg = config or default_config("dx", dy.dtype, interpret, out_columns=K)
    grid = (triton.cdiv(K, cfg["BLOCK_K"]), triton.cdiv(M, cfg["BLOCK_M"]))
    _dx_kernel[grid](
        dy, weight, perm, count, dx,
        M, N, K,
        dy.stride(0), dy.stride(1), weight.stride(0), weight.stride(1), dx.stride(0), dx.stride(1),
        GATHER_DY=not compacted, **_dot_options(dy.dtype, interpret),
        **cfg,
    )
    return dx


def sebp_dw(
    dy: torch.Tensor,
    x_kept: torch.Tensor,
    perm: torch.Tensor,
    count: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    compacted: bool,
    config: dict | None = None,
) -> torch.Tensor:
    """``dW = (dY * keep[:, None])^T @ X``: the sum over the kept rows only.

    Args:
        dy: ``(M, N)`` output gradient or its compacted copy, as for :func:`sebp_dx`.
        x_kept: ``(M, K)`` contiguous: the kept rows of the layer input first, in ``perm`` order.
        perm: ``(M,)`` int32 active-first permutation.
        count: ``(1,)`` int32 number of kept rows (device tensor).
        out_dtype: dtype of the result (the weight's).
        compacted: which of the two ``dy`` is.
        config: block sizes and launch options; ``None`` takes :func:`default_config`.

    Returns:
        ``(N, K)`` in ``out_dtype``.
    """
    interpret = check_device(dy, x_kept, perm, count)
    M, N = dy.shape
    K = x_kept.shape[1]
    dw = torch.empty((N, K), dtype=out_dtype, device=dy.device)
    if N == 0 or K == 0:
        return dw
    cfg = config or default_config("dw", dy.dtype, interpret)
    tiles = (triton.cdiv(K, cfg["BLOCK_K"]), triton.cdiv(N, cfg["BLOCK_N"]))
    split = _dw_split(tiles[0] * tiles[1], triton.cdiv(M, cfg["BLOCK_M"]), dy.device, interpret)
    out = dw if split == 1 else torch.empty((split, N, K), dtype=torch.float32, device=dw.device)
    _dw_kernel[(*tiles, split)](
        dy, x_kept, perm, count, out, N, K, dy.stride(0), dy.stride(1), N * K,
        SPLIT=split, GATHER_DY=not compacted, **_dot_options(dy.dtype, interpret), **cfg,
    )
    if split > 1:
        block = 1024
        _split_sum_kernel[(triton.cdiv(N * K, block),)](
            out, count, dw, N * K, BLOCK_M=cfg["BLOCK_M"], SPLIT=split, BLOCK=block,
        )
    return dw


# dY is copied to contiguous rows unless it is as wide as a vocabulary: an LM head's (M, 128k)
# gradient would need a second buffer of the logits' size, for loads that gain little there.
_MAX_COPIED_COLUMNS = 16384


def sebp_grads(
    dy: torch.Tensor,
    x: torch.Tensor | None,
    weight: torch.Tensor | None,
    policy: RowPolicy,
    bias_dtype: torch.dtype | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(dX, dW, db)`` of one linear layer's SEBP backward, each only where asked for.

    Args:
        dy: ``(M, N)`` output gradient.
        x: ``(M, K)`` layer input, or ``None`` if ``dW`` is not needed.
        weight: ``(N, K)`` weight, or ``None`` if ``dX`` is not needed.
        policy: which rows of ``dy`` are kept.
        bias_dtype: ``db``'s dtype, or ``None`` if ``db`` is not needed.

    Returns:
        ``dX`` ``(M, K)`` in ``dy``'s dtype, ``dW`` ``(N, K)`` in ``x``'s dtype, and ``db`` ``(N,)``
        (the full column sum of ``dy``, accumulated in float32).
    """
    interpret = check_device(*(t for t in (dy, x, weight) if t is not None))
    M, N = dy.shape
    if x is None and weight is None:  # only db: no rows to select
        return None, None, None if bias_dtype is None else dy.sum(0, dtype=torch.float32).to(bias_dtype)
    if M == 0:
        dx = None if weight is None else dy.new_zeros(0, weight.shape[1])
        dw = None if x is None else torch.zeros((N, x.shape[1]), dtype=x.dtype, device=dy.device)
        db = None if bias_dtype is None else torch.zeros(N, dtype=bias_dtype, device=dy.device)
        return dx, dw, db
    keep, block_counts, db_partial, block_m = _select(dy, policy, bias_dtype is not None, interpret)
    compacted = N <= _MAX_COPIED_COLUMNS
    perm, count, dy_kept, x_kept = _compact(dy, x, keep, block_counts, block_m, compacted, interpret)
    rows = dy_kept if compacted else dy
    dx = None if weight is None else sebp_dx(rows, weight, perm, count, compacted=compacted)
    dw = None if x is None else sebp_dw(rows, x_kept, perm, count, x.dtype, compacted=compacted)
    db = None if db_partial is None else db_partial.sum(0).to(bias_dtype)
    return dx, dw, db
