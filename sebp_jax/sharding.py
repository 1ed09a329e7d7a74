"""SEBP under JAX's SPMD engine: every device runs the backward of its own rows.

A Pallas kernel is an opaque custom call to XLA's SPMD partitioner, and the XLA backend's
selection (a ``cumsum`` over all rows) becomes serial loops when partitioned: left to ``jit``,
both would see every row of a row-sharded operand, XLA all-gathering them to each device. So the
SEBP backward runs inside a ``jax.shard_map`` over the mesh axes that shard the rows: the
selection, both products and ``dX`` stay on each device's own rows. ``dW``'s per-device partial
sums are reduced as the dense backward reduces its own: under automatic sharding they leave the
shard_map stacked and XLA's partitioner reduces them as dense's ``Xᵀ dY`` (:func:`_sum_partials`:
an all-reduce for replicated weights, a reduce-scatter for FSDP ones); under explicit sharding and
inside a user's ``shard_map`` with a ``psum``, the reduction that JAX's transpose of the dense
product's kernel broadcast gives. SEBP adds no collective that dense does not have.

Where the rows' sharding comes from:

* **explicit sharding** (``AxisType.Explicit``): the operands' types (``jax.typeof(dy).sharding``)
  say it; nothing to pass. A mesh axis may also shard the contraction dim ``K`` of ``x`` and the
  kernel (a row-parallel layer): each device then owns a slab of ``dX``'s columns and ``dW``'s
  rows, no collective needed.
* **inside ``jax.shard_map``**: the operands are already each device's own; ``dW`` is summed over
  the manual axes its rows vary over and the kernel does not (with ``check_vma=True``; with
  ``check_vma=False`` nothing is summed, as in the dense backward).
* **automatic sharding** (``jit`` with ``NamedSharding``, ``AxisType.Auto``): types carry no
  sharding, so :func:`sharded_rows` says which mesh axes shard the batch (first) dim. With a
  multi-device auto mesh set by ``jax.set_mesh`` and no :func:`sharded_rows`, the backward raises
  an error rather than run replicated; without any mesh in context (``jit`` given shardings only),
  nothing at trace time can tell, and the backward runs as on one device (XLA replicating it).

A row plan (:class:`sebp_jax.RowPlan`) made from the whole batch's mask enters the shard_map as
that mask, sharded like the rows, and each device orders its own rows from its part.

A layer whose output features are sharded (a column-parallel, tensor-parallel layer: ``dY`` split
along ``N``) cannot be followed: the row selection needs whole rows, and computing it across
devices would add a collective. That is an error naming the layer's sharding.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, PartitionSpec as P

from sebp_jax.plan import RowPlan, row_plan

__all__ = ["RowSharding", "sharded_rows", "current_row_sharding", "per_shard_backward",
           "fsdp_spec"]

Mesh = jax.sharding.Mesh | jax.sharding.AbstractMesh


@dataclasses.dataclass(frozen=True)
class RowSharding:
  """Mesh axes that shard the first (batch) dim of a layer's rows, under automatic sharding.

  Attributes:
    axes: mesh axis names, major to minor, as in a ``PartitionSpec`` entry; ``()``: the rows
      are replicated (no shard_map at all).
    mesh: the mesh; ``None``: the one set by ``jax.set_mesh`` when the backward is traced.
  """

  axes: tuple[str, ...]
  mesh: Mesh | None = None


_CURRENT: contextvars.ContextVar[RowSharding | None] = contextvars.ContextVar(
  "sebp_row_sharding", default=None)


@contextlib.contextmanager
def sharded_rows(axes: str | tuple[str, ...], *, mesh: Mesh | None = None) -> Iterator[None]:
  """Every SEBP layer traced inside the block has its rows sharded over the mesh ``axes``.

  Only needed under automatic sharding (``jit`` with ``NamedSharding`` inputs): explicit-sharding
  meshes and ``jax.shard_map`` say where the rows are by themselves. Like
  :func:`sebp_jax.swap_dense`, it acts on what is *traced* inside the block: enter it inside the
  function you ``jit`` (or around the first call, which traces).

  Args:
    axes: the mesh axis (or axes, major to minor) that shard the batch dim, the first dim of every
      layer's input: ``"data"`` for data parallel and FSDP alike, ``("data", "fsdp")`` for a 2-D
      mesh whose batch is split over both. ``()``: the rows are not sharded.
    mesh: the mesh those axes belong to; by default the one set by ``jax.set_mesh``.

  >>> import jax, jax.numpy as jnp
  >>> from jax.sharding import NamedSharding, PartitionSpec as P
  >>> from sebp_jax import sebp_matmul
  >>> mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  >>> x = jax.device_put(jnp.ones((4, 5, 3)), NamedSharding(mesh, P("data")))
  >>> w = jnp.ones((3, 2))
  >>> def loss(x, w):
  ...   with sharded_rows("data", mesh=mesh):
  ...     return jnp.sum(sebp_matmul(x, w, impl="xla") ** 2)
  >>> jax.jit(jax.grad(loss, argnums=1))(x, w).shape
  (3, 2)
  """
  axes = (axes,) if isinstance(axes, str) else tuple(axes)
  if not all(isinstance(a, str) for a in axes):
    raise TypeError(f"sharded_rows: `axes` must be a mesh axis name or a tuple of them, got "
                    f"{axes!r}.")
  if mesh is not None and not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
    raise TypeError(f"sharded_rows: `mesh` must be a jax.sharding.Mesh, got "
                    f"{type(mesh).__name__}.")
  if mesh is not None and (unknown := [a for a in axes if a not in mesh.axis_names]):
    raise ValueError(f"sharded_rows: `axes` {unknown} are not axes of `mesh` "
                     f"{mesh.axis_names}.")
  token = _CURRENT.set(RowSharding(axes, mesh))
  try:
    yield
  finally:
    _CURRENT.reset(token)


def current_row_sharding() -> RowSharding | None:
  """The :func:`sharded_rows` in effect, or ``None``."""
  return _CURRENT.get()


def fsdp_spec(shape: tuple[int, ...], axis: str, axis_size: int) -> P:
  """The ``PartitionSpec`` that shards an array of ``shape`` FSDP-style over the mesh ``axis``:
  along its largest dim that ``axis_size`` divides (the first such among equals), or replicated
  where none does (scalars, odd sizes).

  >>> tuple(fsdp_spec((768, 3072), "data", 2))
  (None, 'data')
  >>> tuple(fsdp_spec((3,), "data", 2))
  ()
  """
  for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
    if shape[dim] % axis_size == 0:
      return P(*(None,) * dim, axis)
  return P()


# (x2d | None, kernel | None, dy2d, plan: RowPlan | None) -> (dx2d | None, dw | None); for sibling
# products of one x, kernel and dy2d are tuples (one per sibling), dw a tuple, dx2d their sum.
Backward = Callable[..., tuple]


def _varying(value) -> frozenset:
  """The manual mesh axes ``value`` varies over (empty outside ``shard_map`` or unchecked)."""
  mat = getattr(jax.typeof(value), "mat", None)
  return frozenset() if mat is None else frozenset(mat.varying)


def _local_backward(backward: Backward, x, kernel, dy, plan: RowPlan | None, *,
                    reduce_over=None):
  """``backward`` on this device's rows (operands of any rank, rows = all but the last dim) and
  ``plan``, a plan of those rows or ``None``.

  ``dW`` is then summed over the mesh axes ``reduce_over``; by default (``None``) over the manual
  axes along which the rows vary and the kernel does not, the ``psum`` that transposing the dense
  product's broadcast of the kernel gives inside ``shard_map(check_vma=True)``.
  """
  x2d = None if x is None else x.reshape(-1, x.shape[-1])
  dx2d, dw = backward(x2d, kernel, jax.tree.map(lambda d: d.reshape(-1, d.shape[-1]), dy), plan)
  rows = jax.tree.leaves(dy)[0].shape[:-1]
  dx = None if dx2d is None else dx2d.reshape(*rows, dx2d.shape[-1])
  if dw is None:
    return dx, dw

  def reduced(dw, kernel):
    if dw is None:  # a sibling whose dW was not asked for
      return None
    axes = reduce_over
    if axes is None:
      kernel_axes = frozenset() if kernel is None else _varying(kernel)
      axes = tuple(sorted(_varying(dw) - kernel_axes))
    return lax.psum(dw, tuple(axes)) if axes else dw
  if isinstance(dw, tuple):  # siblings: one dw per kernel, and the column sums of their dys
    dws, dbs = dw
    return dx, (tuple(reduced(d, k) for d, k in zip(dws, kernel)),
                tuple(reduced(db, None) for db in dbs))
  return dx, reduced(dw, kernel)


def _spec_axes(entry) -> tuple[str, ...]:
  """The mesh axes of one ``PartitionSpec`` entry."""
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def _explicit_specs(x, kernel, dy) -> tuple[tuple, tuple[str, ...]]:
  """``(row_entries, k_axes)``: the spec entries of the rows (leading dims) and the explicit
  axes of ``K``, from the operands' types; raises where the backward cannot follow them."""
  dy_spec = tuple(jax.typeof(dy).sharding.spec)
  dy_spec += (None,) * (dy.ndim - len(dy_spec))
  if dy_spec[-1] is not None:
    raise ValueError(
      f"sebp_matmul: the output gradient is sharded along its features over mesh axes "
      f"{_spec_axes(dy_spec[-1])} (a tensor-parallel layer, spec {P(*dy_spec)}): the SEBP "
      f"backward selects whole rows and cannot follow it without a collective dense does not "
      f"have. Leave this layer dense (swap_dense(where=...)) or replicate its output features.")
  rows = dy_spec[:-1]
  k_axes: tuple[str, ...] = ()
  for name, value in (("x", x), ("kernel", kernel)):
    if value is None:
      continue
    spec = tuple(jax.typeof(value).sharding.spec)
    spec += (None,) * (value.ndim - len(spec))
    if name == "x":
      if spec[:-1] != rows:
        raise ValueError(f"sebp_matmul: `x`'s rows are sharded as {P(*spec[:-1])} but the "
                         f"output gradient's as {P(*rows)}; reshard one to the other.")
      k_axes = _spec_axes(spec[-1])
    else:
      if spec[1] is not None:
        raise ValueError(
          f"sebp_matmul: the kernel's output features are sharded over {_spec_axes(spec[1])} "
          f"(a tensor-parallel layer): the SEBP backward selects whole rows and cannot follow "
          f"it. Leave this layer dense (swap_dense(where=...)).")
      if x is not None and _spec_axes(spec[0]) != k_axes:
        raise ValueError(f"sebp_matmul: `x`'s features are sharded over {k_axes} but the "
                         f"kernel's over {_spec_axes(spec[0])}; reshard one to the other.")
      k_axes = _spec_axes(spec[0])
  return rows, k_axes


