"""``sebp_matmul``: ``x @ kernel (+ bias)`` whose backward runs on the active gradient rows only.

The forward is the plain matmul. The backward is a ``jax.custom_vjp`` that picks the kept rows of
the output gradient (:mod:`sebp_jax.policy`) and hands them to a backend (:mod:`sebp_jax.backends`).
A bias's gradient is the full row sum of ``dy`` under every policy. ``sebp_matmul`` leaves its
bias outside the custom rule, to ordinary autodiff; ``sebp_matmuls`` (siblings of one input) takes
them inside, where the gather its siblings share sums the rows it copies.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from sebp_jax import contraction
from sebp_jax.backends import xla as xla_backend
from sebp_jax.plan import RowPlan, check_plan_covers
from sebp_jax.policy import RowPolicy
from sebp_jax.sharding import RowSharding, current_row_sharding, per_shard_backward

__all__ = ["IMPLS", "sebp_matmul", "sebp_matmuls", "resolve_impl", "SEBPDotGeneral"]

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


def _siblings_backend(impl: str, crossover: float | None):
  """:func:`_backend` for sibling products of one input: ``(x, kernels, dys, *, policy,
  precision, plan, column_sums) -> (dx, dws, dbs)``, ``dx`` summed over the siblings, ``dbs``
  the float32 column sums of ``dys`` (``None`` without ``column_sums``)."""
  if impl == "xla":
    return functools.partial(xla_backend.accumulate_siblings, xla_backend.backward)
  from sebp_jax.backends import pallas as pallas_backend
  return functools.partial(pallas_backend.siblings_backward, interpret=(impl == "interpret"),
                           crossover=crossover)


def _check_operands(x, kernel, bias, transpose_kernel: bool = False) -> None:
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
  if not isinstance(transpose_kernel, bool):
    raise TypeError(f"sebp_matmul: `transpose_kernel` must be a bool, got {transpose_kernel!r}.")
  layout = "(out_features, in_features) with transpose_kernel=True" if transpose_kernel else (
    "(in_features, out_features)")
  if kernel.ndim != 2:
    raise ValueError(f"sebp_matmul: `kernel` must be 2-D {layout}, got shape {kernel.shape}.")
  in_features, out_features = kernel.shape[::-1] if transpose_kernel else kernel.shape
  if x.shape[-1] != in_features:
    raise ValueError(
      f"sebp_matmul: `x` has {x.shape[-1]} input features (shape {x.shape}) but `kernel` "
      f"expects {in_features} (shape {kernel.shape}, {layout}).")
  if bias is not None and bias.shape != (out_features,):
    raise ValueError(
      f"sebp_matmul: `bias` must have shape ({out_features},), got {bias.shape}.")


def _check_rows(rows, policy: RowPolicy) -> None:
  if rows is None:
    return
  if not isinstance(rows, RowPlan):
    raise TypeError(f"sebp_matmul: `rows` must be a RowPlan (sebp_jax.row_plan(mask)) or None, "
                    f"got {type(rows).__name__}.")
  if not policy.is_exact:
    raise ValueError(f"sebp_matmul: a row plan (`rows`) replaces the policy's selection; it "
                     f"needs the exact policy RowPolicy(), got {policy}.")


def _checked_options(caller: str, policy, impl: str, crossover, rows) -> str:
  """Checks the options that :func:`sebp_matmul` and :func:`sebp_matmuls` share; the backend."""
  if not isinstance(policy, RowPolicy):
    raise TypeError(f"{caller}: `policy` must be a RowPolicy, got {type(policy).__name__}.")
  _check_crossover(crossover)
  _check_rows(rows, policy)
  return resolve_impl(impl)


def _forward(x, kernel, precision, out_dtype=None):
  """``x @ kernel``, the product rounded once to ``out_dtype`` (``None``: the operands' dtype)."""
  return lax.dot_general(x, kernel, _matmul_dims(x.ndim), precision=precision,
                         preferred_element_type=out_dtype)


# `kernel` is always the (K, N) operand of the product. `kernel_nk`: it is the transpose of a
# weight stored (N, K), which the backend is handed as stored (see _sebp_product_bwd).
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5, 6, 7))
def _sebp_product(policy: RowPolicy, impl: str, crossover, precision, name,
                  sharding: RowSharding | None, out_dtype, kernel_nk: bool, x, kernel, plan):
  return _forward(x, kernel, precision, out_dtype)


