"""``sebp_linear`` inside ``torch.compile`` graphs: a custom op with a registered autograd.

Dynamo cannot trace the ``autograd.Function`` of the eager path through its backends (Triton
launches, a host read of ``count``), and a graph break per layer cut a compiled LLaMA-3.2-3B into
~200 graphs whose host time outweighed SEBP's gain at small batches (``benchmarks/NOTES_torch.md``,
"v22b"). Two functional custom ops keep the layer in one graph instead:

* ``sebp_torch_ref::linear(x, weight, bias?, plan_keep?, plan_perm?, plan_count?, threshold,
  max_rows?, impl, check, name) -> Tensor``: ``F.linear(x, weight, bias)``. Its registered
  autograd saves what the backward reads, so AOTAutograd puts
* ``sebp_torch_ref::linear_backward(dy, x?, weight?, plan_keep?, plan_perm?, plan_count?,
  threshold, max_rows?, impl, check, name, bias_dtype?) -> Tensor[]``: the gradients asked for
  (``dX`` if ``weight`` is given, ``dW`` if ``x`` is, ``db`` if ``bias_dtype`` is, in that order),
  computed by :func:`~sebp_torch_ref.grads.linear_grads`, the eager path's backends,

into the compiled backward graph, which Inductor calls as opaque kernels. Custom ops take tensors,
numbers, strings and dtypes only, so the :class:`~sebp_torch_ref.policy.RowPolicy` travels as its
fields and a row plan as tensors: its mask's rows ``plan_keep`` and their active-first
permutation, made by the graph from the mask (one computation that the CSE of Inductor's
partitioner shares between the layers), so a new mask per step reuses the compiled graph. Eager calls keep the
``autograd.Function``: a custom op costs host time per call that a compiled graph does not pay.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .grads import linear_grads
from .plan import RowPlan
from .policy import RowPolicy

__all__ = ["linear"]


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, policy: RowPolicy, impl: str,
    plan: RowPlan | None, name: str | None,
) -> torch.Tensor:
    """``sebp_torch_ref::linear`` on 2-D ``x`` with :func:`~sebp_torch_ref.sebp_linear`'s checked
    and resolved arguments (``impl`` not ``"auto"``); called by traced code."""
    keep = perm = count = None
    if plan is not None:
        keep = plan.mask.reshape(-1) != 0
        perm, count = _active_first(keep)
    return torch.ops.sebp_torch_ref.linear(
        x, weight, bias, keep, perm, count, policy.threshold, policy.max_rows, impl,
        plan is not None and plan.check, name,
    )


def _active_first(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~sebp_torch_ref.policy.active_first_permutation` of ``keep`` (the same ``(perm,
    count)``) by ops that the CSE of Inductor's partitioner merges across the layers: a stable
    sort, where the eager function scatters into ``empty_like``, which CSE never merges."""
    perm = torch.sort(keep.logical_not().to(torch.uint8), stable=True).indices.to(torch.int32)
    return perm, keep.sum(dtype=torch.int32).reshape(1)


@torch.library.custom_op("sebp_torch_ref::linear", mutates_args=())
def _linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan_keep: torch.Tensor | None,
    plan_perm: torch.Tensor | None, plan_count: torch.Tensor | None, threshold: float,
    max_rows: int | None, impl: str, check: bool, name: str | None,
) -> torch.Tensor:
    return F.linear(x, weight, bias)


@_linear.register_fake
def _(x, weight, bias, plan_keep, plan_perm, plan_count, threshold, max_rows, impl, check, name):
    return x.new_empty(x.shape[0], weight.shape[0])


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, keep, perm, count, threshold, max_rows, impl, check, name = inputs
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    # dX needs only W and dW only X: save nothing the backward will not read (frozen weights).
    ctx.save_for_backward(x if need_w else None, weight if need_x else None, keep, perm, count)
    ctx.options = threshold, max_rows, impl, check, name
    ctx.dtype = x.dtype
    ctx.bias_dtype = bias.dtype if need_b else None


def _backward(ctx, dy):
    x, weight, keep, perm, count = ctx.saved_tensors
    grads = iter(torch.ops.sebp_torch_ref.linear_backward(
        dy.to(ctx.dtype), x, weight, keep, perm, count, *ctx.options, ctx.bias_dtype))
    # The op returns the gradients asked for, in order; the other inputs get None.
    dx, dw, db = (next(grads) if asked else None for asked in (weight is not None, x is not None,
                                                              ctx.bias_dtype is not None))
    return dx, dw, db, None, None, None, None, None, None, None, None


_linear.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("sebp_torch_ref::linear_backward", mutates_args=())
def _linear_backward(
    dy: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor | None, plan_keep: torch.Tensor | None,
    plan_perm: torch.Tensor | None, plan_count: torch.Tensor | None, threshold: float,
    max_rows: int | None, impl: str, check: bool, name: str | None, bias_dtype: torch.dtype | None,
) -> list[torch.Tensor]:
    plan = None if plan_keep is None else RowPlan(plan_keep, check, rows=(plan_perm, plan_count))
    grads = linear_grads(dy, x, weight, bias_dtype, RowPolicy(threshold, max_rows), impl, plan, name)
    return [g for g in grads if g is not None]


@_linear_backward.register_fake
def _(dy, x, weight, plan_keep, plan_perm, plan_count, threshold, max_rows, impl, check, name, bias_dtype):
    grads = []
    if weight is not None:
        grads.append(dy.new_empty(dy.shape[0], weight.shape[1]))
    if x is not None:
        grads.append(dy.new_empty(dy.shape[1], x.shape[1]))
    if bias_dtype is not None:
        grads.append(dy.new_empty(dy.shape[1], dtype=bias_dtype))
    return grads
