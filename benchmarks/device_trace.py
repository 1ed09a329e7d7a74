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

__all__ = ["PHASES", "gpu_kernel_events", "implausible_cut", "instruction_phases", "is_backward",
           "kernel_sides", "phase_times", "traced_events", "traced_phase_times"]


# `%name = ... op_name="..."`: any instruction of an optimized HLO module (a fusion, a cuBLAS or
# Pallas custom call, one inside a conditional's branch) and the model op it came from.
_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%([\w.\-]+) = [^\n]*?op_name="([^"]+)"', re.M)
# What :func:`phase_times` gives: GPU time of the forward's and the backward's kernels, and of
# the kernels among them whose own instruction says the other phase (included in the two).
PHASES = ("forward", "backward", "misplaced")


def is_backward(op_name: str) -> bool:
  """Whether an ``op_name`` is autodiff's transpose: ``jit(f)/transpose(jvp(Model))/...``, a
  ``custom_vjp``'s backward rule included (``transpose(jvp(sebp_dx))/pallas_call``)."""
  return any(segment.startswith("transpose(") for segment in op_name.split("/")[1:])


def instruction_phases(hlo: str) -> dict[str, str]:
  """Instruction name → ``"forward"`` or ``"backward"`` (:func:`is_backward` of its
  ``op_name``) for every instruction of an optimized HLO module that has an ``op_name``."""
  return {name: "backward" if is_backward(op_name) else "forward"
          for name, op_name in _INSTRUCTION.findall(hlo)}


def phase_times(sides: Iterable[tuple[dict, str, bool]], calls: int) -> dict[str, float]:
  """GPU ms per call of a loss-and-gradients program's forward and backward, by :data:`PHASES`:
  the kernels of each side of :func:`kernel_sides`' cut (``sides``, ``calls`` program calls),
  and ``misplaced``, those among them whose own instruction names the other side.

  The backward timed on the device, inside the program that runs it, not as that program less a
  forward program timed alone (which XLA compiles and schedules as another program:
  benchmarks/NOTES.md, "v41").
  """
  totals = dict.fromkeys(PHASES, 0.0)
  for event, side, misplaced in sides:
    ms = event.get("dur", 0.0) / 1e3 / calls
    totals[side] += ms
    if misplaced:
      totals["misplaced"] += ms
  return totals


# How much more GPU time a cut may give the forward than its forward program takes on the host.
# Measured: 0.78-1.00 of it (BERT-base and LLaMA-3.2-3B, results/v43_h200, v44_h200); a cut that
# went wrong gave 1.57 (dense LLaMA b4, benchmarks/NOTES.md "v44").
_FORWARD_SLACK = 1.15


def implausible_cut(phases: dict[str, float], forward_ms: float) -> str | None:
  """Why :func:`phase_times`' cut cannot be right, or ``None``: the forward's kernels inside the
  loss-and-gradients program (``phases["forward"]``) cannot take more GPU time than the forward
  program timed alone on the host (``forward_ms``, launches and gaps included) by more than
  the few per cent by which XLA schedules the two differently. Past that, backward kernels
  landed on the forward's side of the cut, and the backward's GPU time is short by as much."""
  if phases["forward"] <= _FORWARD_SLACK * forward_ms:
    return None
  return (f"the cut gave the forward {phases['forward']:.2f} ms of GPU time, more than "
          f"{_FORWARD_SLACK:g} x the forward program's {forward_ms:.2f} ms on the host: backward "
          f"kernels on the forward's side")


def kernel_sides(events: Iterable[dict], phases: dict[str, str], calls: int,
                 ) -> list[tuple[dict, str, bool]]:
  """``(event, side, misplaced)`` of each kernel event in the order they ran: the side of the
  cut it ran on, ``"forward"`` or ``"backward"``, and whether its own instruction names the
  other side.

  Each call runs its forward, then its backward: the kernels, in the order they ran, are cut
  into ``calls`` forward and backward stretches where the least GPU time lands on the side its
  own instruction does not say. A kernel's own phase is its instruction's (``phases``,
  :func:`instruction_phases`), found by the event's ``hlo_op`` or by the kernel's name, which is
  its fusion's (kernels replayed from a CUDA graph name the command buffer as their
  ``hlo_op``); cuBLAS's, a Pallas call's and XLA's copies name none and go with the stretch
  they ran in. Why a cut and not each kernel's own phase (NOTES, "The backward on the device,
  first run"): XLA launches one kernel for identical fusions and names it after the first, so a
  forward fusion that the backward recomputes runs under a forward name, and it schedules work
  that depends on no activation (the loss mask's gradient) inside the forward. ``events``:
  kernel events (:func:`gpu_kernel_events`) of ``calls`` calls of one program.
  """
  by_kernel_name = {name.replace(".", "_"): phase for name, phase in phases.items()}
  kernels = sorted(events, key=lambda e: e.get("ts", 0.0))
  own = [_own_phase(e, phases, by_kernel_name) for e in kernels]
  stretches = _cut(own, [e.get("dur", 0.0) for e in kernels], calls)
  sides = ["backward" if stretch % 2 else "forward" for stretch in stretches]
  return [(e, side, phase not in (None, side)) for e, side, phase in zip(kernels, sides, own)]


def _own_phase(event: dict, phases: dict[str, str], by_kernel_name: dict[str, str]) -> str | None:
  # Nested annotations (a kernel of a fusion inside a while loop's body) list every level,
  # outermost first, joined by "::"; the innermost one with an op name decides.
  ops = (event.get("args") or {}).get("hlo_op", "").split("::")
  return next((phases[op] for op in reversed(ops) if op in phases),
              by_kernel_name.get(event.get("name", "")))


def _cut(own: list[str | None], durations: list[float], calls: int) -> list[int]:
  """The stretch (0, 1, ..., 2 ``calls`` - 1: forward, backward, forward, ...) of each kernel
  that puts the least time against its own phase; of equal cuts, the latest (a kernel with no
  phase of its own before the first backward one stays in the forward)."""
  stretches = 2 * calls
  inf = float("inf")
  cost = [0.0] + [inf] * (stretches - 1)  # best cost of the kernels so far, ending in stretch s
  came_from = []
  for phase, ms in zip(own, durations):
    step, origin = [], []
    for s in range(stretches):
      stay, advance = cost[s], cost[s - 1] if s else inf
      # Of equal costs, entering stretch s at this kernel: the cut as late as it can be.
      best, source = (advance, s - 1) if advance <= stay else (stay, s)
      against = ms if phase is not None and phase != ("backward" if s % 2 else "forward") else 0.0
      step.append(best + against)
      origin.append(source)
    cost = step
    came_from.append(origin)
  s = min(range(stretches), key=lambda t: (cost[t], -t))  # a trace cut short ends early
  path = []
  for origin in reversed(came_from):
    path.append(s)
    s = origin[s]
  return path[::-1]


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
  if not events:
    return None
  return phase_times(kernel_sides(events, instruction_phases(hlo), calls), calls)
