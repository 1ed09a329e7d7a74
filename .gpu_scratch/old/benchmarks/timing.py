"""Device-time measurement of jitted JAX functions, free of host dispatch overhead.

Host timing of one call adds ~0.1 ms of dispatch, as much as a whole sparse backward. So one jitted
program runs the function on ``reps`` distinct input sets (distinct, so no call reads another's data
from L2 and XLA cannot merge them), and the per-call time is the slope between programs of
``reps`` and ``reps // 2`` calls: the launch and synchronisation overhead cancels.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import jax

__all__ = ["wall_ms", "device_time_ms", "loop_time_ms", "environment"]


def wall_ms(fn: Callable[[], Any]) -> float:
  """Host wall time of one ``fn()`` call until its results are ready, in milliseconds."""
  start = time.perf_counter()
  jax.block_until_ready(fn())
  return (time.perf_counter() - start) * 1e3


def device_time_ms(fn: Callable[..., Any], input_sets: Sequence[tuple], *,
                   trials: int = 15) -> float:
  """Median device time of one ``fn(*inputs)`` call, in milliseconds.

  Args:
    fn: a traceable function.
    input_sets: ``reps >= 2`` distinct argument tuples (same shapes); all stay on the device.
    trials: timed pairs of programs; the median of the per-pair slopes is taken.
  """
  reps = len(input_sets)
  if reps < 2:
    raise ValueError("device_time_ms: `input_sets` needs at least 2 argument tuples.")
  many = jax.jit(lambda sets: [fn(*args) for args in sets])
  full, half = list(input_sets), list(input_sets[: reps // 2])
  for args in (full, half, full, half):  # compile and warm up both programs
    jax.block_until_ready(many(args))
  # The two programs alternate, so a drift of clocks or of a neighbour's load hits both alike.
  slopes = [(wall_ms(lambda: many(full)) - wall_ms(lambda: many(half))) / (reps - reps // 2)
            for _ in range(trials)]
  return max(statistics.median(slopes), 0.0)


def loop_time_ms(fn: Callable[..., Any], args: Sequence[Any], *, reps: int = 20,
                 trials: int = 7, chained: int = 2) -> float:
  """Median device time of one ``fn(*args)`` call, in milliseconds: the slope between one jitted
  ``fori_loop`` run for ``reps`` and for ``2 * reps`` iterations.

  Each iteration adds zero times one element of ``fn``'s first result to element ``[0, 0]`` of
  ``args[chained]`` (``dy`` for a backward ``(x, kernel, dy)``), in place: the next call depends
  on this one, while the values, and so the kept rows, stay the same. One program serves both
  trip counts. Two traps, both measured on an H100 (benchmarks/NOTES.md, "v5"): link through any
  argument but ``dy`` and XLA hoists whatever does not depend on it out of the loop (``dW`` and
  the selection, when linking through the weight); link through ``dy`` and XLA may copy ``dy``
  once per iteration (it did when a Pallas kernel read it: +0.065 ms at BERT's FFN). Prefer
  :func:`device_time_ms`, which times distinct inputs and has neither.
  """
  import jax.numpy as jnp
  from jax import lax

  def run(trips, args):
    def body(_, carry):
      out = jax.tree.leaves(fn(*carry))[0]
      link = carry[chained]
      nudge = (out.ravel()[0] * 0).astype(link.dtype)
      return (*carry[:chained], link.at[0, 0].add(nudge), *carry[chained + 1:])
    return lax.fori_loop(0, trips, body, tuple(args))

  looped = jax.jit(run)
  for trips in (reps, 2 * reps):  # compile and warm up
    jax.block_until_ready(looped(jnp.int32(trips), args))
  slopes = [(wall_ms(lambda: looped(jnp.int32(2 * reps), args))
             - wall_ms(lambda: looped(jnp.int32(reps), args))) / reps for _ in range(trials)]
  return max(statistics.median(slopes), 0.0)


def environment() -> dict:
  """Device and library versions, for the header of every result file."""
  import flax
  import jaxlib

  device = jax.devices()[0]
  return {
    "device": getattr(device, "device_kind", str(device)),
    "platform": device.platform,
    "versions": {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__},
  }
