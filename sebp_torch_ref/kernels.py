"""Triton kernels of the SEBP backward: dX and dW over the kept rows only.

Selection (:func:`select_rows`) is two small kernels: one pass over ``dY`` marks the kept rows
(threshold policies; ``max_rows`` ranks rows with torch ops), and a single program partitions the
rows into the active-first permutation ``perm`` with the device scalar ``count``, so the launch
grids depend only on the shapes and the host never waits for ``count``:

* **dX** ``(M, K) = dY (M, N) @ W (N, K)``: a grid over (column blocks of K, row blocks of
  ``perm``). A block inside ``perm[:count]`` gathers its ``dY`` rows, multiplies by ``W`` and
  scatters the result to the same rows of ``dX``; a block past ``count`` stores zeros. Every row of
  ``dX`` is written exactly once: no memset, no atomics, no compacted copy of ``dY`` in memory.
* **dW** ``(N, K) = dY^T @ X`` over kept rows: a grid over output tiles; each program loops over
  ``perm[:count]`` with a runtime trip count ``cdiv(count, BLOCK_M)``, so its cost follows the
  number of kept rows.

Accumulation is float32; results are stored in the output's dtype. float32 operands use IEEE
products (no TF32), like a default cuBLAS float32 matmul.

The kernels also run on CPU under the Triton interpreter: ``TRITON_INTERPRET=1`` must be set
before Triton is first imported.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .policy import RowPolicy, keep_mask

__all__ = ["check_device", "default_config", "interpreter_enabled", "sebp_dw", "sebp_dx", "select_rows"]


def interpreter_enabled() -> bool:
    """True when Triton runs kernels with its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@triton.jit
