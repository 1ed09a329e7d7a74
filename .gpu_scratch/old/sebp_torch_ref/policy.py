"""Which rows of the output gradient SEBP keeps: the contract every backend shares.

For a flattened output gradient ``dy`` of shape ``(M, N)``:

* the row score is ``s_i = max_j |dy_ij|`` in float32;
* a row is *active* if ``s_i > threshold`` or it holds a NaN/Inf (a NaN is never hidden);
* with ``max_rows=k`` and more than ``k`` active rows, the ``k`` with the largest float32 L2 norm
  are kept (non-finite rows first, ties broken by the lower row index).

Every backend computes ``dX``/``dW`` as the dense backward of ``dy * keep[:, None]``; the functions
here decide ``keep`` and order the rows so that kernels walk the kept rows only. Nothing here
synchronises with the host: ``count`` stays a device tensor.
"""

from __future__ import annotations

import dataclasses
import math

import torch

__all__ = [
    "RowPolicy",
    "row_scores",
    "keep_mask",
    "active_first_permutation",
]


@dataclasses.dataclass(frozen=True)
class RowPolicy:
    """Which output-gradient rows the SEBP backward keeps.

    Attributes:
        threshold: a row is active if its largest absolute entry exceeds this (compared in
            float32). ``0.0`` (the default) keeps every row with any non-zero entry, so the
            backward is exact. The paper's noise cut for LLaMA-3.2-3B is ``3.98e-5``.
        max_rows: keep at most this many rows per call: when more rows are active, those with
            the largest L2 norm (the paper's fixed Top-N). ``None`` keeps every active row.

    >>> RowPolicy().is_exact
    True
    >>> RowPolicy(threshold=3.98e-5, max_rows=2048).is_exact
    False
    """

    threshold: float = 0.0
    max_rows: int | None = None

    def __post_init__(self) -> None:
        threshold = self.threshold
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
            raise TypeError(
                f"RowPolicy: `threshold` must be a real number, got {threshold!r} "
                f"of type {type(threshold).__name__}."
            )
        if math.isnan(threshold) or threshold < 0 or math.isinf(threshold):
            raise ValueError(f"RowPolicy: `threshold` must be finite and >= 0, got {threshold!r}.")
        # Normalise so that equal policies compare and hash equally (0 and 0.0).
        object.__setattr__(self, "threshold", float(threshold))
        max_rows = self.max_rows
        if max_rows is not None:
            if isinstance(max_rows, bool) or not isinstance(max_rows, int):
                raise TypeError(
                    f"RowPolicy: `max_rows` must be an int or None, got {max_rows!r} "
                    f"of type {type(max_rows).__name__}."
                )
            if max_rows < 1:
                raise ValueError(f"RowPolicy: `max_rows` must be >= 1, got {max_rows}.")

    @property
    def is_exact(self) -> bool:
        """True if the policy drops only all-zero rows, so the backward equals the dense one."""
        return self.threshold == 0.0 and self.max_rows is None


def row_scores(dy: torch.Tensor) -> torch.Tensor:
    """Largest absolute entry of each row, in float32; NaN for rows that hold a NaN.

    Args:
        dy: ``(M, N)`` output gradient.

    Returns:
        ``(M,)`` float32 scores. ``max |.|`` is exact in any float dtype, so the reduction reads
        ``dy`` once in its own dtype (no float32 copy, no ``abs`` temporary); the inf-norm
        reduction propagates NaN.
    """
    return torch.linalg.vector_norm(dy, ord=math.inf, dim=1).float()


