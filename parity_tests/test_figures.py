"""``benchmarks/figures.py``: which panels a model benchmark's speedup figure draws, and that the
figures of a result file render."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from benchmarks import figures  # noqa: E402


def _row(workload: str, variant: str, bwd: float, gpu_bwd: float | None = None) -> dict:
  row = dict(workload=workload, dataset=workload, framework="jax", impl=variant, variant=variant,
             batch=4, seq_len=64, active_fraction=0.1, fwd_ms=1.0, bwd_ms=bwd, opt_ms=0.5,
             step_ms=bwd + 1.5, peak_mem_bytes=100, compile_count=1, compile_s=0.0, error=None)
  if gpu_bwd is not None:  # what benchmarks.device_trace adds on a GPU
    row.update(gpu_fwd_ms=0.9, gpu_bwd_ms=gpu_bwd, gpu_misplaced_ms=0.0)
  return row


def _result(rows: list[dict]) -> dict:
  return {"benchmark": "bert", "gpu": "H200", "dtype": "bfloat16", "seq_len": 64,
          "batch_sizes": [4], "rows": rows}


def test_the_gpu_time_panel_appears_only_where_the_run_traced_the_backward():
  untraced = [_row("a", "jax-dense", 10.0), _row("a", "jax-bound", 4.0)]
  traced = [_row("a", "jax-dense", 10.0, 8.0), _row("a", "jax-bound", 4.0, 3.0)]
  # Off a GPU the traced columns exist but hold zeros: no panel of zero ratios.
  zeros = [_row("a", "jax-dense", 10.0, 0.0), _row("a", "jax-bound", 4.0, 0.0)]
  keys = lambda rows: [key for key, _ in figures._speedup_panels(rows)]  # noqa: E731
  assert keys(untraced) == keys(zeros) == ["bwd_ms", "step_ms"]
  assert keys(traced) == ["bwd_ms", "gpu_bwd_ms", "step_ms"]


@pytest.mark.parametrize("gpu_bwd", [None, 3.0])
def test_a_result_file_renders_its_three_figures(tmp_path, gpu_bwd):
  rows = [_row(w, v, b, None if gpu_bwd is None else gpu_bwd * b / 4.0)
          for w in ("a", "b") for v, b in (("jax-dense", 10.0), ("jax-bound", 4.0))]
  paths = figures.render(_result(rows), tmp_path, "bert")
  assert [p.name for p in paths] == ["bert_speedup.png", "bert_breakdown.png", "bert_memory.png"]
  assert all(p.stat().st_size > 1000 for p in paths)
