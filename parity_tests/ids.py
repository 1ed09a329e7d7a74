"""Readable test ids that are the same in every process (pytest-xdist collects once per worker)."""

from __future__ import annotations

from typing import Any

__all__ = ["kwargs_id"]


def _value_id(value: Any) -> str:
  if callable(value) and hasattr(value, "__qualname__"):  # no memory address in the id
    return value.__qualname__.replace(".<locals>", "")
  return getattr(value, "__name__", None) or str(value)


def kwargs_id(kwargs: dict[str, Any]) -> str:
  """``{"features": 4, "kernel_init": normal(0.3)}`` -> ``"features=4,kernel_init=normal.init"``."""
  return ",".join(f"{key}={_value_id(value)}" for key, value in kwargs.items()) or "defaults"