def _sebp_product_fwd(policy, impl, crossover, precision, name, sharding, out_dtype, kernel_nk,
                      x, kernel, plan):
  # With symbolic zeros, `perturbed` says which inputs are differentiated: save only what the
  # needed products use, so a frozen kernel costs no dW and an input without gradient no dX.
  y = _forward(x.value, kernel.value, precision, out_dtype)
  saved_x = x.value if kernel.perturbed else None
  saved_kernel = kernel.value if x.perturbed else None
  plan = None if plan is None else jax.tree.map(lambda leaf: leaf.value, plan)
  return y, (saved_x, saved_kernel, plan)


def _sebp_product_bwd(policy, impl, crossover, precision, name, sharding, out_dtype, kernel_nk,
                      residuals, dy):
  saved_x, saved_kernel, plan = residuals
  if isinstance(dy, SymbolicZero):
    return None, None, None
  # The backends take one dtype: a `preferred_element_type` output's gradient is rounded to the
  # operands' (the dense backward would multiply it in the output's); products still accumulate
  # in float32.
  dy = dy.astype((saved_x if saved_x is not None else saved_kernel).dtype)

  def backend(x2d, kernel, dy2d, plan):
    if plan is not None and plan.check:
      check_plan_covers(plan, dy2d, name or f"with output gradient {dy.shape}")
    run = functools.partial(_backend(impl, crossover), policy=policy, precision=precision,
                            plan=plan)
    if not kernel_nk:
      return run(x2d, kernel, dy2d)
    # The backend reads the weight as stored and writes dW in that layout; XLA cancels these
    # two transposes against sebp_matmul's `kernel.T` and its gradient's, so neither the weight
    # nor dW is transposed in memory (a transposed dW of a tied LM head, fused into the
    # optimizer update, was the costliest kernel of a LLaMA step: benchmarks/NOTES.md, "v12").
    dx, dw = run(x2d, None if kernel is None else kernel.T, dy2d, kernel_nk=True)
    return dx, None if dw is None else dw.T

  # Each device runs the backend on its own rows, and plans them (sebp_jax.sharding).
  dx, dw = per_shard_backward(backend, saved_x, saved_kernel, dy, sharding, plan=plan)
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
  preferred_element_type: Any = None,
  transpose_kernel: bool = False,
) -> jax.Array:
  """``x @ kernel + bias`` with the SEBP backward.

  The forward is the plain matmul. In the backward, rows of the output gradient that ``policy``
  drops contribute nothing: ``dx`` and ``dkernel`` equal the dense backward of
  ``dy * keep[:, None]``, computed on the kept rows only; ``dbias`` is the full row sum of ``dy``.

  Args:
    x: ``(..., K)`` input, rank >= 2 (all leading dims are rows).
    kernel: ``(K, N)`` weight, Flax layout; ``(N, K)`` with ``transpose_kernel``.
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
    preferred_element_type: the output's dtype, as in ``lax.dot_general`` (e.g. float32 from
      bfloat16 operands: the product is not rounded to bfloat16); ``None``: the operands'
      promoted dtype. The backward still runs in the operands' dtype, with float32
      accumulation.
    transpose_kernel: ``kernel`` is stored ``(N, K)`` and the product is ``x @ kernel.T`` (a
      tied output embedding, a PyTorch-layout weight). The backward reads it in that layout
      and returns its gradient in it: neither is transposed in memory.

  Returns:
    ``(..., N)`` output in ``preferred_element_type`` or else the promoted dtype of ``x``,
    ``kernel`` (and ``bias``); each gradient comes back in the dtype of its primal.

  >>> import jax, jax.numpy as jnp
  >>> x = jnp.ones((2, 5, 3)).at[:, 3:].set(0.0)   # two sequences, padded to 5 tokens
  >>> w = jnp.ones((3, 4))
  >>> loss = lambda x, w: jnp.sum(sebp_matmul(x, w, impl="xla") ** 2)
  >>> jax.tree.map(jnp.shape, jax.grad(loss, argnums=(0, 1))(x, w))
  ((2, 5, 3), (3, 4))
  """
  _check_operands(x, kernel, bias, transpose_kernel)
  impl = _checked_options("sebp_matmul", policy, impl, crossover, rows)
  # Promote outside the custom rule: autodiff of the casts returns each gradient in its
  # primal's dtype, and the rule itself sees one dtype.
  dtype = jnp.result_type(x, kernel)
  # `None` where the output keeps the operands' dtype: the plain product, one static argument.
  out_dtype = (None if preferred_element_type is None
               or jnp.dtype(preferred_element_type) == dtype else jnp.dtype(preferred_element_type))
  x, kernel = x.astype(dtype), kernel.astype(dtype)
  if transpose_kernel:
    kernel = kernel.T  # a view for XLA: the product and the backward read the stored layout
  if impl == "dense":
    y = _forward(x, kernel, precision, out_dtype)
  else:
    plan = rows if rows is not None and rows.applies_to(x) else None
    # The sebp_jax.sharded_rows in effect now, when the forward is traced.
    y = _sebp_product(policy, impl, crossover, precision, name, current_row_sharding(),
                      out_dtype, transpose_kernel, x, kernel, plan)
  # Outside the custom rule: autodiff of the add is the bias gradient, dy's full row sum.
  return _plus_bias(y, bias)


