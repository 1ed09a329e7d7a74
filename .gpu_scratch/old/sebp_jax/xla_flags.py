"""XLA:GPU flags under which SEBP's crossover conditional stops costing memsets.

SEBP decides at run time whether a step (:func:`sebp_jax.sebp_value_and_grad`) or a layer
(:func:`sebp_jax.sebp_matmul`'s crossover) takes the sparse or the dense backward: a
``lax.cond``. By default XLA:GPU keeps conditionals out of its command buffers (CUDA graphs),
and on an H100 (jax 0.11.2) a step inside one then carries large device memsets next to cuDNN's
fused-attention calls that the same step without the conditional does not: 0.6 ms of a 17.6 ms
BERT-base b32 loss-and-gradients call (glue_sst2), 1.8 ms of LLaMA-3.2-3B's at batch 1. With
conditionals and loops captured in command buffers (:data:`COMMAND_BUFFER_FLAGS`) they are gone
and that call takes 19.8 ms instead of 21.1 (row plan, wall; GPU busy 16.7 instead of 17.6). The
whole training step did not follow in the one benchmark run made (``benchmarks/NOTES.md``, "v9"),
so the flags are opt-in: the model benchmarks' ``-cmdbuf`` variants run dense, the bound and the
row plan under them beside the same variants without, and ``benchmarks.profile_step`` takes
``--xla-command-buffers``; result files and ``sebp finetune``'s report name the ``XLA_FLAGS``
they ran with.

The flags are process-wide and read once, when JAX creates its GPU backend, so this module only
edits ``XLA_FLAGS``; it never imports JAX's backend itself:

>>> from sebp_jax.xla_flags import with_command_buffer_flags
>>> with_command_buffer_flags("--xla_gpu_graph_min_graph_size=4")
'--xla_gpu_graph_min_graph_size=4 --xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE'
"""

from __future__ import annotations

import os

__all__ = ["COMMAND_BUFFER_FLAGS", "with_command_buffer_flags", "backends_started",
           "enable_command_buffers"]

# Conditionals and while loops join the default command-buffer kinds (the "+" adds to XLA's
# defaults), and any run of one or more commands becomes a graph (XLA's default minimum, 5,
# left the SEBP step's branches out: measured, no change with "+CONDITIONAL" alone).
COMMAND_BUFFER_FLAGS = ("--xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE",
                        "--xla_gpu_graph_min_graph_size=1")


def _option(flag: str) -> str:
  return flag.split("=", 1)[0]


def with_command_buffer_flags(xla_flags: str) -> str:
  """``xla_flags`` (an ``XLA_FLAGS`` value) with :data:`COMMAND_BUFFER_FLAGS` appended, except
  the options it sets already: the caller's own choice wins."""
  given = {_option(flag) for flag in xla_flags.split()}
  added = [flag for flag in COMMAND_BUFFER_FLAGS if _option(flag) not in given]
  return " ".join(xla_flags.split() + added)


def backends_started() -> bool:
  """Whether JAX has created its backends (after which ``XLA_FLAGS`` is no longer read)."""
  import sys

  xla_bridge = sys.modules.get("jax._src.xla_bridge")
  started = getattr(xla_bridge, "backends_are_initialized", None)
  return bool(started and started())


def enable_command_buffers() -> str:
  """Add :data:`COMMAND_BUFFER_FLAGS` to ``os.environ["XLA_FLAGS"]`` (keeping the options set
  there) and return the new value. Call it before the first JAX computation.

  Raises:
    RuntimeError: JAX's backends exist already, so the flags could no longer take effect.
  """
  if backends_started():
    raise RuntimeError(
      "enable_command_buffers() must run before the first JAX computation: XLA_FLAGS is read "
      "once, when JAX creates its backends, and they exist already in this process")
  os.environ["XLA_FLAGS"] = with_command_buffer_flags(os.environ.get("XLA_FLAGS", ""))
  return os.environ["XLA_FLAGS"]
