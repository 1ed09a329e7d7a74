"""Reading ``jax.profiler`` traces of a jitted program: its GPU kernels, and which of them the
forward runs and which the backward.

:func:`phase_times` times a loss-and-gradients program's backward on the device, inside that one
program: each kernel event names the HLO instruction that launched it (``hlo_op``), and the
instruction's ``op_name`` in the optimized module says whether its model op is autodiff's
transpose. The alternative, that program less a forward program timed alone, subtracts a
program that XLA compiles and schedules on its own (benchmarks/NOTES.md, "v41").
"""

from __future__ import annotations

import gzip
import json
import pathlib
import re
import tempfile
from typing import Any, Callable, Iterable

__all__ = ["PHASES", "gpu_kernel_events", "instruction_phases", "is_backward", "phase_times",
           "traced_events", "traced_phase_times"]


# `%name = ... op_name="..."`: any instruction of an optimized HLO module (a fusion, a cuBLAS or
# Pallas custom call, one inside a conditional's branch) and the model op it came from.
_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%([\w.\-]+) = [^\n]*?op_name="([^"]+)"', re.M)
# What :func:`phase_times` sorts GPU time into.
PHASES = ("forward", "backward", "unattributed")


def is_backward(op_name: str) -> bool:
  """Whether an ``op_name`` is autodiff's transpose: ``jit(f)/transpose(jvp(Model))/...``, a
  ``custom_vjp``'s backward rule included (``transpose(jvp(sebp_dx))/pallas_call``)."""
  return any(segment.startswith("transpose(") for segment in op_name.split("/")[1:])


def instruction_phases(hlo: str) -> dict[str, str]:
  """Instruction name → ``"forward"`` or ``"backward"`` (:func:`is_backward` of its
  ``op_name``) for every instruction of an optimized HLO module that has an ``op_name``."""
  return {name: "backward" if is_backward(op_name) else "forward"
          for name, op_name in _INSTRUCTION.findall(hlo)}


def phase_times(events: Iterable[dict], phases: dict[str, str], calls: int) -> dict[str, float]:
  """GPU ms per call of the forward's and the backward's kernels, by :data:`PHASES`.

  The backward of a loss-and-gradients program timed on the device, not as that program less a
  forward program timed alone (which XLA compiles as another program: benchmarks/NOTES.md,
  "v41"). A kernel event's ``hlo_op`` names the instruction that launched it, whose phase
  ``phases`` (:func:`instruction_phases`) gives; an event without one, or of an instruction
  without an ``op_name`` (XLA's own copies), counts as ``"unattributed"``. ``events``: kernel events
  (:func:`gpu_kernel_events`) of ``calls`` program calls.
  """
  totals = dict.fromkeys(PHASES, 0.0)
  for e in events:
    # Nested annotations (a kernel of a fusion inside a while loop's body) list every level,
    # outermost first, joined by "::"; the innermost one with an op name decides.
    ops = (e.get("args") or {}).get("hlo_op", "").split("::")
    phase = next((phases[op] for op in reversed(ops) if op in phases), "unattributed")
    totals[phase] += e.get("dur", 0.0) / 1e3 / calls
  return totals


def gpu_kernel_events(events: Iterable[dict]) -> list[dict]:
  """The kernel events of a trace's device timelines: complete events (``"ph": "X"``) of
  processes whose name contains ``GPU`` (one process per device, its ``pid``), except on threads
  that annotate XLA modules or ops, which span the kernels they launch."""
  events = list(events)
  processes = {e["pid"]: e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "process_name"}
  threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
  return [e for e in events
          if e.get("ph") == "X" and "GPU" in processes.get(e.get("pid"), "")
          and "XLA" not in threads.get((e.get("pid"), e.get("tid")), "")]


def _trace_events(trace_dir: pathlib.Path) -> list[dict]:
  files = sorted(trace_dir.rglob("perfetto_trace.json.gz"))
  if not files:
    raise RuntimeError(f"jax.profiler wrote no perfetto trace under {trace_dir}")
  with gzip.open(files[-1]) as f:
    trace = json.load(f)
  return trace["traceEvents"] if isinstance(trace, dict) else trace


def traced_events(run: Callable[[], Any]) -> list[dict]:
  """The trace events of what ``run()`` launches, traced with ``jax.profiler``; ``run`` must
  block until its results are ready."""
  import jax

  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      run()
    return _trace_events(pathlib.Path(trace_dir))


def traced_phase_times(run: Callable[[], Any], hlo: str, calls: int) -> dict[str, float] | None:
  """:func:`phase_times` of the GPU kernels that ``run()`` launches (``calls`` calls of the
  program whose optimized HLO is ``hlo``; ``run`` must block until its results are ready), or
  ``None`` where the trace holds no GPU kernel (a CPU)."""
  events = gpu_kernel_events(traced_events(run))
  return phase_times(events, instruction_phases(hlo), calls) if events else None
