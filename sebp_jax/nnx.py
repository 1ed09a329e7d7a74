"""flax.nnx integration: ``SEBPLinear``, ``swap_linear``, ``unswap_linear`` and ``linear_siblings``.

SEBP lives entirely inside a layer's weight contraction (:class:`sebp_jax.matmul.SEBPDotGeneral`):
``nnx.Linear`` and ``nnx.LinearGeneral`` take a ``dot_general``, ``nnx.Einsum`` an ``einsum_op``
(:class:`sebp_jax.contraction.DotGeneralEinsum`); ``nnx.Embed.attend`` has no hook, so a swapped
``nnx.Embed`` becomes a subclass whose ``attend`` has one.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from sebp_jax import contraction
from sebp_jax.contraction import DotGeneralEinsum
from sebp_jax.matmul import SEBPDotGeneral, sebp_matmuls
from sebp_jax.policy import RowPolicy
from sebp_jax.swap_report import (SwappedLayer, SwapReport, check_where, warn_if_nothing_selected,
                                  warn_stays_dense)

__all__ = ["SEBPLinear", "linear_siblings", "swap_linear", "unswap_linear"]

ModulePath = tuple[str, ...]


class SEBPLinear(nnx.Linear):
  """``nnx.Linear`` whose backward runs on the active rows of the output gradient only.

  Takes ``nnx.Linear``'s arguments (and has its parameters) plus ``policy``, ``impl`` and
  ``crossover``, as :func:`sebp_jax.sebp_matmul` does.

  >>> import jax, jax.numpy as jnp
  >>> from flax import nnx
  >>> layer = SEBPLinear(3, 4, rngs=nnx.Rngs(0))
  >>> layer(jnp.ones((2, 7, 3))).shape
  (2, 7, 4)
  """

  def __init__(self, in_features: int, out_features: int, *,
               policy: RowPolicy = RowPolicy(), impl: str = "auto",
               crossover: float | None = None, **kwargs):
    if "dot_general" in kwargs:
      raise ValueError("SEBPLinear: `dot_general` is SEBP's own; leave it unset.")
    super().__init__(in_features, out_features,
                     dot_general=SEBPDotGeneral(policy, impl, crossover), **kwargs)


class _SEBPAttendEmbed(nnx.Embed):
  """``nnx.Embed`` whose ``attend`` runs through ``attend_dot_general``: what :func:`swap_linear`
  turns an ``nnx.Embed`` into (``attend`` has no hook of its own), and :func:`unswap_linear` back."""

  attend_dot_general: SEBPDotGeneral

  def attend(self, query, out_sharding=None):
    query, embedding = self.promote_dtype((query, self.embedding[...]), dtype=self.dtype)
    # The embedding as stored, contracted on its last dim: the SEBP backward reads it and
    # writes its gradient in that layout (no transpose of either).
    return self.attend_dot_general(query, embedding, (((query.ndim - 1,), (1,)), ((), ())),
                                   out_sharding=out_sharding)


def _is_default_or_sebp(hook, default) -> bool:
  return hook is default or isinstance(hook, (SEBPDotGeneral, DotGeneralEinsum))


def _layer(path, module) -> tuple[str, str, str | None] | None:
  """``(kind, hook attribute, dense reason)`` of a layer :func:`swap_linear` may swap, or
  ``None``: not a weight layer, a subclass (``SEBPLinear`` keeps its own), or one with a
  ``dot_general`` / ``einsum_op`` of its own."""
  kind = type(module)
  if kind is nnx.Linear and _is_default_or_sebp(module.dot_general, lax.dot_general):
    return "Linear", "dot_general", None
  if (kind is nnx.LinearGeneral and module.dot_general_cls is None
      and _is_default_or_sebp(module.dot_general, None)):
    reason = (f"`batch_axis` {dict(module.batch_axis)} makes a batched matmul"
              if module.batch_axis else None)
    return "LinearGeneral", "dot_general", reason
  if kind is nnx.Einsum and _is_default_or_sebp(module.einsum_op, jnp.einsum):
    # An equation given only at call time is checked when it runs (`einsum_matmul` keeps a
    # batched one dense).
    reason = (contraction.einsum_dense_reason(module.einsum_str)
              if module.einsum_str is not None else None)
    return "Einsum", "einsum_op", reason
  if kind in (nnx.Embed, _SEBPAttendEmbed):
    return "Embed.attend", "attend_dot_general", None
  return None


def _kernel_shape(module) -> tuple[int, ...]:
  table = module.embedding if isinstance(module, nnx.Embed) else module.kernel
  return tuple(table.shape)


def swap_linear(
  model: nnx.Module,
  policy: RowPolicy = RowPolicy(),
  *,
  where: Callable[[ModulePath], bool] | None = None,
  impl: str = "auto",
  crossover: float | None = None,
) -> SwapReport:
  """Give the weight layers of ``model`` the SEBP backward, in place.

  Reaches ``nnx.Linear`` (``preferred_element_type`` and ``out_sharding`` included),
  ``nnx.LinearGeneral`` (any ``axis``), ``nnx.Einsum`` (weight einsums such as
  ``BTD,NDH->BTNH``), the projections of ``nnx.MultiHeadAttention`` (LinearGenerals) and
  ``nnx.Embed.attend`` (path ends in ``"attend"``). Stay dense: attention scores, a
  ``LinearGeneral`` with ``batch_axis`` or an einsum with a batch letter (in the report, with a
  warning), layers with a ``dot_general`` / ``einsum_op`` of their own, and subclasses.
  Parameters are untouched; swapping again replaces the policy; :func:`unswap_linear` undoes it.

  Args:
    model: any nnx module.
    policy: which output-gradient rows to keep.
    where: predicate on the module path (a tuple of attribute names and indices, as strings),
      choosing the layers that get SEBP; ``None`` selects every layer. Warns if it selected none.
    impl: the backward's backend, as in :func:`sebp_jax.sebp_matmul`.
    crossover: the kept-row fraction above which the dense backward runs instead, as in
      :func:`sebp_jax.sebp_matmul` (``1.0``: never, no conditional compiled).

  Returns:
    A :class:`sebp_jax.swap_report.SwapReport`: ``len(report)`` layers run SEBP;
    ``report.dense`` lists those selected but left dense.

  >>> from flax import nnx
  >>> model = nnx.Sequential(nnx.Linear(3, 8, rngs=nnx.Rngs(0)), nnx.relu,
  ...                        nnx.LinearGeneral(8, (2, 4), rngs=nnx.Rngs(1)))
  >>> [(layer.path, layer.kind, layer.kernel_shape) for layer in swap_linear(model)]
  [(('layers', '0'), 'Linear', (3, 8)), (('layers', '2'), 'LinearGeneral', (8, 2, 4))]
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(
      f"swap_linear: `model` must be an nnx.Module, got {type(model).__name__} (for flax.linen "
      "models use sebp_jax.swap_dense).")
  check_where(where, "swap_linear")
  dot_general = SEBPDotGeneral(policy, impl, crossover)
  report, asked = SwapReport(), []
  for path, module in nnx.iter_graph(model):
    layer = _layer(path, module)
    if layer is None:
      continue
    kind, hook, reason = layer
    path = tuple(str(part) for part in path) + (("attend",) if kind == "Embed.attend" else ())
    asked.append(path)
    if where is not None and not where(path):
      continue
    swapped = SwappedLayer(path, kind, _kernel_shape(module), reason)
    report.add(swapped)
    if reason is not None:
      warn_stays_dense("swap_linear", swapped, stacklevel=2)
      continue
    if kind == "Embed.attend":
      module.__class__ = _SEBPAttendEmbed
    setattr(module, hook, DotGeneralEinsum(dot_general) if kind == "Einsum" else dot_general)
  warn_if_nothing_selected("swap_linear", where, asked, report, stacklevel=1)
  return report


