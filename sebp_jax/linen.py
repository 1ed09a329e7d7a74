"""flax.linen integration: ``SEBPDense`` and ``swap_dense``.

Both rest on one fact: ``nn.Dense`` does its matmul through a ``dot_general`` it can be given, and
SEBP lives entirely inside that matmul (:class:`sebp_jax.matmul.SEBPDotGeneral`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Iterator

import flax.linen as nn
import jax

from sebp_jax.matmul import SEBPDotGeneral
from sebp_jax.plan import RowPlan
from sebp_jax.policy import RowPolicy

__all__ = ["SEBPDense", "swap_dense", "swap_dot_general"]

ModulePath = tuple[str, ...]


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
    if self.dot_general_cls is not None or not (
        self.dot_general is None or isinstance(self.dot_general, SEBPDotGeneral)):
      raise ValueError(
        "SEBPDense: `dot_general` and `dot_general_cls` are SEBP's own; leave them unset.")
    # The SEBP matmul is Dense's own dot_general hook, so Dense's __call__ runs unchanged. Set on
    # every construction (clones included) from `policy`, `impl` and `crossover`.
    object.__setattr__(self, "dot_general",
                       SEBPDotGeneral(self.policy, self.impl, self.crossover))
    super().__post_init__()


@contextlib.contextmanager
def swap_dense(
  policy: RowPolicy = RowPolicy(),
  *,
  where: Callable[[ModulePath], bool] | None = None,
  impl: str = "auto",
  crossover: float | None = None,
  rows: RowPlan | None = None,
) -> Iterator[None]:
  """Run every ``nn.Dense`` called inside the block with the SEBP backward.

  The model is not modified: the swap applies to calls *traced* while the context is open. Enter
  it inside the function you ``jit`` (or jit inside it): a function jitted and traced outside the
  context reuses its cached dense program when called inside, since jit cannot see the context.
  Parameters are untouched, so the same params serve the dense and the SEBP model. A Dense with
  its own ``dot_general`` (quantised matmuls, say) is left as it is. ``nn.Embed.attend``, the
  output projection of models with tied embeddings (often their largest matmul), is swapped too;
  its path ends in ``"attend"``.

  Args:
    policy: which output-gradient rows to keep.
    where: predicate on the module path, e.g. ``("encoder", "layer_3", "intermediate", "dense")``,
      choosing the layers that get SEBP; ``None`` selects every Dense.
    impl: the backward's backend, as in :func:`sebp_jax.sebp_matmul`.
    crossover: the kept-row fraction above which the dense backward runs instead, as in
      :func:`sebp_jax.sebp_matmul` (``1.0``: never, no conditional compiled).
    rows: a row plan made once per step (:func:`sebp_jax.row_plan` of the batch's mask), shared
      by every layer whose input's leading dims are the mask's: those layers skip their score
      read and partition. Exact policy only; see :func:`sebp_jax.sebp_matmul`.

  >>> import jax, jax.numpy as jnp
  >>> import flax.linen as nn
  >>> model = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(2)])
  >>> x = jnp.ones((4, 3))
  >>> params = model.init(jax.random.key(0), x)
  >>> with swap_dense(where=lambda path: path[-1] == "layers_2"):
  ...   grads = jax.grad(lambda p: model.apply(p, x).sum())(params)
  """
  with swap_dot_general(SEBPDotGeneral(policy, impl, crossover, rows), where=where):
    yield


@contextlib.contextmanager
def swap_dot_general(
  dot_general: Callable[..., jax.Array],
  *,
  where: Callable[[ModulePath], bool] | None = None,
) -> Iterator[None]:
  """Run every ``nn.Dense`` and ``nn.Embed.attend`` traced inside the block through
  ``dot_general`` (a ``lax.dot_general`` replacement): the mechanism of :func:`swap_dense`.

  The same rules as :func:`swap_dense`: a Dense with its own ``dot_general`` (or a subclass of
  Dense, such as :class:`SEBPDense`) keeps it; ``where`` selects layers by module path, the tied
  output projection's path ending in ``"attend"``.
  """

  def selected(path: ModulePath) -> bool:
    return where is None or where(path)

  def named(path: ModulePath) -> Callable[..., jax.Array]:
    # A checking row plan names the layer it catches.
    if isinstance(dot_general, SEBPDotGeneral) and dot_general.rows is not None:
      return dataclasses.replace(dot_general, name="/".join(path) or "<unnamed Dense>")
    return dot_general

  def interceptor(next_fun, args, kwargs, context):
    module, method = context.module, context.method_name
    if (type(module) is nn.Dense  # subclasses (SEBPDense among them) keep their own matmul
        and method == "__call__"
        and module.dot_general is None
        and module.dot_general_cls is None
        and selected(tuple(module.path))):
      # Dense reads its `dot_general` field in __call__: set it for this call only.
      object.__setattr__(module, "dot_general", named(tuple(module.path)))
      try:
        return next_fun(*args, **kwargs)
      finally:
        object.__setattr__(module, "dot_general", None)
    if (isinstance(module, nn.Embed) and method == "attend"
        and selected((*module.path, "attend"))):
      return _embed_attend(module, *args, dot_general=named((*module.path, "attend")), **kwargs)
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(interceptor):
    yield


def _embed_attend(module: nn.Embed, query: jax.Array, *,
                  dot_general: Callable[..., jax.Array]) -> jax.Array:
  """``nn.Embed.attend`` (``query @ embedding.T``) through ``dot_general``."""
  query, embedding = module.promote_dtype(query, module.embedding, dtype=module.dtype)
  return dot_general(query, embedding.T, (((query.ndim - 1,), (0,)), ((), ())))
