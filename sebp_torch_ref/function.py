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

The backends live in :mod:`sebp_torch_ref.grads`. Under ``torch.compile`` the layer is a custom
op with a registered autograd instead of the ``autograd.Function`` (:mod:`sebp_torch_ref.compiled`),
so the compiled model stays one graph.

The dense crossover is decided once per step on the host, from what the data loader knows about
the batch (:func:`dense_backward`), never from a device value: with most rows real, the plain
backward (cuBLAS) is faster than any row selection. A row plan (:func:`~sebp_torch_ref.row_plan`)
hands every layer its kept rows once per step instead.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import compiled
from .grads import linear_grads
from .plan import RowPlan, current_plan
from .policy import RowPolicy
from .traced_state import TracedContextVar

__all__ = ["IMPLS", "dense_backward", "sebp_linear"]

IMPLS = ("auto", "triton", "torch", "dense")

# The per-step crossover's choice, read by traced code too (a step of the other choice runs the
# other compiled graph).
_DENSE_BACKWARD = TracedContextVar("sebp_dense_backward", default=False)


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
    with _DENSE_BACKWARD.bound(lambda outer: enabled or outer):
        yield


def _resolve_impl(impl: str, device: torch.device) -> str:
    if impl == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return impl


class _Backward(NamedTuple):
    """How a layer's backward runs: what :func:`~sebp_torch_ref.grads.linear_grads` takes besides
    the tensors (one argument of the ``Function``, whose ``apply`` costs host time per argument)."""

    policy: RowPolicy
    impl: str
    plan: RowPlan | None
    name: str | None


class _SEBPLinearFunction(torch.autograd.Function):
    """``Y = X W^T + b`` on ``X`` of any rank >= 2; see :func:`sebp_linear`.

    ``X`` and ``dY`` are flattened to rows inside the ``Function``, not around it: reshapes
    outside would be two more autograd nodes per layer (eagerly, host work per layer is what a
    step of short sequences waits on), and ``flatten`` takes a layer of no input features, whose
    ``reshape(-1, 0)`` is ambiguous."""

    @staticmethod
    def forward(ctx, x, weight, bias, backward: _Backward):
        need_x, need_w = ctx.needs_input_grad[:2]
        # dX needs only W and dW only X: save nothing the backward will not read (frozen weights).
        ctx.save_for_backward(x if need_w else None, weight if need_x else None)
        ctx.backward_options = backward
        ctx.x_shape, ctx.dtype = x.shape, x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        need_b = ctx.needs_input_grad[2]
        if dy.dtype != ctx.dtype:  # autograd hands dY in the output's dtype, which is x's
            dy = dy.to(ctx.dtype)
        dx, dw, db = linear_grads(dy.flatten(0, -2), None if x is None else x.flatten(0, -2), weight,
                                  ctx.bias_dtype if need_b else None, *ctx.backward_options)
        return None if dx is None else dx.reshape(ctx.x_shape), dw, db, None


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
    # Under torch.compile the layer stays in the graph as a custom op (:mod:`.compiled`); eagerly
    # it is the autograd Function, which costs less host time per call.
    traced = torch.compiler.is_compiling()
    _check_args(x, weight, bias, policy, impl, name)
    dense = _DENSE_BACKWARD.get(traced)
    impl = "dense" if dense else _resolve_impl(impl, x.device)
    if impl == "triton":
        from . import kernels

        kernels.check_device(x)  # Fail at the call, not deep inside the backward.
    plan = None if impl == "dense" else current_plan(x, traced)
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
        if not traced:
            return _SEBPLinearFunction.apply(x, weight, bias, _Backward(policy, impl, plan, name))
        if impl == "dense":  # the plain backward: Inductor compiles it with the rest
            return F.linear(x, weight, bias)
        x2d = x.flatten(0, -2)
        y2d = compiled.linear(x2d, weight, bias, policy, impl, plan, name)
    return y2d.reshape(*x.shape[:-1], weight.shape[0])
