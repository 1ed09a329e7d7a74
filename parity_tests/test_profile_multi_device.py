"""benchmarks.profile_multi_device: its per-device breakdown on hand-made trace events, and a tiny
run on two CPU devices."""

from __future__ import annotations

import gzip
import json
import os
import pathlib
import subprocess
import sys

import pytest

from benchmarks import profile_multi_device

REPO = pathlib.Path(__file__).resolve().parents[1]


def _kernel(pid, name, ts, dur, tid=1):
  return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}


def test_device_breakdown_per_device_and_step():
  # Two steps on two devices (µs). Device 1: a GEMM 0-1000, an all-gather on another stream
  # 800-1500 and a fusion 1400-1600, which cover 200 + 100 of the all-gather's 700; device 2: a
  # reduce-scatter 0-400 with no compute beside it, and a fusion 500-700.
  events = [
    _kernel(1, "nvjet_sm90_tst_128x128", 0, 1000),
    _kernel(1, "ncclDevKernel_AllGather_RING_LL", 800, 700, tid=2),
    _kernel(1, "loop_add_fusion", 1400, 200),
    _kernel(2, "ncclDevKernel_ReduceScatter_RING_LL", 0, 400, tid=2),
    _kernel(2, "loop_add_fusion", 500, 200),
  ]
  first, second = profile_multi_device.device_breakdown(events, steps=2)
  assert first["device"] == 1 and second["device"] == 2
  # Busy is the union of the kernels' intervals (0-1600), not their sum (1900).
  assert first["busy_ms"] == pytest.approx(1.6 / 2)
  assert first["collective_ms"] == pytest.approx(0.7 / 2)
  assert first["exposed_collective_ms"] == pytest.approx(0.4 / 2)  # 1000-1400
  assert first["launches"] == pytest.approx(1.5)
  assert first["families"] == pytest.approx({"GEMM (cuBLAS)": 0.5, "collectives (NCCL)": 0.35,
                                             "XLA fusions, other": 0.1})
  assert second["exposed_collective_ms"] == pytest.approx(0.2)
  assert second["busy_ms"] == pytest.approx(0.3)
  # Kernels by name, longest first, per step.
  assert [name for name, _ in first["kernels"]] == [
    "nvjet_sm90_tst_128x128", "ncclDevKernel_AllGather_RING_LL", "loop_add_fusion"]
  assert [ms for _, ms in first["kernels"]] == pytest.approx([0.5, 0.35, 0.1])


def test_breakdown_keeps_the_longest_kernels_only():
  events = [_kernel(0, f"fusion_{i}", 10 * i, i + 1) for i in range(30)]
  (device,) = profile_multi_device.device_breakdown(events, steps=1)
  names = [name for name, _ in device["kernels"]]
  assert names == [f"fusion_{i}" for i in range(29, 29 - profile_multi_device.TOP_KERNELS, -1)]


def test_markdown_names_every_device_and_family():
  row = {"model": "llama", "parallelism": "fsdp", "per_device_batch": 2, "workload": "piqa",
         "active_fraction": 0.02, "variant": "sebp", "step_ms": 10.0, "step_ms_min": 9.0,
         "step_ms_max": 11.0,
         "per_device": profile_multi_device.device_breakdown(
           [_kernel(0, "ncclDevKernel_AllGather", 0, 500), _kernel(1, "sebp_dx", 0, 300)], 1)}
  text = profile_multi_device.markdown({"devices": 2, "gpu": "GPU", "steps": 1, "note": "",
                                        "rows": [row], "xla_flags": ""})
  assert "XLA_FLAGS: `(none)`." in text
  assert "| sebp | 10.00 (9.00–11.00) | 0 | 0.50 | 0.50 | 0.50 | 1 |" in text
  assert "| sebp | 10.00 (9.00–11.00) | 1 | 0.30 | 0.00 | 0.00 | 1 |" in text
  assert "| collectives (NCCL) | 0.50 |" in text
  assert "| `ncclDevKernel_AllGather` | 0.50 |" in text


def test_tiny_scanned_run_on_two_cpu_devices_writes_its_tables_and_programs(tmp_path):
  # The model options are multi_device's own (a scanned LLaMA, its tied head left dense); on CPU
  # the trace has no GPU kernel, so the rows hold wall times and the programs' HLO only.
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=2",
             PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
  done = subprocess.run([sys.executable, "-m", "benchmarks.profile_multi_device", "--tiny",
                         "--models", "llama", "--scan-layers", "--dense-head", "--hlo",
                         "--steps", "1", "--tag", "t", "--out-dir", str(tmp_path)],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  result = json.loads((tmp_path / "profile_multi_device_tiny_t.json").read_text())
  assert [(r["variant"], r["devices"]) for r in result["rows"]] == [("dense", 2), ("sebp", 2)]
  assert all(r["step_ms"] > 0 for r in result["rows"])
  for variant in ("dense", "sebp"):
    hlo = gzip.decompress(
      (tmp_path / f"hlo_profile_multi_device_tiny_t_llama_{variant}.txt.gz").read_bytes()).decode()
    assert " while(" in hlo and "all-gather" in hlo  # the scanned layers, their FSDP gathers
