"""How much of a device's collective (NCCL) time is exposed: not hidden behind compute.

A collective kernel overlaps compute when another stream of the same device runs a compute
kernel at the same moment. The exposed time of a device is the measure of
``union(collective intervals) - union(compute intervals)``, summed over the trace.
"""

from __future__ import annotations

from typing import Iterable, Sequence

__all__ = ["COLLECTIVE_NEEDLES", "is_collective", "union", "exposed_ms"]

COLLECTIVE_NEEDLES = ("nccl", "all-gather", "allgather", "reduce-scatter", "reducescatter",
                       "all-reduce", "allreduce", "all_gather", "reduce_scatter", "all_reduce")


def is_collective(name: str) -> bool:
  """Whether a GPU kernel's name marks it as a collective (NCCL) kernel."""
  lowered = name.lower()
  return any(needle in lowered for needle in COLLECTIVE_NEEDLES)


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
  """Sorted, disjoint ``(start, end)`` intervals covering the same points as ``intervals``."""
  merged: list[list[float]] = []
  for start, end in sorted(intervals):
    if merged and start <= merged[-1][1]:
      merged[-1][1] = max(merged[-1][1], end)
    else:
      merged.append([start, end])
  return [(s, e) for s, e in merged]


def exposed_ms(events: Sequence[dict]) -> float:
  """Collective time (ms) during which no compute kernel runs; ``events``: one device's
  complete kernel events (``name``, ``ts`` and ``dur`` in µs), any streams."""
  spans = [(e["ts"], e["ts"] + e["dur"], is_collective(e["name"])) for e in events]
  collective = union((s, t) for s, t, c in spans if c)
  compute = union((s, t) for s, t, c in spans if not c)
  exposed, j = 0.0, 0
  for start, end in collective:
    covered = 0.0
    while j < len(compute) and compute[j][1] <= start:
      j += 1
    k = j
    while k < len(compute) and compute[k][0] < end:
      covered += min(end, compute[k][1]) - max(start, compute[k][0])
      k += 1
    exposed += (end - start) - covered
  return exposed / 1e3
