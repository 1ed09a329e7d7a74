"""Triton kernels of the SEBP backward: compact the kept rows first, then GEMMs on contiguous rows.

One backward (:func:`sebp_grads`) is three Triton launches (and a memset where dW is split) and
no host synchronisation: the number of kept rows ``count`` stays a device scalar. Every grid is sized from
the shapes (and the GPU's SM count) alone; a program whose rows lie past ``count`` returns at
once, as in vLLM's fused-MoE kernels, or a persistent one stops at the last tile with work, so the
work follows ``count`` while the launches stay static and the whole backward can be captured in a
CUDA graph.

1. **select** (a grid over row blocks of ``dY``): one read of ``dY`` gives each row's keep flag
   (float32 ``max |dY|`` against the threshold, NaN/Inf always kept), the number of kept rows per
   block and, when the bias needs it, the block's column sums of ``dY`` (``db``'s partial sums).
   ``max_rows`` policies rank the rows first (one launch computes each row's key in one read of
   ``dY``; a sort and a scatter on the device pick the Top-N) and pass the flags in.
2. **compact** (the same grid): each block adds up the counts of the blocks before it, writes its
   rows' places in the active-first permutation ``perm`` (kept rows first, each part in row
   order) and copies its kept rows of ``dY`` and ``X`` to those places of two contiguous buffers;
   the first programs also add up ``db``'s partial sums, a chunk of columns each.
3. **GEMMs**, one launch whose first programs compute dW and the rest dX, so that with few kept
   rows the two small products share the GPU instead of running one after the other:

   * **dW** ``(N, K) = dY_kept^T @ X_kept`` on the contiguous rows: output tiles times ``split``
     slices of the rows. ``split`` is sized on the host from the tile count and the number of SMs
     (the most the GPU can use); on the device each slice takes ``cdiv(blocks, split)`` of the
     ``cdiv(count, BLOCK_M)`` row blocks, so few kept rows use few slices and slices with no rows
     return at once. With ``split > 1`` the slices store float32 partial sums and count their
     arrival on the tile (an atomic on a zeroed counter); the last to arrive adds the used
     slices up in slice order (deterministic: results do not depend on scheduling) and stores
     the tile, so the split costs no second launch, the way stream-K GEMMs fix up their tiles.
   * **dX** ``(M, K) = dY (M, N) @ W (N, K)``: tiles over (row blocks of the compacted prefix,
     column blocks of K). A block inside ``[0, count)`` multiplies its contiguous ``dY`` rows by
     ``W`` and stores the result at rows ``perm[...]`` of ``dX``; a block past ``count`` stores
     zeros to the dropped rows it holds. Every row of ``dX`` is written exactly once (no memset,
     no atomics). The dX programs are persistent (two per SM), each looping over its share of
     the tiles that have work, so the thousands of tiles past ``count`` are not each a program.

   ``dY`` and ``X`` are read through ``perm`` instead of copied where ``dY`` is as wide as a
   vocabulary (an LM head's), whose copy would be as large as the logits.

   Under a row plan (:func:`sebp_gemms` on the full ``dY``, no select or compact launch) the dW
   programs of the first column block of ``K`` also sum the ``dY`` columns they load into
   ``db``, split and fixed up the way their dW tile is: the plan's ``db`` costs no launch and no
   second read of ``dY``.

Launched with ``traceable=True`` (the body of a :func:`torch.library.triton_op`,
:mod:`~sebp_torch_ref.compiled`), every launch goes through :func:`torch.library.wrap_triton`
and every buffer a kernel writes is a tensor of its own, allocated for that launch: traced, each
launch becomes a node of the compiled graph that Inductor launches itself, and torch's
functionalization, which clones a launch's mutated arguments, cannot follow several written views
of one buffer (eagerly the int32 buffers are slices of one workspace, one allocation).

Accumulation is float32; results are stored in the output's dtype. float32 operands use IEEE
products (no TF32), like a default cuBLAS float32 matmul. Tiles come from per-GEMM, per-dtype
tables with a per-shape rule (:func:`default_config`).

The kernels also run on CPU under the Triton interpreter: ``TRITON_INTERPRET=1`` must be set
before Triton is first imported.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import triton
import triton.language as tl

from .launch import CachedLaunch
from .policy import RowPolicy, top_rows

__all__ = [
    "check_device", "default_config", "interpreter_enabled", "permutation_of", "sebp_gemms", "sebp_grads",
    "select_rows",
]


def interpreter_enabled() -> bool:
    """True when Triton runs kernels with its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


# Triton picks the interpreter when it decorates a kernel, i.e. when this module is imported: the
# launches follow that choice, not the variable's value at call time (and read no environment).
_INTERPRET = interpreter_enabled()


# ----------------------------------------------------------------------------- kernels

@triton.jit
def _finite_abs(a):
    """``|a|`` with its NaN/Inf entries as 0, and each row's flag (int32) of holding one: tl.max
    need not propagate NaN, so they are flagged explicitly (``a != a`` is NaN)."""
    a = tl.abs(a)
    bad = (a != a) | (a == float("inf"))
    return tl.where(bad, 0.0, a), tl.max(bad.to(tl.int32), axis=1)


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
                a, chunk_nonfinite = _finite_abs(a)
                nonfinite = tl.maximum(nonfinite, chunk_nonfinite)
                score = tl.maximum(score, tl.max(a, axis=1))
    if KEEP_GIVEN:
        keep = tl.load(keep_ptr + rows, mask=in_rows, other=0) != 0
    else:
        keep = (score > threshold) | (nonfinite > 0)
        tl.store(keep_ptr + rows, keep.to(tl.int8), mask=in_rows)
    tl.store(block_counts_ptr + pid, tl.sum((keep & in_rows).to(tl.int32)))


