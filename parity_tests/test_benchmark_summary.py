"""``benchmarks/summary.py``: the README's ranges, against values worked out by hand."""

from __future__ import annotations

import pytest

from benchmarks import summary


def _row(workload: str, variant: str, *, bwd: float, step: float, mem: int | None = 100,
         active: float = 0.1, error: str | None = None) -> dict:
  return dict(workload=workload, dataset=workload, framework=variant.split("-")[0],
              impl=variant, variant=variant, batch=4, seq_len=64, active_fraction=active,
              fwd_ms=1.0, bwd_ms=bwd, opt_ms=step - bwd - 1.0, step_ms=step,
              peak_mem_bytes=mem, compile_count=1, compile_s=0.0, error=error)


RESULT = {"benchmark": "llama", "gpu": "H200", "dtype": "bfloat16", "seq_len": 64, "rows": [
  _row("a", "jax-dense", bwd=10.0, step=20.0),
  _row("b", "jax-dense", bwd=12.0, step=24.0),
  _row("full_length", "jax-dense", bwd=15.0, step=30.0, active=1.0),
  _row("a", "jax-bound", bwd=2.0, step=12.0, mem=80),
  _row("b", "jax-bound", bwd=4.0, step=16.0, mem=80),
  _row("a", "jax-sebp-pallas", bwd=4.0, step=14.0, mem=101),
  _row("b", "jax-sebp-pallas", bwd=6.0, step=16.0, mem=101),
  _row("full_length", "jax-sebp-pallas", bwd=15.3, step=30.6, mem=101, active=1.0),
  _row("a", "torch-dense", bwd=20.0, step=40.0, mem=None),
  _row("b", "torch-dense", bwd=0.0, step=0.0, mem=None, error="out of memory"),
  _row("a", "torch-bound", bwd=4.0, step=30.0, mem=None),
  _row("a", "torch-sebp", bwd=8.0, step=32.0, mem=None),
  _row("b", "torch-sebp", bwd=9.0, step=33.0, mem=None),  # its dense failed: left out
  _row("a", "torch-dense-graphed", bwd=16.0, step=30.0, mem=None),
  _row("a", "torch-bound-graphed", bwd=2.0, step=20.0, mem=None),
  _row("a", "torch-sebp-plan-graphed", bwd=5.0, step=22.0, mem=None),
]}


def test_way_to_bound_is_zero_at_dense_and_one_at_the_bound():
  assert summary.way_to_bound(10.0, 10.0, 2.0) == 0.0
  assert summary.way_to_bound(10.0, 2.0, 2.0) == 1.0
  assert summary.way_to_bound(10.0, 4.0, 2.0) == 0.75
  with pytest.raises(ValueError, match="bound"):
    summary.way_to_bound(2.0, 4.0, 10.0)


def test_variant_ranges_cover_the_padded_workloads():
  ranges = summary.variant_ranges(RESULT)
  sebp = ranges[(4, "jax-sebp-pallas")]
  assert sebp["bwd_x"] == (2.0, 2.5)                   # 12 / 6, 10 / 4
  assert sebp["step_x"] == (1.4285714285714286, 1.5)   # 20 / 14, 24 / 16
  assert sebp["grad_x"] == (13 / 7, 2.2)               # (1 + 12) / (1 + 6), (1 + 10) / (1 + 4)
  assert sebp["way"] == (0.75, 0.75)                   # (10-4)/(10-2), (12-6)/(12-4)
  assert sebp["own_bwd_x"] == sebp["bwd_x"]            # jax's own dense is jax-dense
  assert sebp["mem"] == pytest.approx((0.01, 0.01))
  assert sebp["full_step"] == pytest.approx((1.02, 1.02))  # full length is kept apart
  assert ranges[(4, "jax-bound")]["way"] is None        # the bound against itself says nothing
  torch = ranges[(4, "torch-dense")]
  assert torch["bwd_x"] == (0.5, 0.5) and torch["way"] is None  # the failed row is left out
  assert torch["mem"] is None
  torch_sebp = ranges[(4, "torch-sebp")]                # against torch's own dense and bound
  assert torch_sebp["own_bwd_x"] == (2.5, 2.5)          # 20 / 8
  assert torch_sebp["way"] == (0.75, 0.75)              # (20-8)/(20-4)
  assert torch_sebp["bwd_x"] == (1.25, 1.25)            # jax-dense's 10 / 8
  graphed = ranges[(4, "torch-sebp-plan-graphed")]      # against the graphed dense and bound
  assert graphed["own_bwd_x"] == (3.2, 3.2)             # 16 / 5
  assert graphed["way"] == (11 / 14, 11 / 14)           # (16-5)/(16-2)


def test_markdown_summary_writes_one_row_per_variant():
  text = summary.markdown_summary(RESULT)
  # grad ×: (fwd + bwd) over jax-dense's, every fwd 1 ms here.
  assert ("| 4 | jax-sebp-pallas | 2.00–2.50× | 1.86–2.20× | 1.43–1.50× | – | 2.00–2.50× "
          "| 75 % | – | +1.00 % | 1.020× |") in text
  assert "| 4 | torch-dense | 0.50× | 0.52× | 0.50× | – | 1.00× | – | – | – | – |" in text
  assert "| 4 | torch-sebp | 1.25× | 1.22× | 0.62× | – | 2.50× | 75 % | – | – | – |" in text


