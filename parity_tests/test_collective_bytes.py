"""``benchmarks.collective_bytes``: what the collectives of a compiled FSDP program move."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from benchmarks.collective_bytes import collective_bytes

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_bytes_of_each_kind_from_hlo_text():
  text = "\n".join([
    "%a = bf16[4,8]{1,0} all-gather(bf16[2,8]{1,0} %p), dimensions={0}",
    "%b = (f32[16]{0}, bf16[2,3]{1,0}) all-reduce(f32[16]{0} %q, bf16[2,3]{1,0} %r)",
    "%c = f32[4]{0} reduce-scatter(f32[8]{0} %s), dimensions={0}",
    "%e = f32[1024,1024]{1,0} dot(f32[1024,4]{1,0} %x, f32[4,1024]{1,0} %y)",
  ])
  assert collective_bytes(text) == {"all-gather": 64, "all-reduce": 76, "reduce-scatter": 16}


def test_sebp_adds_no_bytes_but_the_tied_heads_under_fsdp(tmp_path):
  """LLaMA-3.2-3B's exact layer shapes (1 decoder layer), FSDP over 2 CPU devices, compiled
  only: SEBP on every decoder Dense moves exactly dense's collective bytes."""
  env = dict(os.environ, PYTHONPATH=str(REPO))
  done = subprocess.run([sys.executable, "-m", "benchmarks.collective_bytes", "--devices", "2",
                         "--llama-layers", "1", "--out-dir", str(tmp_path)], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  result = json.loads((tmp_path / "collective_bytes_l1.json").read_text())
  variants = result["variants"]
  assert sum(variants["dense"].values()) > 0
  assert variants["sebp-dense-head"] == variants["dense"]
  assert "| sebp-dense-head |" in (tmp_path / "collective_bytes_l1.md").read_text()