def _plus_bias(y, bias):
  """``y + bias``, added in (at least) float32 and rounded once to ``y``'s dtype: the same value
  as a low-precision add, and its bias gradient a float32 row sum."""
  if bias is None:
    return y
  wide = jnp.promote_types(y.dtype, jnp.float32)
  return (y.astype(wide) + bias.astype(wide)).astype(y.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5))
def _sebp_siblings(policy: RowPolicy, impl: str, crossover, precision, name,
                   sharding: RowSharding | None, x, kernels, biases, plan):
  return tuple(_plus_bias(_forward(x, kernel, precision), bias)
               for kernel, bias in zip(kernels, biases))


def _sebp_siblings_fwd(policy, impl, crossover, precision, name, sharding, x, kernels, biases,
                       plan):
  values = [None if bias is None else bias.value for bias in biases]
  ys = tuple(_plus_bias(_forward(x.value, kernel.value, precision), bias)
             for kernel, bias in zip(kernels, values))
  plan = None if plan is None else jax.tree.map(lambda leaf: leaf.value, plan)
  # As _sebp_product_fwd: save only what the needed products use (`perturbed`, with symbolic
  # zeros), so a frozen kernel costs no dW and an input without gradient no dX. Which kernels
  # are differentiated is static: told apart by the residuals' structure (() or None).
  wanted = tuple(() if kernel.perturbed else None for kernel in kernels)
  saved_x = x.value if any(kernel.perturbed for kernel in kernels) else None
  saved_kernels = tuple(kernel.value for kernel in kernels) if x.perturbed else None
  # The biases (a few hundred numbers each) for their dtypes: their gradients are sums of `dy`.
  return ys, (saved_x, saved_kernels, wanted, tuple(values), plan)


