"""Per-step settings that eager code and code under ``torch.compile`` both read.

:func:`~sebp_torch_ref.row_plan` and :func:`~sebp_torch_ref.dense_backward` keep their state in a
``ContextVar`` (copied into asyncio tasks and ``contextvars.copy_context``), but Dynamo cannot
call ``ContextVar.get`` (a graph break). It does read an attribute of a ``threading.local`` and
guards on it, per thread: a step under another setting runs the graph traced under that one, and
a new value of the same kind (a row plan's new mask tensor) reuses the graph with the value as its
input. :class:`TracedContextVar` keeps the two side by side; eager code reads the ``ContextVar``
alone, traced code the per-thread view, which, unlike the ``ContextVar``, is not copied into
asyncio tasks or ``copy_context``.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from typing import Any, Callable, Iterator

__all__ = ["TracedContextVar"]


class _View(threading.local):
    def __init__(self, default: Any) -> None:  # run again in each thread, with the same default
        self.value = default


class TracedContextVar:
    """A ``ContextVar`` and its per-thread view for traced code (see the module docstring)."""

    def __init__(self, name: str, default: Any) -> None:
        self._var = contextvars.ContextVar(name, default=default)
        self._view = _View(default)

    def get(self, traced: bool = False) -> Any:
        """The value; ``traced``: as code under ``torch.compile`` must read it."""
        return self._view.value if traced else self._var.get()

    @contextlib.contextmanager
    def bound(self, update: Callable[[Any], Any]) -> Iterator[None]:
        """Inside, each of the two holds ``update`` of the value it held before."""
        outer = self._view.value
        token = self._var.set(update(self._var.get()))
        self._view.value = update(outer)
        try:
            yield
        finally:
            self._var.reset(token)
            self._view.value = outer
