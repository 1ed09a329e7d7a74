"""Runs a test module's Triton cases on CPU in a fresh process under ``TRITON_INTERPRET=1``.

Triton reads ``TRITON_INTERPRET`` when it is imported, so the interpreter cases cannot run in the
process that collected the module: each module that has them carries one launcher test calling
:func:`run_triton_cases`, skipped inside the interpreter process itself (``INTERPRET``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

__all__ = ["INTERPRET", "run_triton_cases"]

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def run_triton_cases(test_file: str, selection: str) -> None:
  """Runs ``test_file``'s cases that ``-k selection`` picks under the interpreter; fails unless
  some ran and none failed."""
  pytest.importorskip("triton")
  env = dict(os.environ, TRITON_INTERPRET="1")
  cmd = [sys.executable, "-m", "pytest", test_file, "-q", "-x", "-p", "no:cacheprovider", "-k",
         selection]
  result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
  assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
  assert " passed" in result.stdout and " failed" not in result.stdout
