"""``sebp_linear``: ``F.linear`` with the SEBP backward, as a ``torch.autograd.Function``.

The forward is ``F.linear``, unchanged. The backward selects the rows of the output gradient that
the :class:`~sebp_torch_ref.policy.RowPolicy` keeps and computes ``dX``/``dW`` as the dense
backward of the masked gradient ``dY * keep[:, None]``; ``db`` is the full row sum of ``dY``,
except under a row plan, whose dropped rows are zero by its contract: there ``db`` is summed over
the plan's rows too, by the GEMM launch that reads them. Backends (``impl``):

* ``"triton"``: the kernels of :mod:`sebp_torch_ref.kernels` (CUDA, or CPU under
  ``TRITON_INTERPRET=1``): no host synchronisation, no data-dependent shape, so the backward can
  be captured in a CUDA graph.
* ``"torch"``: ``index_select`` + ``mm`` + ``index_copy`` on any device (reads ``count`` once).
* ``"dense"``: the plain backward, for A/B runs.
* ``"auto"``: ``"triton"`` on CUDA, ``"torch"`` elsewhere.

The dense crossover is decided once per step on the host, from what the data loader knows about
the batch (:func:`dense_backward`), never from a device value: with most rows real, the plain
backward (cuBLAS) is faster than any row selection. A row plan (:func:`~sebp_torch_ref.row_plan`)
hands every layer its kept rows once per step instead.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F

from .plan import current_plan
from .policy import RowPolicy, active_first_permutation, keep_mask

__all__ = ["IMPLS", "dense_backward", "sebp_linear"]

IMPLS = ("auto", "triton", "torch", "dense")

_DENSE_BACKWARD = contextvars.ContextVar("sebp_dense_backward", default=False)


@contextlib.contextmanager
def dense_backward(enabled: bool = True):
    """Inside, every :func:`sebp_linear` forward records the plain dense backward (``impl="dense"``).

    The per-step crossover: decide from the batch, on the host, whether this step's backward is
    dense, e.g. ``with dense_backward(real_tokens / padded_tokens > 0.5): loss = model(**batch)``
    with the token counts the data loader knows. It is the forward that records the choice, so the
    ``backward()`` call may sit outside the block.

    Args:
        enabled: a Python ``bool``; ``False`` leaves every layer's own ``impl``. A tensor is refused:
            reading it would synchronise with the device, which this choice exists to avoid.
    """
    if not isinstance(enabled, bool):
        raise TypeError(
            f"dense_backward: `enabled` must be a Python bool decided on the host, got "
            f"{type(enabled).__name__}."
        )
    token = _DENSE_BACKWARD.set(enabled or _DENSE_BACKWARD.get())
    try:
        yield
    finally:
        _DENSE_BACKWARD.reset(token)


def _resolve_impl(impl: str, device: torch.device) -> str:
    if impl == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return impl


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


class _SEBPLinearFunction(torch.autograd.Function):
    """``Y = X W^T + b`` on 2-D ``X``; see :func:`sebp_linear`."""

    @staticmethod
    def forward(ctx, x, weight, bias, policy, impl, plan, name):
        need_x, need_w = ctx.needs_input_grad[:2]
        # dX needs only W and dW only X: save nothing the backward will not read (frozen weights).
        ctx.save_for_backward(x if need_w else None, weight if need_x else None)
        ctx.policy, ctx.impl, ctx.plan, ctx.name = policy, impl, plan, name
        ctx.dtype = x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        # Autograd hands dY in the output's dtype, which is x's; be explicit for odd callers.
        dy = dy.to(ctx.dtype)
        plan = ctx.plan
        if plan is not None and plan.check:
            plan.check_covers(dy, ctx.name)
        if ctx.impl == "triton":
            from . import kernels  # Triton is needed only here (and may be absent elsewhere).

            if plan is None:
                # One read of dY gives the row selection and db's partial sums.
                dx, dw, db = kernels.sebp_grads(
                    dy, x if need_w else None, weight if need_x else None, ctx.policy,
                    ctx.bias_dtype if need_b else None,
                )
                return dx, dw, db, None, None, None, None
        dx = dw = db = None
        if ctx.impl == "dense":
            dx = dy @ weight if need_x else None
            dw = dy.t() @ x if need_w else None
            db = _bias_grad(dy, ctx.bias_dtype) if need_b else None
        elif ctx.impl == "triton":  # under a plan (unplanned returned above)
            # dW's programs sum db from the rows they load (a layer with in-features to load).
            fused_db = need_b and need_w and x.shape[1] > 0
            if need_x or need_w:
                # The plan's rows, read in place through its permutation: one GEMM launch.
                dx, dw, db = kernels.sebp_gemms(
                    dy, weight if need_x else None, x if need_w else None, *plan.rows("triton"), ctx.dtype,
                    compacted=False, bias_dtype=ctx.bias_dtype if fused_db else None,
                )
            if need_b and not fused_db:
                db = _planned_bias_grad(dy, plan, ctx.bias_dtype)
        else:
            if need_x or need_w:
                perm, count = (active_first_permutation(keep_mask(dy, ctx.policy)) if plan is None
                               else plan.rows("torch"))
                dx, dw = _masked_grads(dy, x, weight, perm, count, need_x, need_w)
            if need_b:
                db = _bias_grad(dy, ctx.bias_dtype) if plan is None else _planned_bias_grad(dy, plan, ctx.bias_dtype)
        return dx, dw, db, None, None, None, None


def _bias_grad(dy: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``db``: the full column sum of ``dy``, accumulated in float32. torch sums 16-bit floats in
    float32 already, so where ``db`` has ``dy``'s dtype this is one launch."""
    if dtype == dy.dtype:
        return dy.sum(dim=0)
    return dy.sum(dim=0, dtype=torch.float32).to(dtype)


