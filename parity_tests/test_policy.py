"""sebp_jax.policy (RowPolicy, row selection) against the numpy reading of the contract."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parity_tests import reference
from parity_tests.strategies import layer_cases, policies
from sebp_jax import RowPolicy
from sebp_jax.policy import active_first_permutation, keep_mask, row_scores

SETTINGS = settings(max_examples=30, deadline=None)


def _keep(dy, policy: RowPolicy) -> np.ndarray:
  return np.asarray(jax.jit(keep_mask, static_argnums=1)(jnp.asarray(dy), policy))


def _keep_mask_matches_reference(case, data, dtype):
  dy = case.dy.reshape(-1, case.dy.shape[-1]).astype(dtype)
  policy = data.draw(policies(case.rows), label="policy")
  expected = reference.keep_mask(dy, policy.threshold, policy.max_rows)
  np.testing.assert_array_equal(_keep(dy, policy), expected, err_msg=f"{policy}, {case.pattern}")


_DTYPES = st.sampled_from([jnp.float32, jnp.bfloat16])
test_keep_mask_matches_reference = SETTINGS(given(
  case=layer_cases(nonfinite=False), data=st.data(), dtype=_DTYPES)(_keep_mask_matches_reference))
test_keep_mask_matches_reference_nonfinite = SETTINGS(given(
  case=layer_cases(nonfinite=True), data=st.data(), dtype=_DTYPES)(_keep_mask_matches_reference))


def test_threshold_is_strict_and_float32():
  dy = np.zeros((6, 3), np.float32)
  # float32(0.1) > 0.1 in float64, but not against the threshold rounded to float32.
  dy[:, 1] = [0.25, -0.5, 0.5000001, 1e-30, 0.75, 0.1]
  for threshold in (0.0, 0.1, 0.25, 0.5, 0.7):
    policy = RowPolicy(threshold=threshold)
    expected = np.abs(dy[:, 1]) > np.float32(threshold)
    np.testing.assert_array_equal(_keep(dy, policy), expected, err_msg=str(policy))
  assert not _keep(dy, RowPolicy(threshold=0.1))[5]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_row_scores_are_float32_max_abs_and_inf_for_nonfinite_rows(dtype):
  dy = jnp.asarray([[1.0, -3.0, 2.0], [0.0, jnp.nan, 1.0], [-jnp.inf, 0.0, 0.0], [0.0, 0.0, 0.0]],
                   dtype)
  scores = np.asarray(row_scores(dy))
  assert scores.dtype == np.float32
  np.testing.assert_array_equal(scores, [3.0, np.inf, np.inf, 0.0])


@pytest.mark.parametrize("threshold", [0.0, 1e3])
# XLA:CPU's max drops NaN in reductions of >= ~4096 elements: the large shapes catch that.
@pytest.mark.parametrize("shape", [(6, 4), (144, 29), (16384, 768)], ids=str)
def test_nonfinite_rows_are_always_kept(threshold, shape):
  dy = np.zeros(shape, np.float32)
  dy[1, 2], dy[3, 0], dy[4, 3] = np.nan, np.inf, -np.inf
  dy[5, -1] = np.nan  # alone at the end of an otherwise zero row
  expected = np.zeros(shape[0], bool)
  expected[[1, 3, 4, 5]] = True
  np.testing.assert_array_equal(_keep(dy, RowPolicy(threshold=threshold)), expected)


# Rows of float32 norm exactly 3 with different entries: the ranking must fall to the row index.
_NORM_3 = [[1, 2, 2, 0], [0, -3, 0, 0], [2, 0, -1, 2], [0, 0, 0, 3], [-2, 2, 1, 0]]


@pytest.mark.parametrize("max_rows", [1, 2, 4])
def test_max_rows_ties_go_to_the_lower_index(max_rows):
  rng = np.random.default_rng(max_rows)
  dy = np.zeros((11, 4), np.float32)
  tied = np.sort(rng.choice(11, size=len(_NORM_3), replace=False))
  dy[tied] = _NORM_3
  # A smaller-norm row before the tied ones, which must lose to all of them.
  smaller = np.setdiff1d(np.arange(11), tied)[0]
  dy[smaller] = [0.0, 2.9, 0.0, 0.0]
  keep = _keep(dy, RowPolicy(max_rows=max_rows))
  np.testing.assert_array_equal(np.flatnonzero(keep), tied[:max_rows])
  np.testing.assert_array_equal(keep, reference.keep_mask(dy, max_rows=max_rows))


@pytest.mark.parametrize("max_rows", [1, 2, 3])
def test_max_rows_ranks_nonfinite_rows_first(max_rows):
  dy = np.zeros((7, 4), np.float32)
  dy[0] = 1e30  # a large finite norm, below every non-finite row
  dy[2] = 2.0
  dy[4, 1] = np.nan
  dy[6, 2] = -np.inf
  keep = _keep(dy, RowPolicy(max_rows=max_rows))
  np.testing.assert_array_equal(np.flatnonzero(keep), sorted([4, 6, 0][:max_rows]))


def test_max_rows_a_finite_norm_that_overflows_float32_still_ranks_below_nan():
  dy = np.zeros((4, 4), np.float32)
  dy[0] = 3e38  # finite entries; sum of squares (and the norm itself) overflow float32
  dy[2, 0] = np.nan
  np.testing.assert_array_equal(np.flatnonzero(_keep(dy, RowPolicy(max_rows=1))), [2])


def test_max_rows_a_row_near_float32_max_has_the_largest_norm():
  dy = np.ones((3, 4), np.float32)
  dy[1] = [2e38, 0.0, 0.0, 0.0]  # norm 2e38, a finite float32
  np.testing.assert_array_equal(np.flatnonzero(_keep(dy, RowPolicy(max_rows=1))), [1])


def test_max_rows_norm_does_not_overflow_or_underflow():
  dy = np.zeros((4, 8), np.float32)
  dy[0, :] = 1e20   # norm 2.8e20: squares overflow float32
  dy[1, 0] = 1e21   # norm 1e21: larger
  dy[2, :] = 1e-30  # norm 2.8e-30: squares underflow
  dy[3, 0] = 1e-30
  np.testing.assert_array_equal(np.flatnonzero(_keep(dy, RowPolicy(max_rows=1))), [1])
  np.testing.assert_array_equal(np.flatnonzero(_keep(dy, RowPolicy(max_rows=3))), [0, 1, 2])


def test_max_rows_at_least_rows_is_the_active_mask():
  dy = np.zeros((5, 2), np.float32)
  dy[[0, 3]] = 1.0
  for max_rows in (2, 5, 9):
    np.testing.assert_array_equal(_keep(dy, RowPolicy(max_rows=max_rows)),
                                  [True, False, False, True, False])


@pytest.mark.parametrize("m", [1, 2, 17, 300])
def test_active_first_permutation_is_a_stable_partition(m):
  keep = np.random.default_rng(m).random(m) < 0.35
  perm, count = jax.jit(active_first_permutation)(jnp.asarray(keep))
  assert perm.dtype == jnp.int32 and count.dtype == jnp.int32 and count.shape == ()
  assert int(count) == keep.sum()
  np.testing.assert_array_equal(perm, np.concatenate([np.flatnonzero(keep), np.flatnonzero(~keep)]))


@pytest.mark.parametrize(
  "kwargs, error, message",
  [
    (dict(threshold=-1), ValueError, r"`threshold` must be finite and >= 0, got -1"),
    (dict(threshold=-1e-9), ValueError, r"`threshold` must be finite and >= 0"),
    (dict(threshold=math.nan), ValueError, r"`threshold` must be finite and >= 0, got nan"),
    (dict(threshold=math.inf), ValueError, r"`threshold` must be finite and >= 0, got inf"),
    (dict(threshold="a"), TypeError, r"`threshold` must be a real number, got 'a' of type str"),
    (dict(threshold=True), TypeError, r"`threshold` must be a real number"),
    (dict(threshold=None), TypeError, r"`threshold` must be a real number"),
    (dict(max_rows=0), ValueError, r"`max_rows` must be >= 1, got 0"),
    (dict(max_rows=-2), ValueError, r"`max_rows` must be >= 1, got -2"),
    (dict(max_rows=1.5), TypeError, r"`max_rows` must be an int or None, got 1.5 of type float"),
    (dict(max_rows=2.0), TypeError, r"`max_rows` must be an int or None"),
    (dict(max_rows=True), TypeError, r"`max_rows` must be an int or None, got True of type bool"),
  ],
)
def test_row_policy_rejects_bad_values(kwargs, error, message):
  with pytest.raises(error, match=message):
    RowPolicy(**kwargs)


def test_row_policy_is_frozen_hashable_and_normalised():
  assert RowPolicy(threshold=0) == RowPolicy() and hash(RowPolicy(threshold=0)) == hash(RowPolicy())
  assert isinstance(RowPolicy(threshold=1).threshold, float)
  assert RowPolicy().is_exact
  assert not RowPolicy(threshold=1e-5).is_exact and not RowPolicy(max_rows=3).is_exact
  with pytest.raises(dataclasses.FrozenInstanceError):
    RowPolicy().threshold = 1.0
