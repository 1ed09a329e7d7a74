"""The torch bound: every ``nn.Linear`` of a model with a free backward, ``dY`` still read once.

The torch counterpart of :func:`benchmarks.workloads.free_linear_backward` (``jax-bound``): the
forward is ``F.linear``; the backward returns zero ``dX`` and ``dW`` without any matmul, and
reads ``dY`` once (its column sum, which is ``db`` where there is a bias), the read SEBP's row
selection makes too. Everything between the linear layers (attention, activations, norms) keeps
its backward, as it must under SEBP, whose ``dX`` is not zero. So a model's step with this swap is
the fastest any SEBP backend could make it: the ceiling of the ``torch-sebp`` rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FreeBackwardLinear", "free_linear_backward_"]


class _FreeLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.x_meta = (x.shape, x.dtype)
        ctx.weight_meta = (weight.shape, weight.dtype)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        need_x, need_w, need_b = ctx.needs_input_grad
        column_sum = dy.reshape(-1, dy.shape[-1]).sum(0, dtype=torch.float32)  # the one read of dY
        dx = _zeros(ctx.x_meta, column_sum) if need_x else None
        dw = _zeros(ctx.weight_meta, column_sum) if need_w else None
        db = column_sum.to(ctx.bias_dtype) if need_b else None
        return dx, dw, db


def _zeros(meta: tuple[torch.Size, torch.dtype], column_sum: torch.Tensor) -> torch.Tensor:
    """Zeros of ``meta``'s shape and dtype. Eagerly a memset. Under ``torch.compile`` constant
    zeros would let Inductor fold away every backward op they feed (the norms', activations' and
    attention's, which SEBP must still run, as ``jax-bound``'s comment in
    ``benchmarks.workloads._free_matmul_bwd`` explains): there they are ``dY``'s finite sum times
    zero, a run-time value, as in ``jax-bound``."""
    shape, dtype = meta
    if not torch.compiler.is_compiling():
        return torch.zeros(shape, dtype=dtype, device=column_sum.device)
    zero = 0.0 * torch.nan_to_num(column_sum.sum(), nan=0.0, posinf=0.0, neginf=0.0)
    return zero.to(dtype).expand(shape).contiguous()


class FreeBackwardLinear(nn.Linear):
    """``nn.Linear`` with the free backward; shares the Parameters of the layer it replaces."""

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> FreeBackwardLinear:
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        layer.weight, layer.bias = linear.weight, linear.bias
        layer.train(linear.training)
        return layer

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _FreeLinearFunction.apply(input, self.weight, self.bias)


def free_linear_backward_(model: nn.Module) -> int:
    """Replaces every module of type exactly ``nn.Linear`` in ``model`` (in place) by a
    :class:`FreeBackwardLinear` sharing its Parameters; returns how many were replaced."""
    if not isinstance(model, nn.Module) or type(model) is nn.Linear:
        raise TypeError(f"free_linear_backward_: `model` must be an nn.Module holding linear layers, "
                        f"got {type(model).__name__}.")
    replaced: dict[int, FreeBackwardLinear] = {}
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                replaced.setdefault(id(child), FreeBackwardLinear.from_linear(child))
                setattr(module, name, replaced[id(child)])
    return len(replaced)