def _row_norms(dy: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Float32 L2 norm of each finite row (clamped to float32's max), never overflowing or
    underflowing on the way, and never a float32 copy of ``dy`` (the norm accumulates in float32
    as it reads ``dy`` in its own dtype).

    A float16 entry's square is a normal float32: one read. Wider-ranged dtypes are first divided
    by a power of two near the row's max (``scores``), which is exact: one copy in ``dy``'s dtype
    and one read. A non-finite row's norm is meaningless: :func:`keep_mask` ranks those rows by
    their flag.
    """
    accumulate = torch.promote_types(dy.dtype, torch.float32)
    if dy.dtype == torch.float16:
        norms = torch.linalg.vector_norm(dy, dim=1, dtype=accumulate)
    else:
        exponent = torch.frexp(scores).exponent.clamp(-100, 100)
        scale = torch.ldexp(torch.ones_like(scores), exponent)
        scaled = dy / scale[:, None].to(dy.dtype)
        norms = scale * torch.linalg.vector_norm(scaled, dim=1, dtype=accumulate)
    return norms.float().clamp(max=torch.finfo(torch.float32).max)


def keep_mask(dy: torch.Tensor, policy: RowPolicy) -> torch.Tensor:
    """Rows of ``dy`` that the backward keeps under ``policy``.

    Args:
        dy: ``(M, N)`` output gradient, any float dtype.
        policy: the :class:`RowPolicy`.

    Returns:
        ``(M,)`` bool mask on ``dy``'s device.
    """
    scores = row_scores(dy)
    nonfinite = ~torch.isfinite(scores)
    active = (scores > policy.threshold) | nonfinite
    num_rows = dy.shape[0]
    if policy.max_rows is None or policy.max_rows >= num_rows:
        return active
    # Rank active rows by norm, non-finite rows above every finite one, inactive rows below all.
    norms = _row_norms(dy, scores)
    rank_key = torch.where(
        nonfinite,
        torch.full_like(norms, math.inf),
        torch.where(active, norms, torch.full_like(norms, -1.0)),
    )
    return top_rows(rank_key, policy.max_rows)


def top_rows(rank_key: torch.Tensor, max_rows: int) -> torch.Tensor:
    """The ``max_rows`` rows of largest ``rank_key`` among those with ``rank_key >= 0`` (the active
    rows: their float32 L2 norm, ``inf`` for a non-finite row; ``-1`` marks an inactive one), ties
    to the lower index.

    Device kernels only, nothing the host waits for (CUDA-graph capturable): a stable descending
    sort (``torch.topk`` promises no order among ties), then each row's place in that order by one
    scatter of the inverse permutation, compared with ``max_rows``. (An index assignment such as
    ``in_top[order[:k]] = True`` synchronises on CUDA: ``results/v14_h100/sync_probe.txt``.)

    Args:
        rank_key: ``(M,)`` float32.
        max_rows: the Top-N.

    Returns:
        ``(M,)`` bool mask.
    """
    order = torch.sort(rank_key, descending=True, stable=True).indices
    place = torch.empty_like(order).scatter_(
        0, order, torch.arange(order.shape[0], dtype=order.dtype, device=order.device))
    return (rank_key >= 0) & (place < max_rows)


def active_first_permutation(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A permutation of the rows with the kept rows first, each part in row order.

    A stable partition by one prefix sum and one scatter: no sort, no host synchronisation.

    Args:
        keep: ``(M,)`` bool mask.

    Returns:
        ``(perm, count)``: ``perm`` is ``(M,)`` int32 with ``perm[:count]`` the kept rows in
        increasing order and ``perm[count:]`` the dropped ones; ``count`` is a ``(1,)`` int32
        device tensor (kernels read it; the host reads it only where it must).
    """
    num_rows = keep.shape[0]
    row = torch.arange(num_rows, dtype=torch.int32, device=keep.device)
    kept_through = torch.cumsum(keep, dim=0, dtype=torch.int32)  # kept rows in [0, i]
    count = kept_through[-1:] if num_rows else torch.zeros(1, dtype=torch.int32, device=keep.device)
    # Kept row i goes to slot kept_through[i] - 1; dropped row i after all kept rows, at
    # count + (dropped rows before i) = count + i - kept_through[i].
    dest = torch.where(keep, kept_through - 1, count + row - kept_through)
    perm = torch.empty_like(row).scatter_(0, dest.long(), row)
    return perm, count
