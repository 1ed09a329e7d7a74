"""``SEBPLinear`` and ``apply_sebp``: SEBP in existing PyTorch (e.g. Hugging Face) models."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .function import IMPLS, sebp_linear
from .policy import RowPolicy

__all__ = ["SEBPLinear", "apply_sebp"]


class SEBPLinear(nn.Linear):
    """``nn.Linear`` whose backward is the SEBP backward (:func:`sebp_torch_ref.sebp_linear`).

    Same parameters, names, shapes and initialisation as ``nn.Linear``: a state dict moves between
    the two untouched.

    Args:
        in_features, out_features, bias, device, dtype: as for ``nn.Linear``.
        policy: which rows of the output gradient the backward keeps.
        impl: ``"auto"``, ``"triton"``, ``"torch"`` or ``"dense"``.
        name: the layer's name in errors (:func:`~sebp_torch_ref.apply_sebp` passes its dotted
            module name).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        policy: RowPolicy = RowPolicy(),
        impl: str = "auto",
        name: str | None = None,
    ) -> None:
        _check_options(policy, impl)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.policy = policy
        self.impl = impl
        self.name = name

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, policy: RowPolicy = RowPolicy(), impl: str = "auto", name: str | None = None,
    ) -> SEBPLinear:
        """An ``SEBPLinear`` sharing ``linear``'s Parameters (no copy: tying and optimisers hold)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear: `linear` must be an nn.Linear, got {type(linear).__name__}.")
        # Built on the meta device so that no storage is allocated, then given linear's Parameters.
        layer = cls(
            linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta",
            policy=policy, impl=impl, name=name,
        )
        layer.weight = linear.weight
        layer.bias = linear.bias
        layer.train(linear.training)
        return layer

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return sebp_linear(input, self.weight, self.bias, policy=self.policy, impl=self.impl, name=self.name)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, policy={self.policy}, impl={self.impl!r}"


def _check_options(policy: RowPolicy, impl: str) -> None:
    if not isinstance(policy, RowPolicy):
        raise TypeError(f"`policy` must be a RowPolicy, got {type(policy).__name__}.")
    if impl not in IMPLS:
        raise ValueError(f"`impl` must be one of {IMPLS}, got {impl!r}.")


def apply_sebp(
    model: nn.Module,
    policy: RowPolicy = RowPolicy(),
    *,
    where: Callable[[str], bool] | None = None,
    impl: str = "auto",
) -> int:
    """Replaces the ``nn.Linear`` modules of ``model`` in place by :class:`SEBPLinear`.

    Only modules whose type is exactly ``nn.Linear`` are swapped: subclasses (quantised linears,
    ``MultiheadAttention``'s ``out_proj``, an existing ``SEBPLinear``) have their own forward and
    are left alone. A module registered under several names is swapped once, everywhere, and
    decided by its first name. Parameters are shared, not copied, so weight tying, the optimiser's
    parameter list and ``requires_grad`` are untouched.

    Args:
        model: the module to patch; it must not itself be an ``nn.Linear``.
        policy: the :class:`RowPolicy` of every swapped layer.
        where: predicate on the dotted name from ``model.named_modules()`` (e.g.
            ``"encoder.layer.3.intermediate.dense"``); ``None`` swaps every ``nn.Linear``.
        impl: backend of every swapped layer.

    Returns:
        The number of modules swapped.
    """
    _check_options(policy, impl)
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply_sebp: `model` must be an nn.Module, got {type(model).__name__}.")
    if type(model) is nn.Linear:
        raise ValueError("apply_sebp: `model` is itself an nn.Linear; use SEBPLinear.from_linear.")
    if where is not None and not callable(where):
        raise TypeError(f"apply_sebp: `where` must be callable or None, got {type(where).__name__}.")
    replacement: dict[int, nn.Module | None] = {}  # id(linear) -> SEBPLinear, or None if skipped
    for name, module in model.named_modules(remove_duplicate=False):
        for child_name, child in list(module.named_children()):
            if type(child) is not nn.Linear:
                continue
            if id(child) not in replacement:
                full_name = f"{name}.{child_name}" if name else child_name
                chosen = where is None or where(full_name)
                replacement[id(child)] = SEBPLinear.from_linear(child, policy, impl, full_name) if chosen else None
            if replacement[id(child)] is not None:
                setattr(module, child_name, replacement[id(child)])
    return sum(new is not None for new in replacement.values())