@triton.jit
def _rank_key_kernel(
    dy_ptr, key_ptr, threshold, M, N, stride_dym, stride_dyn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """A Top-N policy's ranking key of each row in one read of ``dy``: its float32 L2 norm if it
    is active, ``inf`` if it holds a NaN/Inf, ``-1`` if inactive (:func:`~.policy.top_rows`).

    The norm is summed over the row divided by a power of two near its running max (exact
    divisions; the sum is rescaled, by a power of two, when the max grows), so no square overflows
    or underflows, as :func:`~.policy.keep_mask`'s does (one pass where that takes three)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    in_rows = rows < M
    score = tl.zeros((BLOCK_M,), dtype=tl.float32)
    nonfinite = tl.zeros((BLOCK_M,), dtype=tl.int32)
    # The scale starts at the smallest it can be and only grows: every rescale is by a ratio <= 1.
    scale = tl.full((BLOCK_M,), 2.0 ** -100, dtype=tl.float32)
    squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        ns = n0 + tl.arange(0, BLOCK_N)
        a, chunk_nonfinite = _finite_abs(tl.load(
            dy_ptr + rows[:, None].to(tl.int64) * stride_dym + ns[None, :] * stride_dyn,
            mask=in_rows[:, None] & (ns[None, :] < N),
            other=0.0,
        ).to(tl.float32))
        nonfinite = tl.maximum(nonfinite, chunk_nonfinite)
        score = tl.maximum(score, tl.max(a, axis=1))
        # log2(0) is -inf: an all-zero row so far keeps the smallest scale.
        new_scale = tl.exp2(tl.minimum(tl.maximum(tl.floor(tl.log2(score)), -100.0), 100.0))
        ratio = scale / new_scale
        scaled = a / new_scale[:, None]
        squares = squares * ratio * ratio + tl.sum(scaled * scaled, axis=1)
        scale = new_scale
    norm = tl.minimum(scale * tl.sqrt(squares), 3.4028234663852886e38)
    active = score > threshold
    key = tl.where(nonfinite > 0, float("inf"), tl.where(active, norm, -1.0))
    tl.store(key_ptr + rows, key, mask=in_rows)


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
    dy_ptr, x_ptr, dy_kept_ptr, x_kept_ptr, db_partial_ptr, db_ptr,
    M, N, K, num_blocks,
    stride_dym, stride_dyn, stride_xm, stride_xk,
    BLOCK_M: tl.constexpr, BLOCK_COPY: tl.constexpr, COUNTS_CHUNK: tl.constexpr,
    COPY_DY: tl.constexpr, COPY_X: tl.constexpr,
    WITH_DB: tl.constexpr, BLOCK_DB: tl.constexpr, DB_BLOCKS: tl.constexpr,
):
    """perm and count from the blocks' counts; the kept rows of dY and X copied to their slots;
    ``db`` from the blocks' partial column sums."""
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
    if WITH_DB:
        # A chunk of BLOCK_DB columns per program (programs take chunks pid, pid + num_blocks, ...):
        # the blocks' partial sums added in block order, so db does not depend on scheduling.
        for chunk in range(pid, tl.cdiv(N, BLOCK_DB), num_blocks):
            cols = chunk * BLOCK_DB + tl.arange(0, BLOCK_DB)
            acc = tl.zeros((BLOCK_DB,), dtype=tl.float32)
            for b0 in range(0, num_blocks, DB_BLOCKS):
                blocks = b0 + tl.arange(0, DB_BLOCKS)
                partial = tl.load(
                    db_partial_ptr + blocks[:, None] * N + cols[None, :],
                    mask=(blocks[:, None] < num_blocks) & (cols[None, :] < N),
                    other=0.0,
                )
                acc += tl.sum(partial, axis=0)
            tl.store(db_ptr + cols, acc.to(db_ptr.dtype.element_ty), mask=cols < N)


@triton.jit
def _source_rows(perm_ptr, slots, kept, GATHER: tl.constexpr):
    """Rows of ``dy`` and ``x`` holding slots ``slots``: ``perm[slot]`` in the full tensors
    (``GATHER``), else ``slot`` in the compacted copies."""
    if GATHER:
        rows = tl.load(perm_ptr + slots, mask=kept, other=0).to(tl.int64)
    else:
        rows = slots.to(tl.int64)
    return rows


@triton.jit
def _dx_tile(
    pid, dy_ptr, w_ptr, perm_ptr, dx_ptr, count, M, N, K,
    stride_dym, stride_dyn, stride_wn, stride_wk, stride_dxm, stride_dxk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GATHER: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, DX_SLOTS: tl.constexpr,
):
    """One (BLOCK_M, BLOCK_K) tile of dX: slots [pid_m * BLOCK_M, ...) of perm, stored at rows
    perm[slot] of dX, zeros for the slots past ``count`` (dropped rows); with ``DX_SLOTS``, the
    kept slots' rows stored at rows ``slot`` (dX in the plan's order), and by the first row
    block, its columns of row ``M``: the zeros every dropped row reads."""
    tiles_k = tl.cdiv(K, BLOCK_K)
    pid_k = pid % tiles_k  # column blocks vary fastest: programs sharing dY rows run together
    pid_m = pid // tiles_k
    slots = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    if DX_SLOTS:
        rows = slots.to(tl.int64)
    else:
        rows = tl.load(perm_ptr + slots, mask=slots < M, other=0).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    if pid_m * BLOCK_M < count:
        kept = slots < count
        dy_rows = dy_ptr + _source_rows(perm_ptr, slots, kept, GATHER)[:, None] * stride_dym
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
    in_dx = (slots[:, None] < M) & (cols[None, :] < K)
    if DX_SLOTS:
        in_dx = in_dx & (slots[:, None] < count)  # only kept rows: dropped rows read row M
    tl.store(dx_ptr + rows[:, None] * stride_dxm + cols[None, :] * stride_dxk,
             acc.to(dx_ptr.dtype.element_ty), mask=in_dx)
    if DX_SLOTS:
        # Here, not by a torch zero_() on the row: under torch.compile that write to a slice of
        # an empty buffer becomes a kernel writing the whole (M + 1, K) buffer.
        if pid_m == 0:
            tl.store(dx_ptr + tl.cast(M, tl.int64) * stride_dxm + cols * stride_dxk,
                     tl.zeros((BLOCK_K,), dtype=dx_ptr.dtype.element_ty), mask=cols < K)


@triton.jit
def _split_rows(count, BLOCK_M: tl.constexpr, SPLIT: tl.constexpr, MIN_SLICE: tl.constexpr):
    """Row blocks per slice and slices in use when ``count`` rows are split at most ``SPLIT``
    ways, each slice taking at least ``MIN_SLICE`` row blocks (all of them when fewer)."""
    blocks = tl.cdiv(count, BLOCK_M)
    slices = tl.minimum(tl.maximum(blocks // MIN_SLICE, 1), SPLIT)
    per_split = tl.maximum(tl.cdiv(blocks, slices), 1)
    return per_split, tl.cdiv(blocks, per_split)


@triton.jit
def _dw_tile(
    pid, dy_ptr, x_ptr, perm_ptr, dw_ptr, partial_ptr, arrivals_ptr, db_ptr, db_partial_ptr, count, N, K,
    stride_dym, stride_dyn, stride_xm, stride_xk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    MIN_SLICE: tl.constexpr, GATHER: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    WITH_DB: tl.constexpr,
):
    """One (BLOCK_N, BLOCK_K) tile of dW over one slice of the kept rows (slices of at least
    ``MIN_SLICE`` row blocks: fewer kept rows use fewer slices, and the programs of the others
    return at once).

    With one slice in use the tile goes straight to dW (zeros if no row is kept). With several,
    each slice stores its float32 partial sum and counts its arrival on the tile; the last to
    arrive adds the used slices up in slice order (deterministic, whichever slice that is) and
    stores the tile, so the split costs no second launch.

    ``WITH_DB``: the tiles of the first column block of K also sum the ``dY`` columns they load
    over the kept rows (a second MMA, with ones), which is ``db`` (the dropped rows are zero under
    a row plan): ``dY`` is read once for both, and the split's partial sums and last arrival serve
    ``db`` alike.
    """
    tiles_k = tl.cdiv(K, BLOCK_K)
    tiles = tiles_k * tl.cdiv(N, BLOCK_N)
    tile = pid % tiles
    pid_s = pid // tiles
    per_split, used = _split_rows(count, BLOCK_M, SPLIT, MIN_SLICE)
    if pid_s < tl.maximum(used, 1):
        start = pid_s * per_split * BLOCK_M
        end = tl.minimum(count, start + per_split * BLOCK_M)
        ns = (tile // tiles_k) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = (tile % tiles_k) * BLOCK_K + tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        first_k = tile % tiles_k == 0
        db_acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
        for m0 in range(start, end, BLOCK_M):
            slots = m0 + tl.arange(0, BLOCK_M)
            kept = slots < end
            rows = _source_rows(perm_ptr, slots, kept, GATHER)
            dy = tl.load(
                dy_ptr + rows[:, None] * stride_dym + ns[None, :] * stride_dyn,
                mask=kept[:, None] & (ns[None, :] < N),
                other=0.0,
            )
            x = tl.load(
                x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
                mask=kept[:, None] & (ks[None, :] < K),
                other=0.0,
            )
            if UPCAST:
                dy, x = dy.to(tl.float32), x.to(tl.float32)
            acc = tl.dot(tl.trans(dy), x, acc, input_precision=INPUT_PRECISION)
            if WITH_DB:
                if first_k:
                    # db's column sums by the MMA, dY^T times a block of ones (16: the narrowest
                    # dot): summing the tile's rows would first copy dY from shared memory into
                    # registers, ~40 more per thread (ptxas, 2026-11-29).
                    ones = tl.full((BLOCK_M, 16), 1.0, dtype=dy.dtype)
                    db_acc = tl.dot(tl.trans(dy), ones, db_acc, input_precision=INPUT_PRECISION)
        if WITH_DB:
            db_acc = tl.sum(tl.where(tl.arange(0, 16)[None, :] == 0, db_acc, 0.0), axis=1)  # column 0
        # The tile's addresses, here rather than before the loop, where they would stay live.
        offsets = ns[:, None] * K + ks[None, :]
        in_tile = (ns[:, None] < N) & (ks[None, :] < K)
        # `SPLIT == 1` first, decided when compiling, so that an unsplit program holds none of the
        # split's stores: torch's analysis of a traced launch would take its partial sums' arguments
        # as written.
        if SPLIT == 1 or used <= 1:
            tl.store(dw_ptr + offsets, acc.to(dw_ptr.dtype.element_ty), mask=in_tile)
            if WITH_DB:
                if first_k:
                    tl.store(db_ptr + ns, db_acc.to(db_ptr.dtype.element_ty), mask=ns < N)
        else:
            # int32 suffices: a split weight has few tiles (at most ~2 per SM), so SPLIT * N * K is small.
            slice_size = N * K
            tl.store(partial_ptr + pid_s * slice_size + offsets, acc, mask=in_tile)
            if WITH_DB:
                if first_k:
                    tl.store(db_partial_ptr + pid_s * N + ns, db_acc, mask=ns < N)
            # Every thread's partial is stored before the arrival is counted (the atomic releases
            # them to the GPU, and acquires the other slices' for the last one).
            tl.debug_barrier()
            arrived = tl.atomic_add(arrivals_ptr + tile, 1, sem="acq_rel")
            if arrived == used - 1:
                # A quarter of the tile's rows at a time: the whole tile's sum and addresses
                # would hold more registers than the main loop, and halve the programs per SM.
                for r0 in tl.static_range(0, BLOCK_N, BLOCK_N // 4):
                    part_ns = (tile // tiles_k) * BLOCK_N + r0 + tl.arange(0, BLOCK_N // 4)
                    part_offsets = part_ns[:, None] * K + ks[None, :]
                    part_in = (part_ns[:, None] < N) & (ks[None, :] < K)
                    total = tl.zeros((BLOCK_N // 4, BLOCK_K), dtype=tl.float32)
                    for s in range(0, used):
                        # .cg: read at L2, where the other slices' stores are, not through L1.
                        total += tl.load(partial_ptr + s * slice_size + part_offsets, mask=part_in, other=0.0,
                                         cache_modifier=".cg")
                    tl.store(dw_ptr + part_offsets, total.to(dw_ptr.dtype.element_ty), mask=part_in)
                if WITH_DB:
                    if first_k:
                        db_total = tl.zeros((BLOCK_N,), dtype=tl.float32)
                        for s in range(0, used):
                            db_total += tl.load(db_partial_ptr + s * N + ns, mask=ns < N, other=0.0,
                                                cache_modifier=".cg")
                        tl.store(db_ptr + ns, db_total.to(db_ptr.dtype.element_ty), mask=ns < N)


@triton.jit
def _grads_kernel(
    dy_ptr, w_ptr, x_ptr, perm_ptr, count_ptr, dx_ptr, dw_ptr, partial_ptr, counters_ptr,
    db_ptr, db_partial_ptr, M, N, K, dw_programs, dx_programs,
    stride_dym, stride_dyn, stride_wn, stride_wk, stride_xm, stride_xk, stride_dxm, stride_dxk,
    DX_BLOCK_M: tl.constexpr, DX_BLOCK_N: tl.constexpr, DX_BLOCK_K: tl.constexpr,
    DW_BLOCK_M: tl.constexpr, DW_BLOCK_N: tl.constexpr, DW_BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    MIN_SLICE: tl.constexpr, DO_DX: tl.constexpr, DO_DW: tl.constexpr, WITH_DB: tl.constexpr,
    GATHER: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, DX_SLOTS: tl.constexpr,
    DX_FIRST: tl.constexpr, DX_STEAL: tl.constexpr,
):
    """``dx_programs`` programs of dX and ``dw_programs`` of dW (with ``WITH_DB`` some of those
    also sum db), dX's first in the grid with ``DX_FIRST``, else dW's. One launch, so that with
    few kept rows the two small GEMMs share the GPU.

    dX's programs are persistent: each loops over every ``dx_programs``-th tile of those with
    work, the tiles of the kept rows' row blocks (and, in place, the dropped rows' zero tiles;
    with ``DX_SLOTS``, at least the first row block, which writes row ``M``). A program per tile
    of all ``M`` rows would launch thousands that find nothing to do past ``count`` (BERT-base at
    batch 32: 1,536 dX tiles for ~24 with kept rows at 2.5 % real tokens); the JAX dX launch is
    persistent for the same reason. With ``DX_STEAL`` each program runs the tile of its own index
    first and then takes its next from the counter at ``counters_ptr`` (zero at launch): a
    program that starts late, behind dW's, takes fewer, and the first tiles still go one to a
    program in grid order, which spreads them over the SMs (v31: taking the first from the
    counter too cost up to 10 %, the first takers sharing SMs). ``counters_ptr + 1``: dW's
    per-tile arrivals, so that one memset zeroes both."""
    pid = tl.program_id(0)
    count = tl.load(count_ptr)
    dw_pid = pid
    dx_pid = pid
    if DO_DW and DO_DX:
        if DX_FIRST:
            dw_pid = pid - dx_programs
        else:
            dx_pid = pid - dw_programs
    if DO_DW:
        if (dw_pid >= 0) & (dw_pid < dw_programs):
            _dw_tile(
                dw_pid, dy_ptr, x_ptr, perm_ptr, dw_ptr, partial_ptr, counters_ptr + 1, db_ptr, db_partial_ptr,
                count, N, K, stride_dym, stride_dyn, stride_xm, stride_xk,
                DW_BLOCK_M, DW_BLOCK_N, DW_BLOCK_K, SPLIT, MIN_SLICE, GATHER, INPUT_PRECISION, UPCAST,
                WITH_DB,
            )
    if DO_DX:
        if (dx_pid >= 0) & (dx_pid < dx_programs):
            if DX_SLOTS:
                row_blocks = tl.maximum(tl.cdiv(count, DX_BLOCK_M), 1)
            else:
                row_blocks = tl.cdiv(M, DX_BLOCK_M)
            tiles = row_blocks * tl.cdiv(K, DX_BLOCK_K)
            tile = dx_pid
            while tile < tiles:
                _dx_tile(
                    tile, dy_ptr, w_ptr, perm_ptr, dx_ptr, count, M, N, K,
                    stride_dym, stride_dyn, stride_wn, stride_wk, stride_dxm, stride_dxk,
                    DX_BLOCK_M, DX_BLOCK_N, DX_BLOCK_K, GATHER, INPUT_PRECISION, UPCAST, DX_SLOTS,
                )
                if DX_STEAL:
                    tile = dx_programs + tl.atomic_add(counters_ptr, 1, sem="relaxed")
                else:
                    tile += dx_programs


# ----------------------------------------------------------------------------- tiles

# Per operand width, the tiles of both GEMMs of the one launch. BLOCK_M spans rows of dY, BLOCK_N
# its columns (out features), BLOCK_K in features: the dX tile is (BLOCK_M, BLOCK_K) looping over
# N, the dW tile (BLOCK_N, BLOCK_K) looping over the kept rows. The launch compiles both GEMMs into
# one kernel, whose registers are the larger path's: with a 128-row dX tile (~168 at 8 warps) dW's
# programs also fit only one per SM, with the 64-row one (~116) two. v30 on one H200
# (benchmarks/NOTES_torch.md, "v30 measured"): the 64-row tile on every layer, not only where dX
# is at most 1024 wide, took 10-25 % off BERT's FFN down and LLaMA-3B's MLP, q/o and LM head at
# every fraction of real rows from 2 to 100 %.
_TILES = {
    ("dx", 2): dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128),
    ("dw", 2): dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128),
    ("dx", 4): dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=64),
    ("dw", 4): dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64),
}
_LAUNCH = {2: dict(num_warps=8, num_stages=3), 4: dict(num_warps=4, num_stages=3)}
# Under the interpreter the cost is per program and per op, not per FLOP: small blocks keep the
# CPU tests fast while still splitting odd shapes into several partial blocks.
_INTERPRETER_TILES = dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K=32)
_SELECT_TILES = dict(BLOCK_M=32, BLOCK_N=256, num_warps=4)
_INTERPRETER_SELECT_TILES = dict(BLOCK_M=16, BLOCK_N=64)
_MAX_SPLIT = 8
_INTERPRETER_SMS = 8  # a pretend GPU, so that the CPU tests run dW with several slices
# Row blocks a dW slice takes at least before the split uses one more. A split costs more than
# the rows it takes off each program: every slice stores a float32 partial tile that the last
# arrival reads back, and (dW's programs first in the grid, as in v29) its programs held the SM
# slots that the dX programs waited for. v29 (benchmarks/NOTES_torch.md "v29 measured", one
# H200): BERT FFN down at 2 % real tokens (6 row blocks) 34.7 µs split two ways, 22.7 unsplit;
# FFN up at 5 % (13 blocks) 48.5 against 32.3 (the unsplit launch there also had half the dX
# programs, still more than the live dX tiles).
_MIN_SLICE_BLOCKS = 16
_INTERPRETER_MIN_SLICE_BLOCKS = 1  # the CPU tests' few rows still run the split
# dX's programs go first in the launch's grid (the GPU starts programs in grid order) where dW's
# fill at least this many waves of the launch's slots (_PROGRAMS_PER_SM per SM). With few kept
# rows dX's few live tiles each stream a column block of all of W, the launch's longest programs:
# behind many waves of dW's they start only once dW has nearly run, while behind one wave they fill
# its tail. v30 on one H200 (benchmarks/NOTES_torch.md, "v30 measured"): dX first took 23-31 % off
# LLaMA-3B's MLP, q/o and LM head at 2-5 % real rows (1,536 dW programs on MLP up, 5.8 waves; 576
# on q/o, 2.2); on BERT's layers (36-288 dW programs) dW first was up to 17 % faster at 10-50 %
# (attn at 20 %: 46 -> 38 µs) and within 3 µs at 2-5 %. dX's programs without a tile return at once.
_DX_FIRST_WAVES = 2
# dX's persistent programs take their tiles from a counter (work stealing) instead of every
# dx_programs-th tile each. v30's layer A/B (benchmarks/NOTES_torch.md, "v30 measured", call 5):
# behind dW's programs, one dX program per tile beat the persistent programs' fixed shares by
# 13-18 % on BERT's FFN at 20-100 % real rows (a share that starts late ends late) and lost 6 µs at
# 2 % (thousands of programs without a tile). A counter keeps both. v31 on one H200
# (benchmarks/NOTES_torch.md, "v31 measured"): with each program's first tile its own and the rest
# from the counter, BERT's FFN at 50-100 % real rows took 8-18 % less (FFN down 100 %: 489 -> 402
# µs) and its layers at 2-10 % within 0.6 µs. Where dX's programs go first they start together
# and nothing is late to balance: LLaMA-3B's dX-first layers gained nothing (0 to +3 %), so the
# counter is used only behind dW's programs, and only where dW is split: the counter is then one
# more word of the arrivals' memset, while an unsplit launch needs a memset of its own (LLaMA-3B's
# k/v, unsplit: +1.2 to +1.8 µs at 2-10 %, where BERT's split launches paid at most 0.6).
_DX_STEAL = True
# Programs of the GEMM launch resident per SM, which dW's split and the persistent dX launch are
# sized for. Two fit where a program holds at most 128 registers at 8 warps, as every bfloat16
# launch does (`benchmarks/launch_resources_torch.py`).
_PROGRAMS_PER_SM = 2


def default_config(dtype: torch.dtype, interpret: bool = False) -> dict:
    """Tiles and launch options of the GEMM launch for an operand dtype: ``{"dx": tile, "dw":
    tile, "launch": {num_warps, num_stages}}``. ``benchmarks/layer_torch.py --tune`` times
    alternatives.
    """
    if interpret:
        return dict(dx=dict(_INTERPRETER_TILES), dw=dict(_INTERPRETER_TILES), launch={})
    width = dtype.itemsize
    return dict(dx=dict(_TILES["dx", width]), dw=dict(_TILES["dw", width]), launch=dict(_LAUNCH[width]))


def _sms(device: torch.device) -> int:
    return _INTERPRETER_SMS if _INTERPRET else torch.cuda.get_device_properties(device).multi_processor_count


def _min_slice_blocks() -> int:
    return _INTERPRETER_MIN_SLICE_BLOCKS if _INTERPRET else _MIN_SLICE_BLOCKS


def _dw_split(tiles: int, row_blocks: int, device: torch.device) -> int:
    """Row slices of dW: about ``_PROGRAMS_PER_SM`` programs per SM over the output tiles, at most
    as many as ``row_blocks`` (all ``M`` rows kept) fill with slices of ``_min_slice_blocks()``."""
    most = max(1, row_blocks // _min_slice_blocks())
    return max(1, min(_MAX_SPLIT, round(_PROGRAMS_PER_SM * _sms(device) / tiles), most))


def _dx_first(dw_programs: int, device: torch.device) -> bool:
    """Whether dX's programs go before dW's in the launch's grid: where dW's fill at least
    ``_DX_FIRST_WAVES`` waves of ``_PROGRAMS_PER_SM`` programs per SM."""
    return dw_programs >= _DX_FIRST_WAVES * _PROGRAMS_PER_SM * _sms(device)


def _dx_programs(tiles: int, device: torch.device) -> int:
    """Programs of the persistent dX launch: ``_PROGRAMS_PER_SM`` per SM (as dW's split aims for),
    at most one per tile of all ``M`` rows."""
    return max(1, min(tiles, _PROGRAMS_PER_SM * _sms(device)))


def _dot_options(dtype: torch.dtype) -> dict:
    """``tl.dot`` options: IEEE float32 products, and float32 operands under the interpreter.

    Triton's interpreter computes ``tl.dot`` on bfloat16 operands wrongly (seen with Triton 3.9),
    so there the operands are widened first: products of 16-bit floats are exact in float32, so
    the result is the same up to summation order, and every gather, mask and store is still the
    kernel's own.
    """
    upcast = _INTERPRET and dtype != torch.float32
    return dict(INPUT_PRECISION="ieee" if upcast or dtype == torch.float32 else "tf32", UPCAST=upcast)


def check_device(*tensors: torch.Tensor) -> None:
    """Raises unless CUDA or the interpreter can run a launch on ``tensors``."""
    if not _INTERPRET and any(t.device.type != "cuda" for t in tensors):
        raise ValueError(
            "impl='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before Triton is "
            f"imported to run the kernels on CPU; got tensors on {tensors[0].device}."
        )


# ----------------------------------------------------------------------------- launch plans

# Everything about a launch that the shapes, dtype and device decide (tiles, grids, dW's split,
# workspace layout, ``tl.dot`` options) is worked out once per shape and cached, so that a
# backward's host work is a few allocations and the launches themselves: with a few launches of
# small kernels per layer, host time per layer, not GPU time, is what BERT-base's step waits on.

_ALIGN = 4  # int32 slots per 16 bytes: workspace slices start where Triton's pointer
#             specialisation (16-byte alignment) expects them to


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


# Eager launches keep each specialisation's compiled kernel (:mod:`.launch`): a planned layer's
# backward is one launch, and eager BERT's step waits on host time. False: every launch through
# ``kernel[grid]`` (the A/B of ``benchmarks.host_overhead_torch``).
_CACHED_LAUNCH = True


@functools.lru_cache(maxsize=None)
def _cached_launch(kernel) -> CachedLaunch:
    return CachedLaunch(kernel)


def _launcher(kernel, traceable: bool):
    """``kernel[grid]``'s stand-in for one launch: (``traceable``) its
    :func:`torch.library.wrap_triton` wrapper, whose launches a ``triton_op``'s trace records as
    graph nodes; eagerly on a GPU its :class:`~sebp_torch_ref.launch.CachedLaunch`; under the
    interpreter ``kernel`` itself."""
    if traceable:
        return torch.library.wrap_triton(kernel)
    return kernel if _INTERPRET or not _CACHED_LAUNCH else _cached_launch(kernel)


@dataclasses.dataclass(frozen=True)
class _SelectPlan:
    """The select and compact launches over ``M`` rows, and their int32 workspace: ``perm``
    ``[0, M)``, ``count`` at ``count_at``, the blocks' counts at ``counts_at``, the int8 keep flags
    packed four to a slot at ``keep_at``."""

    grid: tuple[int]
    num_blocks: int
    select: dict  # constexprs and launch options of _select_kernel
    compact: dict  # of _compact_kernel, but for COPY_DY / COPY_X / WITH_DB
    count_at: int
    counts_at: int
    keep_at: int
    size: int


@functools.lru_cache(maxsize=None)
def _select_plan(M: int) -> _SelectPlan:
    tiles = dict(_INTERPRETER_SELECT_TILES if _INTERPRET else _SELECT_TILES)
    num_blocks = triton.cdiv(M, tiles["BLOCK_M"])
    compact = dict(
        BLOCK_M=tiles["BLOCK_M"], BLOCK_COPY=64 if _INTERPRET else 256, COUNTS_CHUNK=64 if _INTERPRET else 1024,
        BLOCK_DB=16 if _INTERPRET else 64, DB_BLOCKS=4 if _INTERPRET else 64, num_warps=4,
    )
    count_at = _aligned(M)
    counts_at = count_at + _ALIGN
    keep_at = _aligned(counts_at + num_blocks)
    return _SelectPlan((num_blocks,), num_blocks, tiles, compact, count_at, counts_at, keep_at,
                       keep_at + _aligned(triton.cdiv(M, 4)))


@dataclasses.dataclass(frozen=True)
class _GemmPlan:
    """The GEMM launch for one shape."""

    grid: tuple[int]
    dw_programs: int
    dx_programs: int
    dw_tiles: int
    split: int
    gemm: dict  # constexprs and launch options of _grads_kernel


def _build_gemm_plan(M, N, K, dtype, do_dx, do_dw, with_db, gather, dx_slots, device, config) -> _GemmPlan:
    dx_tile, dw_tile = config["dx"], config["dw"]
    dx_tiles = triton.cdiv(K, dx_tile["BLOCK_K"]) * triton.cdiv(M, dx_tile["BLOCK_M"])
    dx_programs = _dx_programs(dx_tiles, device) if do_dx else 0
    dw_tiles = triton.cdiv(K, dw_tile["BLOCK_K"]) * triton.cdiv(N, dw_tile["BLOCK_N"])
    split = _dw_split(dw_tiles, triton.cdiv(M, dw_tile["BLOCK_M"]), device) if do_dw else 1
    dw_programs = dw_tiles * split if do_dw else 0
    dx_first = _dx_first(dw_programs, device)
    gemm = dict(
        DX_BLOCK_M=dx_tile["BLOCK_M"], DX_BLOCK_N=dx_tile["BLOCK_N"], DX_BLOCK_K=dx_tile["BLOCK_K"],
        DW_BLOCK_M=dw_tile["BLOCK_M"], DW_BLOCK_N=dw_tile["BLOCK_N"], DW_BLOCK_K=dw_tile["BLOCK_K"],
        SPLIT=split, MIN_SLICE=_min_slice_blocks(), DO_DX=do_dx, DO_DW=do_dw, WITH_DB=with_db,
        GATHER=gather, DX_SLOTS=dx_slots, DX_FIRST=dx_first,
        DX_STEAL=_DX_STEAL and do_dx and split > 1 and not dx_first,  # a split implies dW
        **_dot_options(dtype), **config["launch"],
    )
    return _GemmPlan((dw_programs + dx_programs,), dw_programs, dx_programs, dw_tiles, split, gemm)


@functools.lru_cache(maxsize=None)
def _default_gemm_plan(M, N, K, dtype, do_dx, do_dw, with_db, gather, dx_slots, device) -> _GemmPlan:
    """The plan with :func:`default_config`'s tiles, cached (a tuner's configs are not)."""
    return _build_gemm_plan(M, N, K, dtype, do_dx, do_dw, with_db, gather, dx_slots, device,
                            default_config(dtype, _INTERPRET))


# ----------------------------------------------------------------------------- launches

def _select_buffers(plan: _SelectPlan, M: int, device: torch.device, traceable: bool):
    """``(perm, count, block_counts, flags)``: int32 ``(M,)``, ``(1,)``, ``(num_blocks,)`` and the
    int8 keep flags ``(M,)``; slices of one workspace, or (``traceable``) tensors of their own."""
    if traceable:
        return (torch.empty(M, dtype=torch.int32, device=device),
                torch.empty(1, dtype=torch.int32, device=device),
                torch.empty(plan.num_blocks, dtype=torch.int32, device=device),
                torch.empty(M, dtype=torch.int8, device=device))
    work = torch.empty(plan.size, dtype=torch.int32, device=device)
    return (work[:M], work[plan.count_at:plan.count_at + 1],
            work[plan.counts_at:plan.counts_at + plan.num_blocks],
            work[plan.keep_at:].view(torch.int8)[:M])


def _kept_buffers(M: int, N: int, K: int, with_x: bool, dtype, device, traceable: bool):
    """``(dy_kept (M, N), x_kept (M, K) or None)``: one allocation, ``x``'s part 16-byte aligned,
    or (``traceable``) two."""
    if traceable:
        return (torch.empty((M, N), dtype=dtype, device=device),
                torch.empty((M, K), dtype=dtype, device=device) if with_x else None)
    x_at = -(-M * N * dtype.itemsize // 16) * 16 // dtype.itemsize
    kept = torch.empty(x_at + M * K, dtype=dtype, device=device)
    return kept[:M * N].view(M, N), kept[x_at:].view(M, K) if with_x else None


def _select_and_compact(dy, x, keep, policy, bias_dtype, copy: bool, traceable: bool = False):
    """``(perm, count, dy_kept, x_kept, db)``: the select and compact launches over the rows of
    ``dy`` (``(M, N)``, ``M > 0``).

    ``keep``: ``(M,)`` bool flags to take as given, or ``None`` to score ``dy`` under ``policy``.
    With ``copy``, ``dy_kept``/``x_kept`` are ``(M, ·)`` buffers whose first ``count`` rows are the
    kept rows of ``dy`` and ``x`` (``x_kept`` ``None`` without ``x``); without, both ``None``.
    ``db`` (``(N,)`` in ``bias_dtype``, the full column sum of ``dy``) where ``bias_dtype`` is given.
    ``traceable``: as :func:`sebp_gemms`'s. Arguments a launch does not use get ``dy``, which no
    launch writes.
    """
    M, N = dy.shape
    K = 0 if x is None else x.shape[1]
    plan = _select_plan(M)
    device = dy.device
    perm, count, block_counts, flags = _select_buffers(plan, M, device, traceable)
    if keep is not None:
        # Traced, the given flags' own int8 copy (functional, no write into a buffer).
        flags = keep.to(torch.int8) if traceable else flags.copy_(keep)
    with_db = bias_dtype is not None
    db_partial = torch.empty((plan.num_blocks, N), dtype=torch.float32, device=device) if with_db else dy
    _launcher(_select_kernel, traceable)[plan.grid](
        dy, flags, block_counts, db_partial, policy.threshold, M, N, dy.stride(0), dy.stride(1),
        KEEP_GIVEN=keep is not None, WITH_DB=with_db, **plan.select,
    )
    dy_kept = x_kept = None
    if copy:
        dy_kept, x_kept = _kept_buffers(M, N, K, x is not None, dy.dtype, device, traceable)
    db = torch.empty(N, dtype=bias_dtype, device=device) if with_db else None
    _launcher(_compact_kernel, traceable)[plan.grid](
        flags, block_counts, perm, count,
        dy, dy if x is None else x, dy if dy_kept is None else dy_kept, dy if x_kept is None else x_kept,
        db_partial, dy if db is None else db,
        M, N, K, plan.num_blocks,
        dy.stride(0), dy.stride(1), *((0, 0) if x is None else x.stride()),
        COPY_DY=dy_kept is not None, COPY_X=x_kept is not None, WITH_DB=with_db, **plan.compact,
    )
    return perm, count, dy_kept, x_kept, db


def select_rows(dy: torch.Tensor, policy: RowPolicy) -> tuple[torch.Tensor, torch.Tensor]:
    """``(perm, count)`` of :func:`~sebp_torch_ref.policy.active_first_permutation` applied to
    :func:`~sebp_torch_ref.policy.keep_mask`: the select and compact launches, copying nothing.

    Args:
        dy: ``(M, N)`` output gradient.
        policy: the :class:`RowPolicy`; ``max_rows`` policies rank the rows first.

    Returns:
        ``perm`` ``(M,)`` int32 and ``count`` ``(1,)`` int32, both on ``dy``'s device.
    """
    check_device(dy)
    if dy.shape[0] == 0:
        return (torch.empty(0, dtype=torch.int32, device=dy.device),
                torch.zeros(1, dtype=torch.int32, device=dy.device))
    perm, count, *_ = _select_and_compact(dy, None, _given_keep(dy, policy), policy, None, False)
    return perm, count


def permutation_of(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(perm, count)`` of :func:`~sebp_torch_ref.policy.active_first_permutation` of a ``(M,)``
    bool mask, by the compact launch (a row plan's rows, made once per step)."""
    check_device(keep)
    if keep.shape[0] == 0:
        return (torch.empty(0, dtype=torch.int32, device=keep.device),
                torch.zeros(1, dtype=torch.int32, device=keep.device))
    perm, count, *_ = _select_and_compact(keep[:, None], None, keep, RowPolicy(), None, False)
    return perm, count


def _given_keep(dy: torch.Tensor, policy: RowPolicy, traceable: bool = False) -> torch.Tensor | None:
    """The keep flags of a Top-N policy: each row's ranking key in one launch, then the Top-N by
    torch ops on the device; ``None`` where the select launch scores the rows itself."""
    if policy.max_rows is None or policy.max_rows >= dy.shape[0]:
        return None
    M, N = dy.shape
    plan = _select_plan(M)
    keys = torch.empty(M, dtype=torch.float32, device=dy.device)
    _launcher(_rank_key_kernel, traceable)[plan.grid](dy, keys, policy.threshold, M, N,
                                                      dy.stride(0), dy.stride(1), **plan.select)
    return top_rows(keys, policy.max_rows)


def sebp_gemms(
    dy: torch.Tensor,
    weight: torch.Tensor | None,
    x: torch.Tensor | None,
    perm: torch.Tensor,
    count: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    compacted: bool,
    bias_dtype: torch.dtype | None = None,
    config: dict | None = None,
    traceable: bool = False,
    dx_slots: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``dX = (dY * keep[:, None]) @ W`` (dropped rows zero), ``dW = (dY * keep[:, None])^T @ X``
    (a sum over the kept rows only) and, with ``bias_dtype``, ``db = sum(dY * keep[:, None])``,
    in one launch (and a memset where dW is split over rows): dW's programs sum ``db`` from the
    rows of ``dY`` they load, so ``dY`` is not read a second time.

    Args:
        dy: ``(M, N)``: the output gradient (``compacted=False``: its kept rows are read through
            ``perm``) or its compacted copy (``compacted=True``: the first ``count`` rows are the
            kept rows in ``perm`` order; the rest is never read).
        weight: ``(N, K)`` weight in torch layout (out, in), same dtype as ``dy``; ``None``: no dX.
        x: ``(M, K)`` layer input, full or compacted as ``dy`` is; ``None``: no dW.
        perm: ``(M,)`` int32 active-first permutation.
        count: ``(1,)`` int32 number of kept rows (device tensor).
        out_dtype: dtype of dW (the weight's).
        compacted: whether ``dy`` and ``x`` are the compacted copies.
        bias_dtype: ``db``'s dtype, or ``None`` for no ``db``; needs ``x`` (dW's programs sum it).
        config: :func:`default_config`'s form; ``None`` takes the default.
        traceable: launch through :func:`torch.library.wrap_triton`, for the body of a
            :func:`torch.library.triton_op` (:mod:`~sebp_torch_ref.compiled`): traced, the launch
            becomes a node that Inductor launches itself (eagerly, the same launch).
        dx_slots: return dX in the plan's order, ``(M + 1, K)``: row ``i < count`` is the dX row of
            ``perm[i]``, row ``M`` is zeros, the rows between are never written. ``dx[pos]``, with
            ``pos`` a kept row's place in ``perm`` and ``M`` for a dropped row, is dX; a compiled
            graph fuses that gather into dX's consumers, so the dropped rows' zeros are neither
            written nor read back (the JAX backward's "v21", ``benchmarks/NOTES.md``).

    Returns:
        ``dX`` ``(M, K)`` (``dx_slots``: ``(M + 1, K)``) in ``dy``'s dtype, ``dW`` ``(N, K)`` in
        ``out_dtype`` and ``db`` ``(N,)`` in ``bias_dtype`` (accumulated in float32), each ``None``
        where not asked for.
    """
    check_device(*(t for t in (dy, weight, x, perm, count) if t is not None))
    if bias_dtype is not None and x is None:
        raise ValueError("sebp_gemms: `bias_dtype` needs `x`: db is summed by dW's programs.")
    M, N = dy.shape
    K = (weight if weight is not None else x).shape[1]
    device = dy.device
    dx = None if weight is None else torch.empty((M + int(dx_slots), K), dtype=dy.dtype, device=device)
    dw = None if x is None else torch.empty((N, K), dtype=out_dtype, device=device)
    db = None if bias_dtype is None else torch.empty(N, dtype=bias_dtype, device=device)
    if M * N * K == 0:
        if db is not None and M * N:  # no in-features: no dW programs to sum db (a K = 0 layer)
            raise ValueError("sebp_gemms: `bias_dtype` needs in-features (K > 0).")
        return tuple(None if t is None else t.zero_() for t in (dx, dw, db))
    shape = (M, N, K, dy.dtype, dx is not None, dw is not None, db is not None, not compacted,
             dx_slots, device)
    plan = _default_gemm_plan(*shape) if config is None else _build_gemm_plan(*shape, config)
    partial = counters = db_partial = count
    if plan.split > 1:  # dX's tile counter (DX_STEAL needs a split), each dW tile's count of
        # arrived slices after it, and the slices' float32 partial sums
        counters = torch.zeros(1 + plan.dw_tiles, dtype=torch.int32, device=device)
        partial = torch.empty((plan.split, N, K), dtype=torch.float32, device=device)
        if db is not None:
            db_partial = torch.empty((plan.split, N), dtype=torch.float32, device=device)
    _launcher(_grads_kernel, traceable)[plan.grid](
        dy, dy if weight is None else weight, dy if x is None else x, perm, count,
        dy if dx is None else dx, dy if dw is None else dw, partial, counters,
        count if db is None else db, db_partial, M, N, K, plan.dw_programs, plan.dx_programs,
        dy.stride(0), dy.stride(1), *((0, 0) if weight is None else weight.stride()),
        *((0, 0) if x is None else x.stride()), *((0, 0) if dx is None else dx.stride()),
        **plan.gemm,
    )
    return dx, dw, db


# The kept rows of dY and X are copied to contiguous buffers unless dY is as wide as a vocabulary:
# an LM head's (M, 128k) gradient would need a second buffer of the logits' size. The GEMMs then
# read both through perm (`benchmarks/layer_torch.py` times both ways: `sebp_triton_gather`).
_MAX_COPIED_COLUMNS = 16384


def sebp_grads(
    dy: torch.Tensor,
    x: torch.Tensor | None,
    weight: torch.Tensor | None,
    policy: RowPolicy,
    bias_dtype: torch.dtype | None,
    *,
    traceable: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(dX, dW, db)`` of one linear layer's SEBP backward, each only where asked for.

    Args:
        dy: ``(M, N)`` output gradient.
        x: ``(M, K)`` layer input, or ``None`` if ``dW`` is not needed.
        weight: ``(N, K)`` weight, or ``None`` if ``dX`` is not needed.
        policy: which rows of ``dy`` are kept.
        bias_dtype: ``db``'s dtype, or ``None`` if ``db`` is not needed.
        traceable: every launch through :func:`torch.library.wrap_triton`, every written buffer
            its own tensor, for the body of a :func:`torch.library.triton_op` (the module's
            docstring); eagerly, the same launches.

    Returns:
        ``dX`` ``(M, K)`` in ``dy``'s dtype, ``dW`` ``(N, K)`` in ``x``'s dtype, and ``db`` ``(N,)``
        (the full column sum of ``dy``, accumulated in float32).
    """
    check_device(*(t for t in (dy, x, weight) if t is not None))
    M, N = dy.shape
    if x is None and weight is None:  # only db: no rows to select
        return None, None, None if bias_dtype is None else dy.sum(0, dtype=torch.float32).to(bias_dtype)
    if M == 0:
        dx = None if weight is None else dy.new_zeros(0, weight.shape[1])
        dw = None if x is None else torch.zeros((N, x.shape[1]), dtype=x.dtype, device=dy.device)
        db = None if bias_dtype is None else torch.zeros(N, dtype=bias_dtype, device=dy.device)
        return dx, dw, db
    copy = N <= _MAX_COPIED_COLUMNS
    perm, count, dy_kept, x_kept, db = _select_and_compact(
        dy, x, _given_keep(dy, policy, traceable), policy, bias_dtype, copy, traceable)
    dx, dw, _ = sebp_gemms(
        dy_kept if copy else dy, weight, x_kept if copy else x, perm, count,
        dy.dtype if x is None else x.dtype, compacted=copy, traceable=traceable,
    )
    return dx, dw, db