def _dx_kernel(
    dy_ptr, w_ptr, perm_ptr, count_ptr, dx_ptr,
    M, N, K,
    stride_dym, stride_dyn, stride_wn, stride_wk, stride_dxm, stride_dxk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
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
        for n0 in range(0, N, BLOCK_N):
            ns = n0 + tl.arange(0, BLOCK_N)
            dy = tl.load(
                dy_ptr + rows[:, None] * stride_dym + ns[None, :] * stride_dyn,
                mask=kept[:, None] & (ns[None, :] < N),
                other=0.0,
            )
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
def _dw_kernel(
    dy_ptr, x_ptr, perm_ptr, count_ptr, dw_ptr,
    N, K,
    stride_dym, stride_dyn, stride_xm, stride_xk, stride_dwn, stride_dwk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    count = tl.load(count_ptr)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for m0 in range(0, count, BLOCK_M):
        slots = m0 + tl.arange(0, BLOCK_M)
        kept = slots < count
        rows = tl.load(perm_ptr + slots, mask=kept, other=0).to(tl.int64)
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
    tl.store(
        dw_ptr + ns[:, None] * stride_dwn + ks[None, :] * stride_dwk,
        acc.to(dw_ptr.dtype.element_ty),
        mask=(ns[:, None] < N) & (ks[None, :] < K),
    )


@triton.jit
def _keep_kernel(
    dy_ptr, keep_ptr, threshold, M, N, stride_dym, stride_dyn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """keep[i] = max_j |dy_ij| > threshold (float32), or row i holds a NaN/Inf."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    in_rows = rows < M
    score = tl.zeros((BLOCK_M,), dtype=tl.float32)
    nonfinite = tl.zeros((BLOCK_M,), dtype=tl.int32)
    for n0 in range(0, N, BLOCK_N):
        ns = n0 + tl.arange(0, BLOCK_N)
        a = tl.load(
            dy_ptr + rows[:, None].to(tl.int64) * stride_dym + ns[None, :] * stride_dyn,
            mask=in_rows[:, None] & (ns[None, :] < N),
            other=0.0,
        ).to(tl.float32)
        a = tl.abs(a)
        # tl.max need not propagate NaN, so NaN/Inf are flagged explicitly (a != a is NaN).
        bad = (a != a) | (a == float("inf"))
        nonfinite = tl.maximum(nonfinite, tl.max(bad.to(tl.int32), axis=1))
        score = tl.maximum(score, tl.max(tl.where(bad, 0.0, a), axis=1))
    keep = (score > threshold) | (nonfinite > 0)
    tl.store(keep_ptr + rows, keep.to(tl.int8), mask=in_rows)


@triton.jit
def _partition_kernel(keep_ptr, perm_ptr, count_ptr, M, BLOCK: tl.constexpr):
    """One program: perm = kept rows in order, then dropped rows in order; count = #kept.

    Two passes over the (tiny) mask: the total first, so dropped rows know where they start.
    """
    count = tl.zeros((), dtype=tl.int32)
    for start in range(0, M, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        count += tl.sum(tl.load(keep_ptr + offs, mask=offs < M, other=0).to(tl.int32))
    kept_before = tl.zeros((), dtype=tl.int32)
    for start in range(0, M, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        keep = tl.load(keep_ptr + offs, mask=offs < M, other=0).to(tl.int32)
        kept_through = kept_before + tl.cumsum(keep, axis=0)  # kept rows in [0, i]
        dest = tl.where(keep > 0, kept_through - 1, count + offs - kept_through)
        tl.store(perm_ptr + dest, offs, mask=offs < M)
        kept_before += tl.sum(keep)
    tl.store(count_ptr, count)


def select_rows(dy: torch.Tensor, policy: RowPolicy) -> tuple[torch.Tensor, torch.Tensor]:
    """``(perm, count)`` of :func:`~sebp_torch_ref.policy.active_first_permutation` applied to
    :func:`~sebp_torch_ref.policy.keep_mask`, in two launches for threshold policies.

    Args:
        dy: ``(M, N)`` output gradient.
        policy: the :class:`RowPolicy`; ``max_rows`` policies rank rows with torch ops first.

    Returns:
        ``perm`` ``(M,)`` int32 and ``count`` ``(1,)`` int32, both on ``dy``'s device.
    """
    interpret = check_device(dy)
    M, N = dy.shape
    perm = torch.empty(M, dtype=torch.int32, device=dy.device)
    count = torch.empty(1, dtype=torch.int32, device=dy.device)
    if policy.max_rows is not None and policy.max_rows < M:
        keep = keep_mask(dy, policy).view(torch.int8)
    else:
        keep = torch.empty(M, dtype=torch.int8, device=dy.device)
        if M:
            block_m = 32 if interpret else 16
            _keep_kernel[(triton.cdiv(M, block_m),)](
                dy, keep, policy.threshold, M, N, dy.stride(0), dy.stride(1),
                BLOCK_M=block_m, BLOCK_N=64 if interpret else 256,
            )
    _partition_kernel[(1,)](keep, perm, count, M, BLOCK=256 if interpret else 4096, num_warps=8)
    return perm, count


# Per kernel and operand width. BLOCK_M spans rows of dY, BLOCK_N its columns (out features),
# BLOCK_K in features: the dX tile is (BLOCK_M, BLOCK_K) looping over N, the dW tile is
# (BLOCK_N, BLOCK_K) looping over the kept rows.
_CONFIGS = {
    ("dx", 2): dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, num_warps=8, num_stages=3),
    ("dw", 2): dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3),
    ("dx", 4): dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=3),
    ("dw", 4): dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3),
}
# Under the interpreter the cost is per program and per op, not per FLOP: small blocks keep the
# CPU tests fast while still splitting odd shapes into several partial blocks.
_INTERPRETER_CONFIG = dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K=32)


def default_config(kernel: str, dtype: torch.dtype, interpret: bool = False) -> dict:
    """Block sizes and launch options of ``kernel`` (``"dx"`` or ``"dw"``) for an operand dtype.

    ``benchmarks/layer_torch.py --tune`` times alternatives.
    """
    if interpret:
        return dict(_INTERPRETER_CONFIG)
    return dict(_CONFIGS[kernel, dtype.itemsize])


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


def sebp_dx(
    dy: torch.Tensor, weight: torch.Tensor, perm: torch.Tensor, count: torch.Tensor, config: dict | None = None
) -> torch.Tensor:
    """``dX = (dY * keep[:, None]) @ W`` with dropped rows zero.

    Args:
        dy: ``(M, N)`` output gradient.
        weight: ``(N, K)`` weight in torch layout (out, in), same dtype as ``dy``.
        perm: ``(M,)`` int32 active-first permutation.
        count: ``(1,)`` int32 number of kept rows (device tensor).
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
    cfg = config or default_config("dx", dy.dtype, interpret)
    grid = (triton.cdiv(K, cfg["BLOCK_K"]), triton.cdiv(M, cfg["BLOCK_M"]))
    _dx_kernel[grid](
        dy, weight, perm, count, dx,
        M, N, K,
        dy.stride(0), dy.stride(1), weight.stride(0), weight.stride(1), dx.stride(0), dx.stride(1),
        **_dot_options(dy.dtype, interpret),
        **cfg,
    )
    return dx


def sebp_dw(
    dy: torch.Tensor,
    x: torch.Tensor,
    perm: torch.Tensor,
    count: torch.Tensor,
    out_dtype: torch.dtype,
    config: dict | None = None,
) -> torch.Tensor:
    """``dW = (dY * keep[:, None])^T @ X``, summing over kept rows only.

    Args:
        dy: ``(M, N)`` output gradient.
        x: ``(M, K)`` layer input, same dtype as ``dy``.
        perm: ``(M,)`` int32 active-first permutation.
        count: ``(1,)`` int32 number of kept rows (device tensor).
        out_dtype: dtype of the result (the weight's).
        config: block sizes and launch options; ``None`` takes :func:`default_config`.

    Returns:
        ``(N, K)`` in ``out_dtype``.
    """
    interpret = check_device(dy, x, perm, count)
    N = dy.shape[1]
    K = x.shape[1]
    dw = torch.empty((N, K), dtype=out_dtype, device=dy.device)
    if N == 0 or K == 0:
        return dw
    cfg = config or default_config("dw", dy.dtype, interpret)
    grid = (triton.cdiv(K, cfg["BLOCK_K"]), triton.cdiv(N, cfg["BLOCK_N"]))
    _dw_kernel[grid](
        dy, x, perm, count, dw,
        N, K,
        dy.stride(0), dy.stride(1), x.stride(0), x.stride(1), dw.stride(0), dw.stride(1),
        **_dot_options(dy.dtype, interpret),
        **cfg,
    )
    return dw