def _sebp_siblings_bwd(policy, impl, crossover, precision, name, sharding, residuals, dys):
  x, kernels, wanted, biases, plan = residuals
  with_dw = [mark is not None for mark in wanted]
  bias_dtypes = [None if bias is None else bias.dtype for bias in biases]
  used = [index for index, dy in enumerate(dys) if not isinstance(dy, SymbolicZero)]
  dws = [None] * len(dys)
  dbs = [None if dtype is None else jnp.zeros(bias.shape, dtype)
         for bias, dtype in zip(biases, bias_dtypes)]
  if not used:
    return None, tuple(dws), tuple(dbs), None
  # The bias gradients, where any used sibling has a bias: the column sums of every used `dy`,
  # which a shared gather takes from the rows it copies anyway.
  column_sums = any(bias_dtypes[index] is not None for index in used)
  # The siblings share one backward, each device on its own rows (sebp_jax.sharding): each
  # later one adds its kept rows into the first one's dx in place, and where one set of kept
  # rows is exact for all (a row plan's, or the union under the exact policy) one gather
  # serves them all.
  group = _siblings_backend(impl, crossover)
  used_with_dw = [with_dw[index] for index in used]
  if kernels is None and not any(used_with_dw):  # no product asked for: the bias sums alone
    if column_sums:
      for index, db in zip(used, xla_backend.full_column_sums([dys[i] for i in used])):
        if bias_dtypes[index] is not None:
          dbs[index] = db.astype(bias_dtypes[index])
    return None, tuple(dws), tuple(dbs), None
  dtype = (x if x is not None else kernels[0]).dtype

  def backward(x2d, group_kernels, group_dys, plan):
    if plan is not None and plan.check:  # on this device's rows: no collective
      for index, dy2d in zip(used, group_dys):  # a group of one: its layer's own name
        check_plan_covers(plan, dy2d, name if name and len(dys) == 1
                          else f"{name or 'sebp_matmuls'}[{index}]")
    dx2d, group_dws, group_dbs = group(x2d, list(group_kernels), list(group_dys), policy=policy,
                                       precision=precision, plan=plan, column_sums=column_sums,
                                       with_dw=used_with_dw)
    return dx2d, (tuple(group_dws), tuple(group_dbs or ()))
  dx, (used_dws, used_dbs) = per_shard_backward(
    backward, x if any(used_with_dw) else None,
    tuple(None if kernels is None else kernels[index] for index in used),
    tuple(dys[index].astype(dtype) for index in used), sharding, plan=plan)
  for index, dw in zip(used, used_dws):
    dws[index] = dw
  for index, db in zip(used, used_dbs):
    if bias_dtypes[index] is not None:
      dbs[index] = db.astype(bias_dtypes[index])
  return dx, tuple(dws), tuple(dbs), None


_sebp_siblings.defvjp(_sebp_siblings_fwd, _sebp_siblings_bwd, symbolic_zeros=True)


def sebp_matmuls(
  x: jax.Array,
  kernels,
  biases=None,
  *,
  policy: RowPolicy = RowPolicy(),
  impl: str = "auto",
  precision: Any = None,
  crossover: float | None = None,
  rows: RowPlan | None = None,
  name: str | None = None,
) -> tuple[jax.Array, ...]:
  """``tuple(x @ kernel + bias for kernel, bias in zip(kernels, biases))``: sibling projections
  of one input (q, k and v; gate and up) under one SEBP backward.

  Each product's backward is :func:`sebp_matmul`'s, on its own kept rows, but their ``dx`` are
  summed as they are made: each later sibling's dX kernel adds its kept rows into the first
  one's ``dx`` in place (``impl="pallas"``), instead of writing a whole ``(rows, K)`` ``dx`` of
  its own, zeros included, for XLA to read back and add; where one set of kept rows is exact
  for every sibling (a row plan's, or their union under the exact policy), one partition and
  one gather serve them all. Where the rows are sharded (:func:`sebp_jax.sharded_rows`, a mesh
  in context) each device runs that shared backward on its own rows, as :func:`sebp_matmul`'s
  does; the operands of every sibling must then be sharded alike.

  The biases are inside the rule, unlike :func:`sebp_matmul`'s: their gradients are still the
  full row sums of each ``dy`` (in float32) under every policy, but where the group shares one
  gather that gather sums the kept rows it copies, whose dropped rows are zero, instead of XLA
  reading each ``dy`` again (BERT's q/k/v: 36 reductions a step that run alone, since ``dy``
  comes out of the attention's backward).

  Args:
    x: ``(..., K)`` input, rank >= 2.
    kernels: a sequence of ``(K, N_i)`` weights (Flax layout).
    biases: ``None``, or one ``(N_i,)`` bias or ``None`` per kernel; each is added in (at least)
      float32 and the sum rounded once to the output's dtype, as :func:`sebp_matmul` adds it.
    policy, impl, precision, crossover, rows, name: as in :func:`sebp_matmul`.

  Returns:
    One ``(..., N_i)`` output per kernel, in the promoted dtype of ``x`` and the kernels.

  >>> import jax, jax.numpy as jnp
  >>> x = jnp.ones((2, 5, 3)).at[:, 3:].set(0.0)
  >>> q, k = sebp_matmuls(x, (jnp.ones((3, 4)), jnp.ones((3, 2))), impl="xla")
  >>> q.shape, k.shape
  ((2, 5, 4), (2, 5, 2))
  >>> loss = lambda x, ws, bs: sum(jnp.sum(y) for y in sebp_matmuls(x, ws, bs, impl="xla"))
  >>> _, _, (db_q, db_k) = jax.grad(loss, argnums=(0, 1, 2))(
  ...   x, (jnp.ones((3, 4)), jnp.ones((3, 2))), (jnp.zeros(4), None))
  >>> db_q.shape, db_k
  ((4,), None)
  """
  kernels = tuple(kernels)
  if not kernels:
    raise ValueError("sebp_matmuls: `kernels` must hold at least one weight.")
  biases = (None,) * len(kernels) if biases is None else tuple(biases)
  if len(biases) != len(kernels):
    raise ValueError(f"sebp_matmuls: `biases` must hold one bias (or None) per kernel: "
                     f"{len(kernels)} kernels, {len(biases)} biases.")
  for kernel, bias in zip(kernels, biases):
    _check_operands(x, kernel, bias)
  impl = _checked_options("sebp_matmuls", policy, impl, crossover, rows)
  dtype = jnp.result_type(x, *kernels)
  x, kernels = x.astype(dtype), tuple(kernel.astype(dtype) for kernel in kernels)
  if impl == "dense":
    return tuple(_plus_bias(_forward(x, kernel, precision), bias)
                 for kernel, bias in zip(kernels, biases))
  plan = rows if rows is not None and rows.applies_to(x) else None
  return _sebp_siblings(policy, impl, crossover, precision, name, current_row_sharding(), x,
                        kernels, biases, plan)


