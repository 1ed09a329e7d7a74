"""flax.nnx integration: ``SEBPLinear`` and ``swap_linear``.

``nnx.Linear`` takes a ``dot_general``; SEBP lives entirely inside that matmul
(:class:`sebp_jax.matmul.SEBPDotGeneral`).
"""

from __future__ import annotations

from typing import Callable

from flax import nnx
from jax import lax

from sebp_jax.matmul import SEBPDotGeneral
from sebp_jax.policy import RowPolicy

__all__ = ["SEBPLinear", "swap_linear"]

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


def swap_linear(
  model: nnx.Module,
  policy: RowPolicy = RowPolicy(),
  *,
  where: Callable[[ModulePath], bool] | None = None,
  impl: str = "auto",
  crossover: float | None = None,
) -> int:
  """Give the ``nnx.Linear`` layers of ``model`` the SEBP backward, in place.

  Parameters are untouched. A layer with a custom ``dot_general`` of its own is left as it is.

  Args:
    model: any nnx module.
    policy: which output-gradient rows to keep.
    where: predicate on the module path (a tuple of attribute names and indices, as strings),
      choosing the layers that get SEBP; ``None`` selects every Linear.
    impl: the backward's backend, as in :func:`sebp_jax.sebp_matmul`.
    crossover: the kept-row fraction above which the dense backward runs instead, as in
      :func:`sebp_jax.sebp_matmul` (``1.0``: never, no conditional compiled).

  Returns:
    The number of layers swapped.
  """
  dot_general = SEBPDotGeneral(policy, impl, crossover)
  swapped = 0
  for path, module in nnx.iter_graph(model):
    if not isinstance(module, nnx.Linear):
      continue
    if not (module.dot_general is lax.dot_general
            or isinstance(module.dot_general, SEBPDotGeneral)):
      continue
    path = tuple(str(part) for part in path)
    if where is not None and not where(path):
      continue
    module.dot_general = dot_general
    swapped += 1
  return swapped

