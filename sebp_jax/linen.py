"""flax.linen integration: ``SEBPDense``, ``SEBPDenseGeneral``, ``SEBPEinsum`` and ``swap_dense``.

All rest on one fact: SEBP lives entirely inside a layer's weight contraction
(:class:`sebp_jax.matmul.SEBPDotGeneral`). ``nn.Dense`` and ``nn.DenseGeneral`` do theirs through
a ``dot_general`` they can be given; ``nn.Einsum`` and ``nn.Embed.attend`` through ``jnp``
functions, so their SEBP forms compute the same thing through
:func:`sebp_jax.contraction.einsum_matmul` and ``SEBPDotGeneral``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Callable, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp

from sebp_jax import contraction
from sebp_jax.matmul import SEBPDotGeneral, sebp_matmuls
from sebp_jax.plan import RowPlan
from sebp_jax.policy import RowPolicy
from sebp_jax.swap_report import (SwappedLayer, SwapReport, check_where, warn_if_nothing_selected,
                                  warn_stays_dense)

__all__ = ["SEBPDense", "SEBPDenseGeneral", "SEBPEinsum", "dense_siblings", "swap_dense",
           "swap_dot_general"]

ModulePath = tuple[str, ...]


def _install_sebp_dot_general(module: nn.Dense | nn.DenseGeneral) -> None:
  """Sets ``module.dot_general`` (Dense's and DenseGeneral's own hook, so their ``__call__``
  runs unchanged) from its ``policy``, ``impl`` and ``crossover``: on every construction,
  clones included."""
  name = type(module).__name__
  if module.dot_general_cls is not None or not (
      module.dot_general is None or isinstance(module.dot_general, SEBPDotGeneral)):
    raise ValueError(f"{name}: `dot_general` and `dot_general_cls` are SEBP's own; leave them "
                     "unset.")
  object.__setattr__(module, "dot_general",
                     SEBPDotGeneral(module.policy, module.impl, module.crossover))


class SEBPDense(nn.Dense):
  """``nn.Dense`` whose backward runs on the active rows of the output gradient only.

  The same attributes, parameter names, shapes and initialisers as ``nn.Dense`` (a checkpoint
  moves between the two untouched), plus the three below. Like any linen module, an unnamed
  ``SEBPDense`` is auto-named after its class (``SEBPDense_0`` where ``nn.Dense`` is
  ``Dense_0``): name the layers, or keep ``nn.Dense`` and use :func:`swap_dense`, where a
  checkpoint of auto-named layers must fit both.

  Attributes:
    policy: which output-gradient rows to keep (:class:`sebp_jax.RowPolicy`; exact by default).
    impl: the backward's backend, as in :func:`sebp_jax.sebp_matmul`.
    crossover: the kept-row fraction above which the dense backward runs instead, as in
      :func:`sebp_jax.sebp_matmul` (``1.0``: never, no conditional compiled).

  Example usage::

    >>> import jax, jax.numpy as jnp
    >>> import flax.linen as nn
    >>> layer = SEBPDense(features=4)
    >>> params = layer.init(jax.random.key(0), jnp.ones((2, 7, 3)))
    >>> jax.tree_util.tree_map(jnp.shape, params)
    {'params': {'bias': (4,), 'kernel': (3, 4)}}
    >>> nn.Dense(features=4).apply(params, jnp.ones((2, 7, 3))).shape
    (2, 7, 4)
  """

  policy: RowPolicy = RowPolicy()
  impl: str = "auto"
  crossover: float | None = None

  def __post_init__(self):
    _install_sebp_dot_general(self)
    super().__post_init__()


class SEBPDenseGeneral(nn.DenseGeneral):
  """``nn.DenseGeneral`` whose backward runs on the active rows of the output gradient only.

  ``nn.DenseGeneral``'s attributes and parameters (any ``axis`` and ``features`` tuples: the
  input's contracted dims and the kernel's output dims are flattened into one matrix product),
  plus ``policy``, ``impl`` and ``crossover`` as in :class:`SEBPDense`. ``batch_dims`` (one
  kernel per batch entry, a batched matmul) has no SEBP form and is rejected.

  Example usage (a MaxText-style attention output projection, heads and head dim contracted)::

    >>> import jax, jax.numpy as jnp
    >>> layer = SEBPDenseGeneral(features=16, axis=(-2, -1))
    >>> x = jnp.ones((2, 7, 4, 8))       # (batch, tokens, heads, head_dim)
    >>> params = layer.init(jax.random.key(0), x)
    >>> jax.tree_util.tree_map(jnp.shape, params)
    {'params': {'bias': (16,), 'kernel': (4, 8, 16)}}
    >>> layer.apply(params, x).shape
    (2, 7, 16)
  """

  policy: RowPolicy = RowPolicy()
  impl: str = "auto"
  crossover: float | None = None

  def __post_init__(self):
    if self.batch_dims:
      raise ValueError(
        f"SEBPDenseGeneral: `batch_dims` ({self.batch_dims}) makes a batched matmul, which has "
        "no SEBP backward; use nn.DenseGeneral.")
    _install_sebp_dot_general(self)
    super().__post_init__()


def _einsum(module: nn.Einsum, inputs: jax.Array, einsum_str: str | None = None, *,
            dot_general: Callable[..., jax.Array]) -> jax.Array:
  """``nn.Einsum.__call__`` (same parameters, same result) with its product through
  ``dot_general`` (:func:`sebp_jax.contraction.einsum_matmul`). Runs inside the module's compact
  ``__call__``."""
  einsum_str = nn.merge_param("einsum_str", module.einsum_str, einsum_str).replace(" ", "")
  kernel = module.param("kernel", module.kernel_init, module.shape, module.param_dtype)
  bias = None
  if module.use_bias:
    bias_shape, broadcasted_bias_shape = module._get_bias_shape(einsum_str, inputs, kernel)
    bias = module.param("bias", module.bias_init, bias_shape, module.param_dtype)
  inputs, kernel, bias = module.promote_dtype(inputs, kernel, bias, dtype=module.dtype)
  y = contraction.einsum_matmul(einsum_str, inputs, kernel, dot_general=dot_general,
                                precision=module.precision,
                                preferred_element_type=module.preferred_element_type)
  if bias is not None:
    y += jnp.reshape(bias, broadcasted_bias_shape)
  return y


class SEBPEinsum(nn.Einsum):
  """``nn.Einsum`` whose backward runs on the active rows of the output gradient only.

  ``nn.Einsum``'s attributes and parameters plus ``policy``, ``impl`` and ``crossover`` as in
  :class:`SEBPDense`. The einsum must be a weight matrix product (no letter shared by the input,
  the kernel and the output: :func:`sebp_jax.contraction.einsum_dense_reason`), as Gemma's are.

  Example usage (Gemma's query projection, one kernel slice per head)::

    >>> import jax, jax.numpy as jnp
    >>> layer = SEBPEinsum((4, 16, 8), "BTD,NDH->BTNH", use_bias=False)
    >>> x = jnp.ones((2, 7, 16))
    >>> params = layer.init(jax.random.key(0), x)
    >>> layer.apply(params, x).shape
    (2, 7, 4, 8)
  """

  policy: RowPolicy = RowPolicy()
  impl: str = "auto"
  crossover: float | None = None

  def __post_init__(self):
    # Checks the arguments when the layer is built.
    object.__setattr__(self, "_dot_general",
                       SEBPDotGeneral(self.policy, self.impl, self.crossover))
    super().__post_init__()

  @nn.compact
  def __call__(self, inputs: jax.Array, einsum_str: str | None = None) -> jax.Array:
    equation = nn.merge_param("einsum_str", self.einsum_str, einsum_str)
    reason = contraction.einsum_dense_reason(equation)
    if reason is not None:
      raise ValueError(f"SEBPEinsum: {equation!r} has no SEBP backward: {reason}; use nn.Einsum.")
    return _einsum(self, inputs, einsum_str, dot_general=self._dot_general)


@contextlib.contextmanager
def swap_dense(
  policy: RowPolicy = RowPolicy(),
  *,
  where: Callable[[ModulePath], bool] | None = None,
  impl: str = "auto",
  crossover: float | None = None,
  rows: RowPlan | None = None,
  lax_modules: tuple[type[nn.Module], ...] = (),
) -> Iterator[SwapReport]:
  """Give every weight contraction traced inside the block the SEBP backward.

  Reaches ``nn.Dense``, ``nn.DenseGeneral`` (any ``axis``), ``nn.Einsum`` (weight einsums such as
  ``BTD,NDH->BTNH``), the projections of ``nn.MultiHeadDotProductAttention`` (DenseGenerals), and
  ``nn.Embed.attend``, the output projection of models with tied embeddings (often their largest
  matmul; its path ends in ``"attend"``). Stay dense: the attention scores and other batched
  contractions, a ``DenseGeneral`` with ``batch_dims`` or an einsum with a batch letter (listed
  in the report, with a warning), layers with their own ``dot_general`` (quantised matmuls, say),
  subclasses (``SEBPDense`` keeps its own policy), and modules that call ``jax.lax.dot_general``
  themselves unless named in ``lax_modules``.

  The model is not modified: the swap applies to calls *traced* while the context is open. Enter
  it inside the function you ``jit`` (or jit inside it): a function jitted and traced outside the
  context reuses its cached dense program when called inside, since jit cannot see the context.
  Parameters are untouched, so the same params serve the dense and the SEBP model. Nested
  contexts: the innermost one whose ``where`` selects a layer decides for it.

  Args:
    policy: which output-gradient rows to keep.
    where: predicate on the module path, e.g. ``("encoder", "layer_3", "intermediate", "dense")``,
      choosing the layers that get SEBP; ``None`` selects every layer. Warns once (at exit) if it
      selected none of the layers it was asked about.
    impl: the backward's backend, as in :func:`sebp_jax.sebp_matmul`.
    crossover: the kept-row fraction above which the dense backward runs instead, as in
      :func:`sebp_jax.sebp_matmul` (``1.0``: never, no conditional compiled).
    rows: a row plan made once per step (:func:`sebp_jax.row_plan` of the batch's mask), shared
      by every layer whose input's leading dims are the mask's: those layers skip their score
      read and partition. Exact policy only; see :func:`sebp_jax.sebp_matmul`.
    lax_modules: the escape hatch for libraries whose modules call ``jax.lax.dot_general``
      themselves (Hugging Face's Flax GPT-2 ``FlaxConv1D``): while the ``__call__`` of a selected
      instance of one of these classes runs, ``jax.lax.dot_general`` is the SEBP one (the
      attribute is replaced for the call and restored after it). Their kind in the report is
      ``"<Class> (lax.dot_general)"``.

  Yields:
    A :class:`sebp_jax.swap_report.SwapReport`, filled as layers are traced: each selected
    layer's path, kind and kernel shape, and whether it runs SEBP.

  >>> import jax, jax.numpy as jnp
  >>> import flax.linen as nn
  >>> model = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(2)])
  >>> x = jnp.ones((4, 3))
  >>> params = model.init(jax.random.key(0), x)
  >>> with swap_dense(where=lambda path: path[-1] == "layers_2") as report:
  ...   grads = jax.grad(lambda p: model.apply(p, x).sum())(params)
  >>> [(layer.path, layer.kind, layer.kernel_shape) for layer in report]
  [(('layers_2',), 'Dense', (8, 2))]
  """
  with _swap(SEBPDotGeneral(policy, impl, crossover, rows), where, lax_modules,
             "swap_dense") as report:
    yield report


@contextlib.contextmanager
def swap_dot_general(
  dot_general: Callable[..., jax.Array],
  *,
  where: Callable[[ModulePath], bool] | None = None,
  lax_modules: tuple[type[nn.Module], ...] = (),
) -> Iterator[SwapReport]:
  """Run the weight contraction of every layer :func:`swap_dense` reaches through ``dot_general``
  (a ``lax.dot_general`` replacement): the mechanism of :func:`swap_dense`, and its escape hatch.

  The same layers, rules, ``lax_modules`` and report as :func:`swap_dense`; ``dot_general``
  gets each selected layer's contraction when it is a weight matrix product (no batch
  dimensions; for ``nn.Einsum`` with the input as ``lhs``), and every ``jax.lax.dot_general``
  call of the ``lax_modules``' selected instances.
  """
  with _swap(dot_general, where, lax_modules, "swap_dot_general") as report:
    yield report


# --- the interceptor ---------------------------------------------------------------------------

@dataclasses.dataclass
class _Swap:
  """One open swap context."""

  dot_general: Callable[..., jax.Array]
  where: Callable[[ModulePath], bool] | None
  lax_modules: tuple[type[nn.Module], ...]
  caller: str
  report: SwapReport = dataclasses.field(default_factory=SwapReport)
  asked: list[ModulePath] = dataclasses.field(default_factory=list)

  def selects(self, path: ModulePath) -> bool:
    if self.where is None:
      return True
    if path not in self.asked:
      self.asked.append(path)
    return bool(self.where(path))


class _OpenSwaps(threading.local):
  """The open swap contexts of this thread, outermost first (flax's interceptor stack is
  per-thread too)."""

  def __init__(self):
    self.stack: list[_Swap] = []
    # While dense_siblings runs its layers: their (lhs, rhs) products, captured, not computed;
    # then the products computed together, handed back in order.
    self.captured: list[tuple[jax.Array, jax.Array]] | None = None
    self.products: list[jax.Array] | None = None


_OPEN = _OpenSwaps()


@contextlib.contextmanager
def _swap(dot_general, where, lax_modules, caller) -> Iterator[SwapReport]:
  check_where(where, caller)
  lax_modules = tuple(lax_modules) if isinstance(lax_modules, (tuple, list)) else lax_modules
  if not (isinstance(lax_modules, tuple) and all(
      isinstance(c, type) and issubclass(c, nn.Module) for c in lax_modules)):
    raise TypeError(f"{caller}: `lax_modules` must be a tuple of flax.linen Module classes, got "
                    f"{lax_modules!r}.")
  swap = _Swap(dot_general, where, lax_modules, caller)
  # One interceptor for all nested contexts, so that the innermost selecting one decides (flax
  # runs the outermost interceptor first, which would otherwise win).
  outermost = not _OPEN.stack
  _OPEN.stack.append(swap)
  try:
    with nn.intercept_methods(_intercept) if outermost else contextlib.nullcontext():
      yield swap.report
  finally:
    _OPEN.stack.remove(swap)
  # Reported at the user's `with`: past this generator, contextlib, swap_dense's generator and
  # contextlib again.
  warn_if_nothing_selected(caller, where, swap.asked, swap.report, stacklevel=5)


@contextlib.contextmanager
def _lax_dot_general_through(dot_general: Callable[..., jax.Array]) -> Iterator[None]:
  """``jax.lax.dot_general`` is ``dot_general`` inside the block (for ``lax_modules``)."""
  original = jax.lax.dot_general

  def routed(*args, **kwargs):
    # The SEBP product itself calls jax.lax.dot_general: the original, while it runs.
    jax.lax.dot_general = original
    try:
      return dot_general(*args, **kwargs)
    finally:
      jax.lax.dot_general = routed

  jax.lax.dot_general = routed
  try:
    yield
  finally:
    jax.lax.dot_general = original


def _layer_kind(module: nn.Module, method: str) -> str | None:
  """The kind of weight contraction ``module.method`` is, or ``None`` if the swap leaves it
  alone (subclasses keep their own matmul; a Dense with its own ``dot_general`` too)."""
  if method == "__call__":
    if type(module) in (nn.Dense, nn.DenseGeneral):
      own = module.dot_general is not None or module.dot_general_cls is not None
      return None if own else type(module).__name__
    if type(module) is nn.Einsum:
      return "Einsum"
  # The project's float32-gradient Embed is a subclass: what matters is that attend is flax's.
  if method == "attend" and isinstance(module, nn.Embed) and type(module).attend is nn.Embed.attend:
    return "Embed.attend"
  return None


def dense_siblings(modules, x: jax.Array) -> tuple[jax.Array, ...]:
  """``tuple(module(x) for module in modules)``: sibling ``nn.Dense`` layers of one input (q, k
  and v; gate and up), called from the parent's compact method.

  The same parameters and outputs as the separate calls, and the same layers in a swap's report.
  Where one :func:`swap_dense` selects them all, their products share one SEBP backward
  (:func:`sebp_jax.matmul.sebp_matmuls`): each later sibling adds its ``dx`` into the first
  one's in place, instead of a whole ``dx`` each for XLA to sum. Otherwise (no swap, layers of
  different swaps or left dense, a swap of another ``dot_general``) each layer runs as called.
  """
  modules = tuple(modules)
  swaps = [_selecting_swap(module) for module in modules]
  grouped = (len(modules) > 1 and swaps[0] is not None and isinstance(swaps[0].dot_general,
             SEBPDotGeneral) and all(s is swaps[0] for s in swaps)
             and len({(m.precision, m.dtype) for m in modules}) == 1)
  if not grouped:
    return tuple(module(x) for module in modules)
  return _group_products(modules, x, swaps[0].dot_general)


# A lone swapped nn.Dense with a bias runs as a group of one (`_group_products`), so that its
# bias gradient is summed by its gather over the kept rows instead of by XLA over every row of
# `dy` (BERT's FFN up: a column sum over 16384 x 3072 inside the GELU's backward fusion; the
# backward's GPU time -0.14 to -0.17 ms on BERT-base b32, benchmarks/NOTES.md "v38 measured").
# Its rule runs only the products autodiff asks for, as sebp_matmul's does. False leaves the bias
# add to autodiff: the model benchmarks' reverse A/B variant
# `jax-sebp-pallas-plan-nocond-bias-by-autodiff`.
_LONE_BIAS_IN_RULE = True


def _group_products(modules, x: jax.Array, dot_general: SEBPDotGeneral) -> tuple[jax.Array, ...]:
  """The outputs of ``modules`` (``nn.Dense`` layers of input ``x``, one swap's) with their
  products and biases under one :func:`sebp_jax.matmul.sebp_matmuls` rule."""
  # Each layer's __call__ runs twice: first with its product captured (its promoted input and
  # kernel; the output is dropped), then, once the products have run together, with its output
  # handed back, so that parameters, promotion and report are the layer's own. The biases go
  # into the group's products (sebp_matmuls sums their gradients in its gather) and the second
  # call adds none.
  _OPEN.captured = []
  try:
    for module in modules:
      module(x)
    captured = _OPEN.captured
  finally:
    _OPEN.captured = None
  biases = [None if not module.use_bias
            else nn.unbox(module.get_variable("params", "bias")).astype(lhs.dtype)  # promoted
            for module, (lhs, _) in zip(modules, captured)]
  ys = sebp_matmuls(captured[0][0], tuple(rhs for _, rhs in captured), biases,
                    policy=dot_general.policy, impl=dot_general.impl,
                    precision=modules[0].precision, crossover=dot_general.crossover,
                    rows=dot_general.rows, name="+".join("/".join(m.path) for m in modules))
  _OPEN.products = list(ys)
  try:
    return tuple(module(x) for module in modules)
  finally:
    _OPEN.products = None


def _capture(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
  """A Dense's product, recorded for :func:`dense_siblings` and left out (zeros)."""
  del dimension_numbers, precision  # a Dense's: lhs's last dim against rhs's first
  _OPEN.captured.append((lhs, rhs))
  return jnp.zeros((*lhs.shape[:-1], rhs.shape[-1]), preferred_element_type or lhs.dtype)


def _handed_back(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
  """A Dense's output as :func:`dense_siblings` computed it for the group, its bias added."""
  del lhs, rhs, dimension_numbers, precision, preferred_element_type
  return _OPEN.products.pop(0)


def _innermost_swap(path: ModulePath):
  """The innermost open swap that selects the layer at ``path``, or ``None``."""
  return next((s for s in reversed(_OPEN.stack) if s.selects(path)), None)


def _selecting_swap(module: nn.Module):
  """The open swap that would swap ``module``'s product, or ``None``."""
  if _layer_kind(module, "__call__") != "Dense" or module.scope is None:
    return None
  return _innermost_swap(tuple(module.path))


def _intercept(next_fun, args, kwargs, context):
  module = context.module
  kind = _layer_kind(module, context.method_name)
  if kind is None and context.method_name == "__call__":
    if any(isinstance(module, s.lax_modules) for s in _OPEN.stack):
      return _intercept_lax_module(module, next_fun, args, kwargs)
  if kind is None:
    return next_fun(*args, **kwargs)
  path = (*module.path, "attend") if kind == "Embed.attend" else tuple(module.path)
  swap = _innermost_swap(path)
  if swap is None:
    return next_fun(*args, **kwargs)

  reason = None
  if kind == "DenseGeneral" and module.batch_dims:
    reason = f"`batch_dims` {module.batch_dims} make a batched matmul"
  elif kind == "Einsum":
    reason = contraction.einsum_dense_reason(_einsum_str(module, args, kwargs))

  if reason is not None:
    out = next_fun(*args, **kwargs)
  elif kind == "Einsum":
    out = _einsum(module, *args, dot_general=_named(swap.dot_general, path), **kwargs)
  elif kind == "Embed.attend":
    out = _embed_attend(module, *args, dot_general=_named(swap.dot_general, path), **kwargs)
  elif (_LONE_BIAS_IN_RULE and kind == "Dense" and module.use_bias and _OPEN.captured is None
        and _OPEN.products is None and isinstance(swap.dot_general, SEBPDotGeneral)):
    inputs = args[0] if args else kwargs["inputs"]  # nn.Dense.__call__(inputs)
    (out,) = _group_products((module,), inputs, swap.dot_general)
  else:
    # Dense and DenseGeneral read their `dot_general` field in __call__: set it for this call.
    handing_back = _OPEN.captured is None and _OPEN.products is not None
    product = (_capture if _OPEN.captured is not None else _handed_back if handing_back
               else _named(swap.dot_general, path))
    use_bias = module.use_bias
    object.__setattr__(module, "dot_general", product)
    if handing_back:  # the output handed back has the bias in it already
      object.__setattr__(module, "use_bias", False)
    try:
      out = next_fun(*args, **kwargs)
    finally:
      object.__setattr__(module, "dot_general", None)
      object.__setattr__(module, "use_bias", use_bias)

  layer = SwappedLayer(path, kind, _kernel_shape(module, kind), reason)
  if swap.report.add(layer) and reason is not None:
    warn_stays_dense(swap.caller, layer, stacklevel=2)
  return out


def _intercept_lax_module(module, next_fun, args, kwargs):
  """A ``lax_modules`` instance's ``__call__``, its ``jax.lax.dot_general`` calls through the
  innermost swap that names its class and selects it."""
  path = tuple(module.path)
  swap = next((s for s in reversed(_OPEN.stack)
               if isinstance(module, s.lax_modules) and s.selects(path)), None)
  if swap is None:
    return next_fun(*args, **kwargs)
  with _lax_dot_general_through(_named(swap.dot_general, path)):
    out = next_fun(*args, **kwargs)
  kernel = module.get_variable("params", "kernel")
  shape = () if kernel is None else tuple(jnp.shape(nn.unbox(kernel)))
  swap.report.add(SwappedLayer(path, f"{type(module).__name__} (lax.dot_general)", shape))
  return out


def _named(dot_general: Callable[..., jax.Array], path: ModulePath) -> Callable[..., jax.Array]:
  """``dot_general`` naming the layer at ``path``: a checking row plan names the layer it
  catches."""
  if isinstance(dot_general, SEBPDotGeneral) and dot_general.rows is not None:
    return dataclasses.replace(dot_general, name="/".join(path) or "<root>")
  return dot_general


def _einsum_str(module: nn.Einsum, args, kwargs) -> str:
  """The equation an ``nn.Einsum`` call uses (the call's, else the module's)."""
  call_str = args[1] if len(args) > 1 else kwargs.get("einsum_str")
  return nn.merge_param("einsum_str", module.einsum_str, call_str)


def _kernel_shape(module: nn.Module, kind: str) -> tuple[int, ...]:
  """The weight's shape, read after the call (at ``init`` the parameter exists only then)."""
  name = "embedding" if kind == "Embed.attend" else "kernel"
  return tuple(jnp.shape(nn.unbox(module.get_variable("params", name))))


def _embed_attend(module: nn.Embed, query: jax.Array, *,
                  dot_general: Callable[..., jax.Array]) -> jax.Array:
  """``nn.Embed.attend`` (``query @ embedding.T``) through ``dot_general``, the embedding as
  stored (``(vocabulary, features)``, contracted on its last dim): the SEBP backward reads it and
  writes its gradient in that layout."""
  query, embedding = module.promote_dtype(query, module.embedding, dtype=module.dtype)
  return dot_general(query, embedding, (((query.ndim - 1,), (1,)), ((), ())))
