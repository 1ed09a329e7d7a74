"""``sebp_matmul``: ``x @ kernel (+ bias)`` whose backward runs on the active gradient rows only.

The forward is the plain matmul. The backward is a ``jax.custom_vjp`` that picks the kept rows of
the output gradient (:mod:`sebp_jax.policy`) and hands them to a backend (:mod:`sebp_jax.backends`).
The bias stays outside the custom rule: its gradient is the full row sum of ``dy`` under every
policy, which ordinary autodiff already gives.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from sebp_jax.backends import xla as xla_backend
from sebp_jax.plan import RowPlan, check_plan_covers
from sebp_jax.policy import RowPolicy

__all__ = ["IMPLS", "sebp_matmul", "resolve_impl", "SEBPDotGeneral"]

IMPLS = ("auto", "pallas", "xla", "interpret", "dense")

# lax.dot_general dimension numbers of `x @ kernel` for x of rank `ndim` and a 2-D kernel.
def _matmul_dims(ndim: int):
  return (((ndim - 1,), (0,)), ((), ()))


def resolve_impl(impl: str) -> str:
  """The concrete backend for ``impl``: ``"auto"`` is Pallas on GPU and XLA elsewhere."""
  if impl not in IMPLS:
    raise ValueError(f"`impl` must be one of {IMPLS}, got {impl!r}.")
  if impl == "auto":
    return "pallas" if jax.default_backend() == "gpu" else "xla"
  return impl


def _check_crossover(crossover: float | None) -> None:
  """Raises ``ValueError`` unless ``crossover`` is ``None`` or a fraction above 0."""
  if crossover is not None and (isinstance(crossover, bool)
                                or not isinstance(crossover, (int, float)) or not crossover > 0):
    raise ValueError(
      f"`crossover` must be None (the backend's measured default) or a kept-row fraction "
      f"> 0 (>= 1: never run the dense backward), got {crossover!r}.")


def _backend(impl: str, crossover: float | None):
  if impl == "xla":
    # Its capacity switch is its own crossover (the dense branch past M/2): `crossover` is a
    # Pallas setting.
    return xla_backend.backward
  # Imported lazily: Pallas (and its Triton lowering) is only needed where it runs.
  from sebp_jax.backends import pallas as pallas_backend
  return functools.partial(pallas_backend.backward, interpret=(impl == "interpret"),
                           crossover=crossover)


def _check_operands(x, kernel, bias) -> None:
  for name, value in (("x", x), ("kernel", kernel), ("bias", bias)):
    if value is None:
      continue
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
      raise TypeError(f"sebp_matmul: `{name}` must be an array, got {type(value).__name__}.")
    if not jnp.issubdtype(value.dtype, jnp.floating):
      raise TypeError(
        f"sebp_matmul: `{name}` must have a floating dtype, got {value.dtype}.")
  if x.ndim < 2:
    raise ValueError(
      f"sebp_matmul: `x` must have rank >= 2, (..., in_features), got shape {x.shape}.")
  if kernel.ndim != 2:
    raise ValueError(
      f"sebp_matmul: `kernel` must be 2-D (in_features, out_features), got shape {kernel.shape}.")
  if x.shape[-1] != kernel.shape[0]:
    raise ValueError(
      f"sebp_matmul: `x` has {x.shape[-1]} input features (shape {x.shape}) but `kernel` "
      f"expects {kernel.shape[0]} (shape {kernel.shape}).")
  if bias is not None and bias.shape != (kernel.shape[1],):
    raise ValueError(
      f"sebp_matmul: `bias` must have shape ({kernel.shape[1]},), got {bias.shape}.")


def _check_rows(rows, policy: RowPolicy) -> None:
  if rows is None:
    return
  if not isinstance(rows, RowPlan):
    raise TypeError(f"sebp_matmul: `rows` must be a RowPlan (sebp_jax.row_plan(mask)) or None, "
                    f"got {type(rows).__name__}.")
  if not policy.is_exact:
    raise ValueError(f"sebp_matmul: a row plan (`rows`) replaces the policy's selection; it "
                     f"needs the exact policy RowPolicy(), got {policy}.")


def _forward(x, kernel, precision):
  return lax.dot_general(x, kernel, _matmul_dims(x.ndim), precision=precision)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _sebp_product(policy: RowPolicy, impl: str, crossover, precision, name, x, kernel, plan):
  return _forward(x, kernel, precision)


def _sebp_product_fwd(policy, impl, crossover, precision, name, x, kernel, plan):
  # With symbolic zeros, `perturbed` says which inputs are differentiated: save only what the
  # needed products use, so a frozen kernel costs no dW and an input without gradient no dX.
  y = _forward(x.value, kernel.value, precision)
  saved_x = x.value if kernel.perturbed else None
  saved_kernel = kernel.value if x.perturbed else None
  plan = None if plan is None else jax.tree.map(lambda leaf: leaf.value, plan)
  return y, (saved_x, saved_kernel, plan)


def _sebp_product_bwd(policy, impl, crossover, precision, name, residuals, dy):
  saved_x, saved_kernel, plan = residuals
  if isinstance(dy, SymbolicZero):
    return None, None, None
  x2d = None if saved_x is None else saved_x.reshape(-1, saved_x.shape[-1])
  dy2d = dy.reshape(-1, dy.shape[-1])
  if plan is not None and plan.check:
    check_plan_covers(plan, dy2d, name or f"with output gradient {dy.shape}")
  dx2d, dw = _backend(impl, crossover)(x2d, saved_kernel, dy2d, policy=policy,
                                       precision=precision, plan=plan)
  dx = None if dx2d is None else dx2d.reshape(*dy.shape[:-1], dx2d.shape[-1])
  return dx, dw, None


_sebp_product.defvjp(_sebp_product_fwd, _sebp_product_bwd, symbolic_zeros=True)


def sebp_matmul(
  x: jax.Array,
  kernel: jax.Array,
  bias: jax.Array | None = None,
  *,
  policy: RowPolicy = RowPolicy(),
  impl: str = "auto",
  precision: Any = None,
  crossover: float | None = None,
  rows: RowPlan | None = None,
  name: str | None = None,
) -> jax.Array:
  """``x @ kernel + bias`` with the SEBP backward.

  The forward is the plain matmul. In the backward, rows of the output gradient that ``policy``
  drops contribute nothing: ``dx`` and ``dkernel`` equal the dense backward of
  ``dy * keep[:, None]``, computed on the kept rows only; ``dbias`` is the full row sum of ``dy``.

  Args:
    x: ``(..., K)`` input, rank >= 2 (all leading dims are rows).
    kernel: ``(K, N)`` weight, Flax layout.
    bias: optional ``(N,)``.
    policy: which gradient rows to keep (:class:`RowPolicy`); the default is exact.
    impl: ``"auto"`` (Pallas on GPU, XLA elsewhere), ``"pallas"``, ``"xla"``, ``"interpret"``
      (the Pallas kernels through the Pallas interpreter) or ``"dense"`` (the plain backward).
    precision: ``lax.Precision`` for the forward and backward matmuls.
    crossover: the kept-row fraction above which the Pallas backward runs the dense products
      instead, through a ``lax.cond``. ``None``: the measured value of the block table (0.4 on
      Hopper). ``>= 1``: never, and no conditional is compiled at all: XLA:GPU waits on the host
      for each conditional's predicate (~30 µs per layer on an H200, 2.2–2.9 ms of a 22–24 ms
      BERT-base step), so training on short sequences that never cross is faster without it
      (:func:`sebp_jax.sebp_value_and_grad` decides once per step instead). The ``xla`` backend
      has its own capacity switch and ignores it.
    rows: a :class:`sebp_jax.RowPlan` (:func:`sebp_jax.row_plan`): the kept rows decided once
      per step from the batch's mask, so the backward skips its score read and partition; the
      result is the dense backward of ``dy * plan[:, None]``. Exact policy only. Ignored (``dy``
      scored as usual) when ``x``'s leading dims are not the plan's.
    name: the layer's name in the errors of a checking plan (``row_plan(..., check=True)``).

  Returns:
    ``(..., N)`` output in the promoted dtype of ``x``, ``kernel`` (and ``bias``); each gradient
    comes back in the dtype of its primal.

  >>> import jax, jax.numpy as jnp
  >>> x = jnp.ones((2, 5, 3)).at[:, 3:].set(0.0)   # two sequences, padded to 5 tokens
  >>> w = jnp.ones((3, 4))
  >>> loss = lambda x, w: jnp.sum(sebp_matmul(x, w, impl="xla") ** 2)
  >>> jax.tree.map(jnp.shape, jax.grad(loss, argnums=(0, 1))(x, w))
  ((2, 5, 3), (3, 4))
  """
  _check_operands(x, kernel, bias)
  if not isinstance(policy, RowPolicy):
    raise TypeError(f"sebp_matmul: `policy` must be a RowPolicy, got {type(policy).__name__}.")
  _check_crossover(crossover)
  _check_rows(rows, policy)
  impl = resolve_impl(impl)
  # Promote outside the custom rule: autodiff of the casts returns each gradient in its
  # primal's dtype, and the rule itself sees one dtype.
  dtype = jnp.result_type(x, kernel)
  x, kernel = x.astype(dtype), kernel.astype(dtype)
  if impl == "dense":
    y = _forward(x, kernel, precision)
  else:
    plan = rows if rows is not None and rows.applies_to(x) else None
    y = _sebp_product(policy, impl, crossover, precision, name, x, kernel, plan)
  if bias is not None:
    # Added in (at least) float32 and rounded once: the same value as a low-precision add, and
    # autodiff of it sums the bias gradient over the rows in float32, as the contract asks.
    wide = jnp.promote_types(dtype, jnp.float32)
    y = (y.astype(wide) + bias.astype(wide)).astype(dtype)
  return y


@dataclasses.dataclass(frozen=True)
class SEBPDotGeneral:
  """A ``lax.dot_general`` replacement that gives ``x @ kernel`` the SEBP backward.

  Flax's ``nn.Dense`` and ``nnx.Linear`` take a ``dot_general``; this is the one that makes them
  SEBP layers. Contractions other than ``(..., K) x (K, N)`` (and calls asking for a
  ``preferred_element_type`` or ``out_sharding``) go to ``lax.dot_general`` unchanged.
  """

  policy: RowPolicy = RowPolicy()
  impl: str = "auto"
  crossover: float | None = None
  rows: RowPlan | None = None
  name: str | None = None

  def __post_init__(self):
    if not isinstance(self.policy, RowPolicy):
      raise TypeError(f"`policy` must be a RowPolicy, got {type(self.policy).__name__}.")
    # Reject an unknown impl or a bad crossover when the layer is built, not when it first runs.
    resolve_impl(self.impl)
    _check_crossover(self.crossover)
    _check_rows(self.rows, self.policy)

  def __call__(self, lhs, rhs, dimension_numbers, precision=None,
               preferred_element_type=None, **kwargs):
    is_matmul = (
      getattr(rhs, "ndim", 0) == 2
      and getattr(lhs, "ndim", 0) >= 2
      and _same_dims(dimension_numbers, _matmul_dims(lhs.ndim))
    )
    plain = preferred_element_type is None and all(v is None for v in kwargs.values())
    if not (is_matmul and plain):
      return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                             preferred_element_type=preferred_element_type, **kwargs)
    return sebp_matmul(lhs, rhs, policy=self.policy, impl=self.impl, precision=precision,
                       crossover=self.crossover, rows=self.rows, name=self.name)


def _same_dims(dims, expected) -> bool:
  (lc, rc), (lb, rb) = dims
  (elc, erc), (elb, erb) = expected
  return (tuple(lc), tuple(rc), tuple(lb), tuple(rb)) == (elc, erc, elb, erb)
