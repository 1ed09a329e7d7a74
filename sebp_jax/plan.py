"""Row plans: the kept rows of every layer, handed in once per step instead of found per layer.

In a padded batch every linear layer's output gradient is non-zero on the same rows: the real
tokens. A :class:`RowPlan` made once per step from the batch's mask (the attention or loss mask)
lets each layer skip its score read of ``dy`` and its partition: the backends take the plan's
``keep``, ``perm`` and ``count`` as they are. The layer then computes the dense backward of
``dy * plan[:, None]``, which is exact whenever every row outside the plan is zero in ``dy``
(padding that attention and the loss ignore); a superset of the non-zero rows is still exact. A
plan that misses a non-zero row changes the gradient: ``check=True`` reads ``dy`` in every layer
and raises an error naming the layer when a row outside the plan is non-zero or non-finite.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from sebp_jax.policy import RowPolicy, active_first_permutation, keep_mask

__all__ = ["RowPlan", "row_plan", "check_plan_covers"]

# `perm` is padded to a whole number of these rows, so that every backend's row blocks (at most
# this many rows) find their padding rows in it.
PLAN_ROW_ALIGN = 1024


@dataclasses.dataclass(frozen=True)
class RowPlan:
  """The rows of a step's layers that the SEBP backward keeps, decided once (see :func:`row_plan`).

  Attributes:
    keep: ``(M,)`` bool over the flattened rows ``M = prod(rows_shape)``.
    perm: ``(M',)`` int32, ``M' >= M`` a multiple of :data:`PLAN_ROW_ALIGN`: the kept rows, then
      the dropped ones, then the padding rows ``M .. M'-1``, each in increasing order.
    count: ``(1,)`` int32, the number of kept rows.
    rows_shape: the leading dims of the layers the plan applies to (static).
    check: verify in every layer that no row outside the plan is non-zero (static).
  """

  keep: jax.Array
  perm: jax.Array
  count: jax.Array
  rows_shape: tuple[int, ...]
  check: bool = False

  def applies_to(self, x: jax.Array) -> bool:
    """Whether this plan describes the rows of a layer input ``x`` of shape ``(..., K)``."""
    return tuple(x.shape[:-1]) == self.rows_shape

jax.tree_util.register_dataclass(RowPlan, data_fields=["keep", "perm", "count"],
                                 meta_fields=["rows_shape", "check"])


def row_plan(mask: jax.Array, *, check: bool = False) -> RowPlan:
  """A :class:`RowPlan` from a mask over the layers' leading dims.

  Args:
    mask: bool or numeric array, e.g. the ``(batch, seq_len)`` attention mask; a row is kept
      where the mask is non-zero. Layers whose input's leading dims are not ``mask.shape`` (a
      pooler on ``(batch, hidden)``, say) ignore the plan and score ``dy`` as usual.
    check: read ``dy`` in every planned layer and raise an error naming the layer if a row
      outside the plan is non-zero or non-finite (costs the score read the plan saves; for
      tests and first runs).

  >>> import jax.numpy as jnp
  >>> plan = row_plan(jnp.array([[1, 1, 0], [1, 0, 0]]))
  >>> plan.rows_shape, int(plan.count[0]), plan.perm[:3].tolist()
  ((2, 3), 3, [0, 1, 3])
  """
  if not hasattr(mask, "shape") or not hasattr(mask, "dtype"):
    raise TypeError(f"row_plan: `mask` must be an array, got {type(mask).__name__}.")
  mask = jnp.asarray(mask)
  if mask.ndim < 1:
    raise ValueError(f"row_plan: `mask` must have the layers' leading dims (rank >= 1), got "
                     f"shape {mask.shape}.")
  if not (mask.dtype == jnp.bool_ or jnp.issubdtype(mask.dtype, jnp.number)):
    raise TypeError(f"row_plan: `mask` must be bool or numeric, got {mask.dtype}.")
  if not isinstance(check, bool):
    raise TypeError(f"row_plan: `check` must be a bool, got {check!r}.")
  keep = (mask != 0).reshape(-1)
  num_rows = keep.shape[0]
  padded = -(-num_rows // PLAN_ROW_ALIGN) * PLAN_ROW_ALIGN
  perm, count = active_first_permutation(jnp.pad(keep, (0, padded - num_rows)))
  return RowPlan(keep, perm, count.reshape(1), tuple(mask.shape), check)


def _raise_outside_plan(outside, layer: str) -> None:
  if int(outside):
    raise ValueError(
      f"SEBP row plan: layer {layer} has {int(outside)} output-gradient row(s) outside the plan "
      f"that are non-zero or non-finite; its gradient would drop them. Plan a superset of the "
      f"rows the loss and attention use, or leave this layer unplanned (`where=`).")


def check_plan_covers(plan: RowPlan, dy: jax.Array, layer: str) -> None:
  """At run time, raise ``ValueError`` naming ``layer`` if a row of ``dy (M, N)`` outside the plan
  is non-zero or non-finite (the error reaches the caller as a runtime error of the program)."""
  outside = jnp.sum(keep_mask(dy, RowPolicy()) & ~plan.keep, dtype=jnp.int32)
  jax.debug.callback(_raise_outside_plan, outside, layer)
