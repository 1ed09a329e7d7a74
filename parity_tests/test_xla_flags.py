"""sebp_jax.xla_flags: the command-buffer flags are added to XLA_FLAGS without overriding the
caller's own options, and never after JAX's backends exist (when they could not take effect)."""

import os
import subprocess
import sys

import jax.numpy as jnp
import pytest

from sebp_jax import xla_flags


def test_flags_are_appended_to_empty_flags():
  assert xla_flags.with_command_buffer_flags("").split() == list(xla_flags.COMMAND_BUFFER_FLAGS)


def test_the_callers_own_options_win():
  given = "--xla_gpu_enable_command_buffer= --xla_dump_to=/tmp/x"
  flags = xla_flags.with_command_buffer_flags(given).split()
  assert flags[:2] == given.split()
  assert flags[2:] == ["--xla_gpu_graph_min_graph_size=1"]
  assert xla_flags.with_command_buffer_flags(" ".join(flags)).split() == flags  # idempotent


def test_enabling_after_the_backends_started_raises(monkeypatch):
  jnp.ones(1).block_until_ready()  # the backends exist in this process now
  monkeypatch.setenv("XLA_FLAGS", "")
  assert xla_flags.backends_started()
  with pytest.raises(RuntimeError, match="before the first JAX computation"):
    xla_flags.enable_command_buffers()
  assert os.environ["XLA_FLAGS"] == ""


def test_a_fresh_process_runs_with_the_flags():
  """In a new process the flags land in XLA_FLAGS before JAX starts, and JAX (CPU) accepts them."""
  code = ("from sebp_jax import xla_flags; flags = xla_flags.enable_command_buffers(); "
          "import jax, jax.numpy as jnp; assert float(jnp.ones(3).sum()) == 3.0; print(flags)")
  env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       check=True, timeout=120).stdout.split()
  assert out == list(xla_flags.COMMAND_BUFFER_FLAGS)