def unswap_linear(model: nnx.Module) -> SwapReport:
  """Undo :func:`swap_linear`: every swapped layer of ``model`` gets its flax default back
  (layers built as ``SEBPLinear`` stay SEBP). Returns the layers restored."""
  if not isinstance(model, nnx.Module):
    raise TypeError(f"unswap_linear: `model` must be an nnx.Module, got {type(model).__name__}.")
  report = SwapReport()
  defaults = {"Linear": lax.dot_general, "LinearGeneral": None, "Einsum": jnp.einsum}
  for path, module in nnx.iter_graph(model):
    layer = _layer(path, module)
    if layer is None:
      continue
    kind, hook, _ = layer
    if kind == "Embed.attend":
      if type(module) is not _SEBPAttendEmbed:
        continue
      del module.attend_dot_general
      module.__class__ = nnx.Embed
    elif getattr(module, hook) is defaults[kind]:
      continue
    else:
      setattr(module, hook, defaults[kind])
    path = tuple(str(part) for part in path) + (("attend",) if kind == "Embed.attend" else ())
    report.add(SwappedLayer(path, kind, _kernel_shape(module)))
  return report


def _sibling_group(layers: Sequence[nnx.Module]) -> SEBPDotGeneral | None:
  """The ``SEBPDotGeneral`` every layer of ``layers`` runs, if they can share one backward."""
  if len(layers) < 2 or not all(isinstance(layer, nnx.Linear) for layer in layers):
    return None
  first = layers[0].dot_general
  if not isinstance(first, SEBPDotGeneral):
    return None

  def same_backward(dot_general) -> bool:
    # Field by field: a row plan holds arrays, compared by identity.
    return dot_general is first or (
      isinstance(dot_general, SEBPDotGeneral) and dot_general.rows is first.rows
      and (dot_general.policy, dot_general.impl, dot_general.crossover)
      == (first.policy, first.impl, first.crossover))

  settings = {(layer.precision, layer.dtype, layer.promote_dtype, layer.preferred_element_type)
              for layer in layers}
  if (len(settings) != 1 or layers[0].preferred_element_type is not None
      or not all(same_backward(layer.dot_general) for layer in layers)):
    return None
  return first