def test_the_backward_timed_on_the_gpu_has_its_own_ranges():
  # gpu_bwd_ms: the backward's kernels inside the loss-and-gradients program, where a GPU run
  # measured it (workload "a" only here); its way to the bound from the same measure.
  gpu = {("a", "jax-dense"): 9.0, ("a", "jax-bound"): 1.0, ("a", "jax-sebp-pallas"): 3.0}
  result = {**RESULT, "rows": [{**r, "gpu_bwd_ms": gpu.get((r["workload"], r["variant"]))}
                               for r in RESULT["rows"]]}
  sebp = summary.variant_ranges(result)[(4, "jax-sebp-pallas")]
  assert sebp["gpu_bwd_x"] == (3.0, 3.0)               # 9 / 3; "b" has none
  assert sebp["gpu_way"] == (0.75, 0.75)               # (9-3)/(9-1)
  assert sebp["bwd_x"] == (2.0, 2.5)                   # the wall-clock ranges unchanged
  assert summary.variant_ranges(RESULT)[(4, "jax-sebp-pallas")]["gpu_bwd_x"] is None
  assert "| 3.00× | 2.00–2.50× | 75 % | 75 % |" in summary.markdown_summary(result)


def test_command_buffer_variants_compare_with_dense_and_bound_under_the_same_flags():
  result = {**RESULT, "rows": RESULT["rows"] + [
    _row("a", "jax-dense-cmdbuf", bwd=8.0, step=16.0),
    _row("a", "jax-bound-cmdbuf", bwd=2.0, step=10.0),
    _row("a", "jax-sebp-pallas-plan-cmdbuf", bwd=4.0, step=12.0),
  ]}
  plan = summary.variant_ranges(result)[(4, "jax-sebp-pallas-plan-cmdbuf")]
  assert plan["own_bwd_x"] == (2.0, 2.0)           # 8 / 4, not jax-dense's 10 / 4
  assert plan["way"] == (2 / 3, 2 / 3)             # (8-4)/(8-2)
  assert plan["bwd_x"] == (2.0, 2.0)               # over jax-dense-cmdbuf too (Variant.baseline)


def test_caller_thread_torch_variants_compare_with_dense_and_bound_run_so():
  result = {**RESULT, "rows": RESULT["rows"] + [
    _row("a", "torch-dense-caller-thread", bwd=18.0, step=36.0, mem=None),
    _row("a", "torch-bound-caller-thread", bwd=3.0, step=24.0, mem=None),
    _row("a", "torch-sebp-plan-caller-thread", bwd=6.0, step=26.0, mem=None),
  ]}
  plan = summary.variant_ranges(result)[(4, "torch-sebp-plan-caller-thread")]
  assert plan["own_bwd_x"] == (3.0, 3.0)           # 18 / 6, not torch-dense's 20 / 6
  assert plan["way"] == (0.8, 0.8)                 # (18-6)/(18-3)


def test_no_way_to_a_bound_slower_than_dense():
  # An eager step that waits on the host: the bound's backward (Python per layer too) can take
  # longer than dense's. The workload then has no way to the bound; the others keep theirs.
  kept = [r for r in RESULT["rows"] if (r["workload"], r["variant"]) != ("b", "torch-dense")]  # its OOM
  result = {**RESULT, "rows": kept + [
    _row("b", "torch-dense", bwd=20.0, step=40.0, mem=None),
    _row("b", "torch-bound", bwd=22.0, step=42.0, mem=None),
  ]}
  torch_sebp = summary.variant_ranges(result)[(4, "torch-sebp")]
  assert torch_sebp["way"] == (0.75, 0.75)              # workload a only: (20-8)/(20-4)
  assert torch_sebp["own_bwd_x"] == (20 / 9, 2.5)       # both workloads: 20 / 9, 20 / 8


def test_compiled_torch_variants_compare_with_compiled_dense_and_bound():
  result = {**RESULT, "rows": RESULT["rows"] + [
    _row("a", "torch-dense-compiled", bwd=12.0, step=24.0, mem=None),
    _row("a", "torch-bound-compiled", bwd=3.0, step=15.0, mem=None),
    _row("a", "torch-sebp-plan-compiled", bwd=4.0, step=16.0, mem=None),
  ]}
  plan = summary.variant_ranges(result)[(4, "torch-sebp-plan-compiled")]
  assert plan["own_bwd_x"] == (3.0, 3.0)           # 12 / 4, not eager torch-dense's 20 / 4
  assert plan["way"] == (8 / 9, 8 / 9)             # (12-4)/(12-3)


def test_compiled_and_graphed_torch_variants_compare_with_their_own_dense_and_bound():
  # Not with the graphed eager ones nor the host-launched compiled ones: each pair differs from
  # it in fusions or in host overhead.
  result = {**RESULT, "rows": RESULT["rows"] + [
    _row("a", "torch-dense-graphed", bwd=14.0, step=24.0, mem=None),
    _row("a", "torch-bound-graphed", bwd=1.0, step=15.0, mem=None),
    _row("a", "torch-dense-compiled", bwd=16.0, step=24.0, mem=None),
    _row("a", "torch-bound-compiled", bwd=10.0, step=15.0, mem=None),
    _row("a", "torch-dense-compiled-graphed", bwd=12.0, step=24.0, mem=None),
    _row("a", "torch-bound-compiled-graphed", bwd=3.0, step=15.0, mem=None),
    _row("a", "torch-sebp-plan-compiled-graphed", bwd=6.0, step=16.0, mem=None),
  ]}
  plan = summary.variant_ranges(result)[(4, "torch-sebp-plan-compiled-graphed")]
  assert plan["own_bwd_x"] == (2.0, 2.0)           # 12 / 6
  assert plan["way"] == (6 / 9, 6 / 9)             # (12-6)/(12-3)
