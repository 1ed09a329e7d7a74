"""The package metadata: a user's GPU machine keeps its torch, and the base install needs none.

Published extras ask for ranges of torch, never one build (``==`` would replace a user's CUDA torch
with whatever build pip finds); CI's pinned CPU build lives in the Makefile and must satisfy every
range, or pip would fetch a multi-GB CUDA build next to it. ``import sebp_jax`` must work without
torch, triton or transformers installed.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import textwrap
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
NAME = canonicalize_name(PROJECT["name"])
EXTRAS = PROJECT["optional-dependencies"]
TORCH_STACK = ("torch", "triton", "transformers", "accelerate")


def requirements(extra: str | None) -> list[Requirement]:
  """The requirements of the base install (``None``) or of an extra, with the project's own
  extras (``sebp[torch]``) expanded."""
  found = []
  for line in PROJECT["dependencies"] if extra is None else EXTRAS[extra]:
    req = Requirement(line)
    if canonicalize_name(req.name) == NAME:
      found += [r for e in sorted(req.extras) for r in requirements(e)]
    else:
      found.append(req)
  return found


def named(reqs: list[Requirement], name: str) -> list[Requirement]:
  return [r for r in reqs if canonicalize_name(r.name) == name]


def ci_torch_version() -> str:
  pins = re.findall(r"^CI_TORCH\s*:=\s*torch==(\S+)\s*$",
                    (ROOT / "Makefile").read_text(encoding="utf-8"), re.MULTILINE)
  assert len(pins) == 1, "the Makefile pins CI's torch once, as CI_TORCH := torch==<version>"
  return pins[0]


def test_base_install_needs_no_torch_stack():
  base = {canonicalize_name(r.name) for r in requirements(None)}
  assert not base & set(TORCH_STACK), base & set(TORCH_STACK)


def test_no_published_extra_pins_torch():
  for extra in EXTRAS:
    for req in named(requirements(extra), "torch"):
      pinned = [s for s in req.specifier if s.operator in ("==", "===")]
      assert not pinned, f"extra [{extra}] pins torch: {req}"
      assert req.specifier, f"extra [{extra}] asks for torch without a lower bound: {req}"


def test_ci_torch_pin_satisfies_every_extra():
  version = ci_torch_version()
  for extra in EXTRAS:
    for req in named(requirements(extra), "torch"):
      assert req.specifier.contains(version, prereleases=True), (
          f"the Makefile's torch=={version} does not satisfy [{extra}]'s {req}: pip would "
          "install another torch next to it")


def test_extras_users_install():
  assert named(requirements("torch"), "torch"), "[torch] brings the reference's torch"
  gpu_jax = named(requirements("gpu"), "jax")
  assert gpu_jax and any(re.fullmatch(r"cuda\d+", e) for r in gpu_jax for e in r.extras), (
      "[gpu] names jax's CUDA plugin extra, e.g. jax[cuda12]")
  dev = {canonicalize_name(r.name) for r in requirements("dev")}
  assert {"torch", "pytest"} <= dev, "[dev] installs what the test suite imports"


def test_sebp_jax_imports_without_torch():
  """Importing every module of sebp_jax loads nothing of the torch stack (it is imported only
  inside the functions that convert torch models)."""
  script = textwrap.dedent("""
      import importlib, pkgutil, sys
      import sebp_jax
      for module in pkgutil.walk_packages(sebp_jax.__path__, "sebp_jax."):
        importlib.import_module(module.name)
      print(" ".join(sorted({name.split(".")[0] for name in sys.modules})))
      """)
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
  result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  loaded = set(result.stdout.split())
  assert "sebp_jax" in loaded
  assert not loaded & set(TORCH_STACK), f"importing sebp_jax loads {loaded & set(TORCH_STACK)}"