def _check_divisible(dim: int, axes: tuple[str, ...], mesh) -> None:
  shards = math.prod(mesh.shape[a] for a in axes)
  if dim % shards:
    raise ValueError(f"sebp_matmul: the batch dim ({dim}) does not divide evenly over the mesh "
                     f"axes {axes} ({shards} shards); pad the batch to a multiple of {shards}.")


def _sum_partials(partials):
  """The sum of the per-device partial ``dW``s, stacked along a leading dim sharded over
  ``row_axes``, as a dot with a vector of ones: its contracting dim is sharded like that of the
  dense ``dW = Xᵀ dY``, so XLA's SPMD partitioner reduces it the same way (an all-reduce for a
  replicated weight, a reduce-scatter for an FSDP-sharded one, one per mesh axis on a 2-D mesh),
  where a ``psum`` inside the shard_map would all-reduce over every row axis at once."""
  ones = jnp.ones(partials.shape[:1], partials.dtype)
  return lax.dot_general(ones, partials, (((0,), (0,)), ((), ())),
                         preferred_element_type=partials.dtype)


def per_shard_backward(backward: Backward, x, kernel, dy, rows: RowSharding | None, *,
                       plan: RowPlan | None = None):
  """The SEBP backward ``(dx, dw)`` of ``x @ kernel`` with each device on its own rows.

  Args:
    backward: the backend on 2-D operands, ``(x2d, kernel, dy2d, plan) -> (dx2d, dw)``.
    x: ``(..., K)`` or ``None``; kernel: ``(K, N)`` or ``None``; dy: ``(..., N)``. Siblings
      (:func:`sebp_jax.matmul.sebp_matmuls`): tuples of kernels and ``dy``s, and ``dw`` is
      ``(dws, dbs)``, their ``dW``s and the ``(N_i,)`` column sums of their ``dy``s (bias
      gradients, as many as asked for), each summed over the devices' rows like ``dW``.
    rows: the :func:`sharded_rows` in effect when the forward was traced.
    plan: a :class:`sebp_jax.RowPlan` of all of ``dy``'s rows, or ``None``. Where the rows are
      sharded, each device plans its own from its part of the plan's mask (a permutation of
      its rows: a few fused XLA ops, no read of ``dy``).

  Returns:
    ``(dx, dw)`` as the dense backward returns them: ``dx`` sharded as ``x``, ``dw`` summed over
    the devices' rows.
  """
  context = jax.sharding.get_abstract_mesh()
  siblings = isinstance(dy, tuple)
  first_dy = dy[0] if siblings else dy
  if not context.empty and AxisType.Explicit in context.axis_types:
    found = {_explicit_specs(x, k, d) for k, d in (zip(kernel, dy) if siblings else
                                                    [(kernel, dy)])}
    if len(found) != 1:
      raise ValueError(
        f"sebp_matmuls: the sibling products' operands are sharded differently ({found}); "
        f"reshard them alike or call each as sebp_matmul.")
    (row_entries, k_axes), = found
    mesh, explicit = context, True
  elif rows is not None and rows.axes:
    mesh = rows.mesh if rows.mesh is not None else context
    if mesh.empty:
      raise ValueError(
        f"sebp_matmul: sharded_rows({rows.axes}) needs a mesh: pass sharded_rows(..., mesh=mesh) "
        f"or set one with jax.set_mesh(mesh).")
    _check_divisible(first_dy.shape[0], rows.axes, mesh)
    row_entries, k_axes, explicit = (rows.axes,) + (None,) * (first_dy.ndim - 2), (), False
  else:
    unseen = [a for a, t in zip(context.axis_names, context.axis_types)
              if t == AxisType.Auto and context.shape[a] > 1]
    if rows is None and unseen:
      raise ValueError(
        f"sebp_matmul: the mesh in context has automatic axes {tuple(unseen)}, along which "
        f"the rows' sharding cannot be seen at trace time; say which axes shard the batch with "
        f"`with sebp_jax.sharded_rows(axes):` (sharded_rows(()) if none do), or use an "
        f"explicit-sharding mesh.")
    # One device, replicated rows, or inside shard_map: the operands are this device's own.
    return _local_backward(backward, x, kernel, dy, plan)
  row_axes = tuple(a for entry in row_entries for a in _spec_axes(entry))
  if not row_axes and not k_axes:
    return _local_backward(backward, x, kernel, dy, plan)
  k_entry = k_axes or None
  specs = {"x": P(*row_entries, k_entry), "kernel": P(k_entry, None), "dy": P(*row_entries, None),
           "keep": P(*row_entries)}
  # A plan of sharded rows travels as its mask, sharded like the rows; each device re-plans.
  keep = None if plan is None or not row_axes else plan.keep.reshape(first_dy.shape[:-1])
  if keep is not None and explicit:  # its type must say so; a local slice, no collective
    keep = jax.sharding.reshard(keep, specs["keep"])
  present = {name: value for name, value in (("x", x), ("kernel", kernel), ("dy", dy),
                                             ("keep", keep)) if value is not None}
  # Explicit sharding: dW's type is the kernel's, replicated over the row axes, and the psum
  # inside is what the dense transpose does. Automatic: the partial sums leave stacked, for XLA
  # to reduce as it reduces dense's (_sum_partials).
  partial = not explicit and x is not None
  dw_spec = P(row_axes, k_entry, None) if partial else specs["kernel"]
  if siblings:  # their dWs, and the column sums of their dys (bias gradients), like dW's
    dw_spec = (dw_spec, P(row_axes, None) if partial else P(None))

  def body(operands):
    local_plan = plan if "keep" not in operands else row_plan(operands["keep"], check=plan.check)
    dx, dw = _local_backward(backward, operands.get("x"), operands.get("kernel"),
                             operands["dy"], local_plan, reduce_over=() if partial else row_axes)
    return dx, (jax.tree.map(lambda d: d[None], dw) if partial else dw)

  dx, dw = jax.shard_map(
    body, mesh=mesh, in_specs=({n: specs[n] for n in present},),
    # Siblings: their dWs (or Nones) and their dys' column sums, whether or not x is there.
    out_specs=(specs["x"] if jax.tree.leaves(kernel) else None,
               dw_spec if x is not None or siblings else None),
    # Unchecked: the Pallas interpreter cannot run kernels with loops on varying values (jax
    # 0.10); the reductions are explicit above.
    axis_names=set(row_axes) | set(k_axes), check_vma=False)(present)
  return dx, (jax.tree.map(_sum_partials, dw) if partial else dw)