def linear_siblings(layers: Sequence[nnx.Module], x: jax.Array) -> tuple[jax.Array, ...]:
  """``tuple(layer(x) for layer in layers)``: sibling ``nnx.Linear`` layers of one input (q, k
  and v; gate and up).

  Where every layer runs the same SEBP ``dot_general`` (one :func:`swap_linear`, or
  ``SEBPLinear`` layers of one policy) with the same dtype, precision and promotion, their
  products share one backward (:func:`sebp_jax.sebp_matmuls`): each later sibling adds its
  ``dx`` into the first one's in place, instead of a whole ``dx`` each for XLA to sum, and the
  biases' gradients come from the rows its gather copies. The result is ``nnx.Linear``'s
  (promotion, product, and the bias added in float32 and rounded once: its add's value). Otherwise
  (dense layers, mixed policies or dtypes, ``preferred_element_type``) each layer runs as called.

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> q, k = SEBPLinear(3, 4, rngs=nnx.Rngs(0)), SEBPLinear(3, 2, rngs=nnx.Rngs(1))
  >>> [y.shape for y in linear_siblings([q, k], jnp.ones((2, 5, 3)))]
  [(2, 5, 4), (2, 5, 2)]
  """
  layers = tuple(layers)
  if not layers:
    raise ValueError("linear_siblings: `layers` must hold at least one layer.")
  dot_general = _sibling_group(layers)
  if dot_general is None:
    return tuple(layer(x) for layer in layers)
  promoted = [layer.promote_dtype((x, layer.kernel[...],
                                   None if layer.bias is None else layer.bias[...]),
                                  dtype=layer.dtype) for layer in layers]
  if len({inputs.dtype for inputs, _, _ in promoted}) != 1:
    return tuple(layer(x) for layer in layers)
  # The biases inside the group's rule, whose shared gather sums their gradients; added in
  # float32 and rounded once, the value of nnx.Linear's add in the product's dtype.
  return sebp_matmuls(promoted[0][0], [kernel for _, kernel, _ in promoted],
                      [bias for _, _, bias in promoted], policy=dot_general.policy,
                      impl=dot_general.impl, precision=layers[0].precision,
                      crossover=dot_general.crossover, rows=dot_general.rows,
                      name=dot_general.name)

