"""Row plans: the kept rows of every layer, handed in once per step instead of found per layer.

In a padded batch every linear layer's output gradient is non-zero on the same rows: the real
tokens. Inside ``with row_plan(batch["attention_mask"]):`` every :func:`~sebp_torch_ref.sebp_linear`
forward whose input's leading dims are the mask's records the plan, and its backward then keeps
the plan's rows instead of scoring ``dY``: no select launch, no copies, the GEMM launch reads the
kept rows of ``dY`` and ``X`` through the plan's permutation. The permutation is made once per
plan, on the device, at the first backward that needs it (no host synchronisation).

A planned layer computes the dense backward of ``dY * mask[:, None]``, ``db`` included (summed
over the kept rows by the GEMM launch that loads them: no second read of ``dY``), which is exact
whenever every row outside the mask is zero in ``dY`` (padding that attention and the loss
ignore); a superset of the non-zero rows is still exact. ``check=True`` reads ``dY`` in every planned layer
and raises an error naming the layer when a row outside the mask is non-zero or non-finite.
"""

from __future__ import annotations

import contextlib

import torch

from .policy import RowPolicy, active_first_permutation, keep_mask
from .traced_state import TracedContextVar

__all__ = ["RowPlan", "row_plan"]

# The active plan, read by traced code too (see sebp_torch_ref.traced_state).
_ROW_PLAN = TracedContextVar("sebp_row_plan", default=None)


class RowPlan:
    """The rows that every planned layer of one step keeps (see :func:`row_plan`).

    Attributes:
        mask: the mask as given, over the layers' leading dims ``rows_shape``.
        rows_shape: the leading dims of the layers the plan applies to.
        check: whether every planned layer verifies that no row outside the mask is non-zero.
    """

    def __init__(self, mask: torch.Tensor, check: bool,
                 rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.mask = mask
        self.rows_shape = tuple(mask.shape)
        self.check = check
        # (perm, count) as rows() makes them; given where a compiled graph has made them already.
        self._rows = rows

    def applies_to(self, x: torch.Tensor) -> bool:
        """Whether the plan describes the rows of a layer input ``x`` of shape ``(..., K)``."""
        return tuple(x.shape[:-1]) == self.rows_shape

    def check_device(self, x: torch.Tensor, layer: str) -> None:
        """Raises ``ValueError`` naming ``layer`` if the mask is not on its input ``x``'s device."""
        if self.mask.device != x.device:
            raise ValueError(f"row_plan: `mask` is on {self.mask.device} but layer {layer}'s input is "
                             f"on {x.device}; move the mask to the model's device.")

    def rows(self, impl: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(perm, count)``: the active-first permutation of the mask's rows (int32 ``(M,)``) and
        the number of kept rows (int32 ``(1,)``), device tensors made at the first call."""
        if self._rows is None:  # the backends agree on the permutation: one per plan serves all
            keep = self.mask.reshape(-1) != 0
            if impl == "triton":
                from . import kernels

                self._rows = kernels.permutation_of(keep)
            else:
                self._rows = active_first_permutation(keep)
        return self._rows

    def check_covers(self, dy: torch.Tensor, layer: str) -> None:
        """Raises ``ValueError`` naming ``layer`` if a row of ``dy (M, N)`` outside the mask is
        non-zero or non-finite (reads a count on the host: for tests and first runs)."""
        outside = int((keep_mask(dy, RowPolicy()) & (self.mask.reshape(-1) == 0)).sum())
        if outside:
            raise ValueError(
                f"SEBP row plan: layer {layer} has {outside} output-gradient row(s) outside the plan "
                f"that are non-zero or non-finite; its gradient would drop them. Plan a superset of "
                f"the rows the loss and attention use, or leave this layer out of apply_sebp (`where=`)."
            )


@contextlib.contextmanager
def row_plan(mask: torch.Tensor, *, check: bool = False):
    """Inside, every :func:`~sebp_torch_ref.sebp_linear` forward whose input's leading dims are
    ``mask.shape`` records a row plan: its backward keeps the rows where ``mask`` is non-zero.

    ``with row_plan(batch["attention_mask"]): loss = model(**batch).loss``; as with
    :func:`~sebp_torch_ref.dense_backward`, it is the forward that records the plan, so
    ``backward()`` may sit outside the block. Layers of other leading dims (a pooler on ``(batch,
    hidden)``) score ``dY`` as usual; a step under :func:`~sebp_torch_ref.dense_backward` runs
    dense.

    Args:
        mask: bool or integer tensor on the layers' device, e.g. the ``(batch, seq_len)``
            attention mask.
        check: in every planned layer, read ``dY`` and raise an error naming the layer if a row
            outside the mask is non-zero or non-finite (synchronises; for tests and first runs).

    Yields:
        The :class:`RowPlan`.
    """
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"row_plan: `mask` must be a torch.Tensor, got {type(mask).__name__}.")
    if mask.dtype != torch.bool and (mask.is_floating_point() or mask.is_complex()):
        raise TypeError(f"row_plan: `mask` must be a bool or integer tensor, got {mask.dtype}.")
    if mask.dim() < 1:
        raise ValueError(f"row_plan: `mask` must have the layers' leading dims (rank >= 1), got shape "
                         f"{tuple(mask.shape)}.")
    if not isinstance(check, bool):
        raise TypeError(f"row_plan: `check` must be a bool, got {check!r}.")
    plan = RowPlan(mask, check)
    with _ROW_PLAN.bound(lambda _: plan):
        yield plan


def current_plan(x: torch.Tensor, traced: bool = False) -> RowPlan | None:
    """The active plan if it applies to the layer input ``x``, else ``None``; ``traced``: read as
    code under ``torch.compile`` must (:mod:`sebp_torch_ref.traced_state`)."""
    plan = _ROW_PLAN.get(traced)
    return plan if plan is not None and plan.applies_to(x) else None
