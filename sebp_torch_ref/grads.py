"""The SEBP backward of one linear layer: the backends that :mod:`~sebp_torch_ref.function`
describes, shared by the eager ``autograd.Function`` and the custom op that ``torch.compile``
graphs call (:mod:`~sebp_torch_ref.compiled`), so that both compute the same gradients."""

from __future__ import annotations

import torch

from .plan import RowPlan
from .policy import RowPolicy, active_first_permutation, keep_mask

__all__ = ["linear_grads"]


def linear_grads(
    dy: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor | None, bias_dtype: torch.dtype | None,
    policy: RowPolicy, impl: str, plan: RowPlan | None, name: str | None, traceable: bool = False,
    dx_slots: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(dX, dW, db)`` of ``Y = X W^T + b`` on 2-D ``X``, each only where asked for.

    Args:
        dy: ``(M, N)`` output gradient in ``x``'s dtype.
        x: ``(M, K)`` layer input, or ``None``: no ``dW`` (it is the only reader of ``X``).
        weight: ``(N, K)`` weight, or ``None``: no ``dX``.
        bias_dtype: ``db``'s dtype, or ``None``: no ``db``.
        policy: which rows of ``dy`` are kept (unplanned).
        impl: ``"triton"``, ``"torch"`` or ``"dense"`` (resolved: not ``"auto"``).
        plan: the layer's row plan, or ``None``.
        name: the layer's name in the plan's errors.
        traceable: the Triton launches made for a ``triton_op``'s body
            (:func:`~sebp_torch_ref.kernels.sebp_grads`'s ``traceable``).
        dx_slots: a planned Triton layer's ``dX`` in the plan's order, ``(M + 1, K)``
            (:func:`~sebp_torch_ref.kernels.sebp_gemms`'s ``dx_slots``); needs ``plan`` and
            ``impl="triton"``.
    """
    need_x, need_w, need_b = weight is not None, x is not None, bias_dtype is not None
    if dx_slots and (plan is None or impl != "triton"):
        raise ValueError("linear_grads: `dx_slots` needs a row plan and impl='triton'.")
    if plan is not None and plan.check:
        plan.check_covers(dy, name)
    if impl == "triton":
        from . import kernels  # Triton is needed only here (and may be absent elsewhere).

        if plan is None:
            # One read of dY gives the row selection and db's partial sums.
            return kernels.sebp_grads(dy, x, weight, policy, bias_dtype, traceable=traceable)
    dx = dw = db = None
    if impl == "dense":
        dx = dy @ weight if need_x else None
        dw = dy.t() @ x if need_w else None
        db = _bias_grad(dy, bias_dtype) if need_b else None
    elif impl == "triton":  # under a plan (unplanned returned above)
        # dW's programs sum db from the rows they load (a layer with in-features to load).
        fused_db = need_b and need_w and x.shape[1] > 0
        if need_x or need_w:
            # The plan's rows, read in place through its permutation: one GEMM launch.
            dx, dw, db = kernels.sebp_gemms(
                dy, weight, x, *plan.rows("triton"), dy.dtype,
                compacted=False, bias_dtype=bias_dtype if fused_db else None, traceable=traceable,
                dx_slots=dx_slots,
            )
        if need_b and not fused_db:
            db = _planned_bias_grad(dy, plan, bias_dtype)
    else:
        if need_x or need_w:
            perm, count = (active_first_permutation(keep_mask(dy, policy)) if plan is None
                           else plan.rows("torch"))
            dx, dw = _masked_grads(dy, x, weight, perm, count, need_x, need_w)
        if need_b:
            db = _bias_grad(dy, bias_dtype) if plan is None else _planned_bias_grad(dy, plan, bias_dtype)
    return dx, dw, db


def _masked_grads(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, perm: torch.Tensor, count: torch.Tensor,
    need_x: bool, need_w: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``dX (M, K)`` and ``dW (N, K)`` of the gradient masked to rows ``perm[:count]``, each only
    if needed (index ops; reads ``count`` on the host)."""
    kept = perm[: int(count.item())].long()
    dy_kept = dy.index_select(0, kept)
    dx = dw = None
    if need_x:
        dx = dy.new_zeros(dy.shape[0], weight.shape[1]).index_copy_(0, kept, _matmul(dy_kept, weight))
    if need_w:
        dw = _matmul(dy_kept.t(), x.index_select(0, kept))
    return dx, dw


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` accumulated in float32 and rounded once to ``a``'s dtype.

    On CPU, 16-bit operands are widened to float32 first: torch's own CPU bfloat16 GEMM on CPUs
    with AMX-BF16 spreads a NaN/Inf of one row of ``a`` into other rows of the product (seen with
    torch 2.13 on (42, 29) @ (29, 45)), which would put NaN into rows the contract keeps finite.
    Products of 16-bit floats are exact in float32, so this is the contract's float32
    accumulation. CUDA GEMMs accumulate 16-bit operands in float32 already.
    """
    if a.device.type == "cpu" and a.dtype in (torch.bfloat16, torch.float16):
        return (a.float() @ b.float()).to(a.dtype)
    return a @ b


def _bias_grad(dy: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``db``: the full column sum of ``dy``, accumulated in float32. torch sums 16-bit floats in
    float32 already, so where ``db`` has ``dy``'s dtype this is one launch."""
    if dtype == dy.dtype:
        return dy.sum(dim=0)
    return dy.sum(dim=0, dtype=torch.float32).to(dtype)


def _planned_bias_grad(dy: torch.Tensor, plan: RowPlan, dtype: torch.dtype) -> torch.Tensor:
    """``db`` under a row plan: the column sum over the plan's rows, as dX and dW take them (a
    non-finite value outside the plan is dropped, not summed)."""
    return _bias_grad(dy.masked_fill(plan.mask.reshape(-1, 1) == 0, 0), dtype)