@dataclasses.dataclass(frozen=True)
class SEBPDotGeneral:
  """A ``lax.dot_general`` replacement that gives every weight contraction the SEBP backward.

  Flax's ``nn.Dense`` / ``nn.DenseGeneral``, ``nnx.Linear`` / ``nnx.LinearGeneral`` take a
  ``dot_general``, and ``jnp.einsum`` a ``_dot_general``; this is the one that makes them SEBP
  layers. ``dot_general(x, w, dims)`` with no batch dimensions, in any dimension order, runs as
  :func:`sebp_matmul` of ``x`` viewed as ``(rows, K)`` and ``w`` as ``(K, N)``
  (:func:`sebp_jax.contraction.matmul_view`): the rows are ``x``'s free dimensions, so ``x`` is the
  activation and ``w`` the weight. ``preferred_element_type`` sets the result's dtype and
  ``out_sharding`` is applied to the result (``jax.sharding.reshard``).

  On purpose, contractions with batch dimensions (attention scores, batched matmuls) and
  non-floating operands go to ``lax.dot_general`` unchanged: their rows are not a layer's
  tokens.

  >>> import jax.numpy as jnp
  >>> x, w = jnp.ones((2, 7, 4, 8)), jnp.ones((4, 8, 16))
  >>> jnp.einsum("BTNH,NHD->BTD", x, w, _dot_general=SEBPDotGeneral(impl="xla")).shape
  (2, 7, 16)
  """

  policy: RowPolicy = RowPolicy()
  impl: str = "auto"
  crossover: float | None = None
  rows: RowPlan | None = None
  name: str | None = None

  def __post_init__(self):
    # Reject an unknown impl or a bad crossover when the layer is built, not when it first runs.
    _checked_options("SEBPDotGeneral", self.policy, self.impl, self.crossover, self.rows)

  def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
               *, out_sharding=None):
    view = contraction.matmul_view(jnp.shape(lhs), jnp.shape(rhs), dimension_numbers)
    floating = all(jnp.issubdtype(jnp.result_type(a), jnp.floating) for a in (lhs, rhs))
    if view is None or not floating:
      return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                             preferred_element_type=preferred_element_type,
                             out_sharding=out_sharding)
    x, w = view.operands(lhs, rhs)
    y = view.result(sebp_matmul(x, w, policy=self.policy, impl=self.impl, precision=precision,
                                crossover=self.crossover, rows=self.rows, name=self.name,
                                preferred_element_type=preferred_element_type,
                                transpose_kernel=view.rhs_nk))
    if out_sharding is not None:
      y = jax.sharding.reshard(y, out_sharding)
    return y
