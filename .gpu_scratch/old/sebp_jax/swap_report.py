"""What a swap reached: the layers :func:`sebp_jax.swap_dense` and :func:`sebp_jax.nnx.swap_linear`
gave the SEBP backward, and those they selected but had to leave dense (with the reason)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, Iterator

__all__ = ["SwappedLayer", "SwapReport", "check_where", "warn_if_nothing_selected", "warn_stays_dense"]

ModulePath = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class SwappedLayer:
  """One layer a swap selected.

  Attributes:
    path: the module path, as ``where`` sees it (``("model", "layers_0", "mlp", "up_proj")``;
      a tied output projection's ends in ``"attend"``).
    kind: the layer's class (``"Dense"``, ``"DenseGeneral"``, ``"Einsum"``, ``"Linear"``,
      ``"LinearGeneral"``) or ``"Embed.attend"``.
    kernel_shape: the weight's shape (the embedding table's for ``Embed.attend``).
    dense_reason: why the layer stays dense (its contraction is not a weight matrix product);
      ``None``: it runs the SEBP backward.
  """

  path: ModulePath
  kind: str
  kernel_shape: tuple[int, ...]
  dense_reason: str | None = None


@dataclasses.dataclass
class SwapReport:
  """The layers a swap selected, in the order it met them (each once).

  ``len(report)`` and iteration cover the layers that run SEBP (:attr:`swapped`); :attr:`dense`
  lists the selected ones that stay dense. ``print(report)`` shows a table.
  """

  layers: list[SwappedLayer] = dataclasses.field(default_factory=list)

  @property
  def swapped(self) -> list[SwappedLayer]:
    """The layers that run the SEBP backward."""
    return [layer for layer in self.layers if layer.dense_reason is None]

  @property
  def dense(self) -> list[SwappedLayer]:
    """The selected layers that stay dense, each with its ``dense_reason``."""
    return [layer for layer in self.layers if layer.dense_reason is not None]

  def add(self, layer: SwappedLayer) -> bool:
    """Records ``layer`` unless its path and kind are in already (a layer traced twice, as
    ``nn.scan`` may); returns whether it was new."""
    if any((l.path, l.kind) == (layer.path, layer.kind) for l in self.layers):
      return False
    self.layers.append(layer)
    return True

  def __len__(self) -> int:
    return len(self.swapped)

  def __iter__(self) -> Iterator[SwappedLayer]:
    return iter(self.swapped)

  def __str__(self) -> str:
    lines = [f"{len(self.swapped)} layer(s) run SEBP, {len(self.dense)} stay dense"]
    for layer in self.layers:
      status = "SEBP" if layer.dense_reason is None else f"dense: {layer.dense_reason}"
      lines.append(f"  {'/'.join(layer.path) or '<root>'}  {layer.kind}  "
                   f"{tuple(layer.kernel_shape)}  {status}")
    return "\n".join(lines)


def check_where(where, caller: str) -> None:
  """Raises ``TypeError`` unless ``where`` is ``None`` or a callable (a predicate on paths)."""
  if where is not None and not callable(where):
    raise TypeError(
      f"{caller}: `where` must be None or a callable taking a module path (a tuple of strings) "
      f"and returning a bool, e.g. `where=lambda path: path[-1] == {where!r}`; got "
      f"{type(where).__name__} {where!r}.")


def warn_if_nothing_selected(caller: str, where: Callable | None, asked: list[ModulePath],
                             report: SwapReport, stacklevel: int) -> None:
  """One warning where ``where`` was asked about layers and selected none of them;
  ``stacklevel`` counts from the caller of this function, as ``warnings.warn``'s does."""
  if where is not None and asked and not report.layers:
    shown = ", ".join("/".join(p) or "<root>" for p in asked[:5])
    more = f" and {len(asked) - 5} more" if len(asked) > 5 else ""
    warnings.warn(
      f"{caller}: `where` selected none of the {len(asked)} layer(s) it was asked about "
      f"({shown}{more}); every layer stays dense.", stacklevel=stacklevel + 1)


def warn_stays_dense(caller: str, layer: SwappedLayer, stacklevel: int) -> None:
  """The warning for a selected layer that cannot run SEBP (``stacklevel`` as above)."""
  warnings.warn(
    f"{caller}: {layer.kind} at {'/'.join(layer.path) or '<root>'} stays dense: "
    f"{layer.dense_reason}.", stacklevel=stacklevel + 1)