def _planned_bias_grad(dy: torch.Tensor, plan, dtype: torch.dtype) -> torch.Tensor:
    """``db`` under a row plan: the column sum over the plan's rows, as dX and dW take them (a
    non-finite value outside the plan is dropped, not summed)."""
    return _bias_grad(dy.masked_fill(plan.mask.reshape(-1, 1) == 0, 0), dtype)


def _check_args(x, weight, bias, policy, impl, name) -> None:
    if name is not None and not isinstance(name, str):
        raise TypeError(f"sebp_linear: `name` must be a str or None, got {type(name).__name__}.")
    for arg, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is None and arg == "bias":
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"sebp_linear: `{arg}` must be a torch.Tensor, got {type(t).__name__}.")
        if not t.is_floating_point():
            raise TypeError(f"sebp_linear: `{arg}` must have a floating dtype, got {t.dtype}.")
    if not isinstance(policy, RowPolicy):
        raise TypeError(f"sebp_linear: `policy` must be a RowPolicy, got {type(policy).__name__}.")
    if impl not in IMPLS:
        raise ValueError(f"sebp_linear: `impl` must be one of {IMPLS}, got {impl!r}.")
    if x.dim() < 2:
        raise ValueError(f"sebp_linear: `x` must have rank >= 2 (..., in_features), got shape {tuple(x.shape)}.")
    if weight.dim() != 2:
        raise ValueError(f"sebp_linear: `weight` must be 2-D (out, in), got shape {tuple(weight.shape)}.")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"sebp_linear: `x` has {x.shape[-1]} input features but `weight` {tuple(weight.shape)} "
            f"expects {weight.shape[1]}."
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"sebp_linear: `bias` must have shape ({weight.shape[0]},), got {tuple(bias.shape)}.")
    for arg, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(f"sebp_linear: `{arg}` dtype {t.dtype} differs from `x` dtype {x.dtype}.")


def sebp_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    policy: RowPolicy = RowPolicy(),
    impl: str = "auto",
    name: str | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` whose backward runs on the rows of ``dY`` the policy keeps.

    Args:
        x: ``(..., K)`` input, rank >= 2; leading dims are flattened to ``M`` rows.
        weight: ``(N, K)`` weight in torch layout (out, in).
        bias: optional ``(N,)`` bias.
        policy: which rows of ``dY`` the backward keeps (:class:`RowPolicy`; default exact).
        impl: ``"auto"``, ``"triton"``, ``"torch"`` or ``"dense"`` (see the module docstring).
        name: the layer's name in errors (a :func:`~sebp_torch_ref.row_plan` check); ``None``
            names it by its shape.

    Returns:
        ``(..., N)`` output, equal to ``F.linear(x, weight, bias)``. In the backward, ``dX`` and
        ``dW`` are the dense gradients of ``dY * keep[:, None]`` (accumulated in float32, returned
        in the primal dtypes) and ``db`` is the full ``dY.sum(rows)`` (under a row plan, the sum
        over the plan's rows, like dX and dW). Gradients are computed only
        for inputs that require them (no ``dW`` for a frozen weight).

    Under autocast the inputs are cast to the autocast dtype first, as autocast does for
    ``F.linear``, so float32 master weights get float32 gradients. Inside
    :func:`~sebp_torch_ref.row_plan`, a layer whose leading dims are the mask's keeps the mask's
    rows instead of scoring ``dY`` (exact policy only).
    """
    if torch.compiler.is_compiling():
        return _sebp_linear_graph_break(x, weight, bias, policy, impl, name)
    return _sebp_linear(x, weight, bias, policy, impl, name)


def _sebp_linear(x, weight, bias, policy, impl, name) -> torch.Tensor:
    _check_args(x, weight, bias, policy, impl, name)
    impl = "dense" if _DENSE_BACKWARD.get() else _resolve_impl(impl, x.device)
    if impl == "triton":
        from . import kernels

        kernels.check_device(x)  # Fail at the call, not deep inside the backward.
    plan = None if impl == "dense" else current_plan(x)
    if plan is not None:
        # Named here, not per call: only a planned layer's errors need the name.
        name = name or f"sebp_linear(in_features={weight.shape[1]}, out_features={weight.shape[0]})"
        plan.check_device(x, name)
        if not policy.is_exact:
            raise ValueError(f"row_plan: layer {name} has the non-exact policy {policy}; a row plan "
                             f"keeps the mask's rows, so it needs the exact RowPolicy() (or leave the "
                             f"layer out).")
    device_type = x.device.type
    autocast = contextlib.nullcontext()
    if torch.is_autocast_enabled(device_type):
        # The autocast recipe for linear, applied by hand (custom_fwd binds one device type at
        # decoration time, while this function serves every device). The casts are recorded by
        # autograd, so float32 master weights get float32 gradients.
        dtype = torch.get_autocast_dtype(device_type)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
        autocast = torch.autocast(device_type, enabled=False)
    with autocast:
        y2d = _SEBPLinearFunction.apply(x.reshape(-1, x.shape[-1]), weight, bias, policy, impl, plan, name)
    return y2d.reshape(*x.shape[:-1], weight.shape[0])


# Under torch.compile the layer is a graph break: the Triton launches and the autograd Function run
# eagerly. Only there: wrapping sebp_linear itself would cost every eager call the wrapper's time.
_sebp_linear_graph_break = torch.compiler.disable(_sebp_linear)
