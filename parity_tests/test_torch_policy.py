"""sebp_torch_ref.policy against a plain-Python reading of the row-selection contract (DESIGN §2)."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch

from sebp_torch_ref import RowPolicy
from sebp_torch_ref.policy import active_first_permutation, keep_mask, row_scores


def reference_keep(dy: torch.Tensor, policy: RowPolicy) -> np.ndarray:
    """The contract row by row: float32 max-abs score, non-finite rows kept, Top-N by L2 norm."""
    rows = dy.float().numpy()
    finite = [bool(np.isfinite(r).all()) for r in rows]
    active = [not f or float(np.abs(r).max(initial=0.0)) > np.float32(policy.threshold) for r, f in zip(rows, finite)]
    keep = np.array(active, dtype=bool)
    if policy.max_rows is not None and keep.sum() > policy.max_rows:
        # Non-finite first, then larger norm, then lower index.
        ranked = sorted(
            (i for i in range(len(rows)) if active[i]),
            key=lambda i: (finite[i], -np.linalg.norm(rows[i].astype(np.float64)) if finite[i] else 0.0, i),
        )
        keep[:] = False
        keep[ranked[: policy.max_rows]] = True
    return keep


def _dy(kind: str, m: int, n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    dy = torch.randn(m, n, generator=gen).to(dtype)
    if kind == "all_zero":
        return torch.zeros_like(dy)
    if kind == "all_active":
        return dy
    dy[torch.rand(m, generator=gen) < 0.4] = 0
    dy[torch.rand(m, generator=gen) < 0.3] *= 1e-4  # rows below a 1e-3 threshold
    if kind == "ties":
        dy[1::3] = dy[0]  # many rows of exactly equal norm
    if kind == "nonfinite":
        dy[m // 2, n // 3] = math.nan
        dy[m - 1] = 0
        dy[m - 1, 0] = -math.inf
        dy[2, 1] = math.inf
    if kind in ("huge", "huge_nonfinite"):  # squares overflow float32; the norm must not
        dy[0] = 3e38
        dy[3] = 2e38
    if kind == "huge_nonfinite":  # a norm past float32's range still ranks below a NaN row
        dy[m - 1, 0] = math.nan
    return dy


POLICIES = [
    RowPolicy(),
    RowPolicy(threshold=1e-3),
    RowPolicy(max_rows=1),
    RowPolicy(max_rows=4),
    RowPolicy(threshold=1e-3, max_rows=3),
    RowPolicy(max_rows=1000),
]


@pytest.mark.parametrize("policy", POLICIES, ids=str)
@pytest.mark.parametrize("kind", ["all_zero", "all_active", "random", "ties", "nonfinite", "huge",
                                  "huge_nonfinite"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_keep_mask_matches_reference(policy, kind, dtype):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{policy}{kind}{dtype}".encode()))
    dy = _dy(kind, 23, 17, dtype, gen)
    np.testing.assert_array_equal(keep_mask(dy, policy).numpy(), reference_keep(dy, policy))


def test_row_scores_float32_and_nan():
    dy = torch.tensor([[1.0, -3.0, 2.0], [0.0, math.nan, 1.0], [math.inf, 0.0, 0.0]], dtype=torch.bfloat16)
    s = row_scores(dy)
    assert s.dtype == torch.float32
    assert s[0].item() == 3.0 and math.isnan(s[1].item()) and math.isinf(s[2].item())


def test_max_rows_tie_break_is_lower_index():
    dy = torch.zeros(9, 4)
    dy[[2, 5, 7, 8]] = torch.tensor([1.0, 2.0, 3.0, 4.0])  # four rows of one norm
    keep = keep_mask(dy, RowPolicy(max_rows=2))
    assert keep.nonzero().flatten().tolist() == [2, 5]


def test_max_rows_nonfinite_rows_first():
    dy = torch.zeros(6, 3)
    dy[0] = 1e30  # larger norm than anything finite below, still after non-finite rows
    dy[4, 1] = math.nan
    dy[5, 2] = -math.inf
    keep = keep_mask(dy, RowPolicy(max_rows=2))
    assert keep.nonzero().flatten().tolist() == [4, 5]


@pytest.mark.parametrize("m", [0, 1, 17, 64])
def test_active_first_permutation(m):
    gen = torch.Generator().manual_seed(m)
    keep = torch.rand(m, generator=gen) < 0.35
    perm, count = active_first_permutation(keep)
    kept = keep.nonzero().flatten().tolist()
    dropped = (~keep).nonzero().flatten().tolist()
    assert perm.dtype == torch.int32 and count.shape == (1,)
    assert count.item() == len(kept)
    assert perm.tolist() == kept + dropped


@pytest.mark.parametrize(
    "kwargs, error, field",
    [
        (dict(threshold=-1e-6), ValueError, "threshold"),
        (dict(threshold=math.nan), ValueError, "threshold"),
        (dict(threshold=math.inf), ValueError, "threshold"),
        (dict(threshold="0"), TypeError, "threshold"),
        (dict(threshold=True), TypeError, "threshold"),
        (dict(max_rows=0), ValueError, "max_rows"),
        (dict(max_rows=-3), ValueError, "max_rows"),
        (dict(max_rows=2.0), TypeError, "max_rows"),
        (dict(max_rows=True), TypeError, "max_rows"),
    ],
)
def test_row_policy_validation(kwargs, error, field):
    with pytest.raises(error, match=field):
        RowPolicy(**kwargs)


def test_row_policy_is_frozen_and_hashable():
    assert RowPolicy(threshold=0) == RowPolicy() and hash(RowPolicy(threshold=0)) == hash(RowPolicy())
    assert RowPolicy().is_exact and not RowPolicy(max_rows=3).is_exact
    with pytest.raises(AttributeError):
        RowPolicy().threshold = 1.0
