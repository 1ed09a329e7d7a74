"""benchmarks.collective_overlap on hand-made kernel events."""

import pytest

from benchmarks.collective_overlap import exposed_ms, is_collective, union


def _k(name, ts, dur):
  return {"name": name, "ts": ts, "dur": dur}


def test_union_merges_overlapping_and_touching():
  assert union([(5, 7), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 7)]


def test_collective_names():
  assert is_collective("ncclDevKernel_AllGather_RING_LL")
  assert not is_collective("nvjet_hsh_128x256")


def test_exposed_partial_overlap_across_streams():
  events = [_k("ncclKernel_ReduceScatter", 0, 1000), _k("fusion_1", 200, 300),
            _k("nvjet_gemm", 400, 400), _k("ncclKernel_AllGather", 1500, 500),
            _k("fusion_2", 1900, 1000)]
  # Collective [0,1000) covered by [200,800): 400 µs exposed; [1500,2000) covered by
  # [1900,2000): 400 µs exposed.
  assert exposed_ms(events) == pytest.approx(0.8)


def test_fully_hidden_and_no_compute():
  assert exposed_ms([_k("nccl_ar", 10, 10), _k("fusion", 0, 100)]) == 0.0
  assert exposed_ms([_k("nccl_ar", 10, 10), _k("nccl_ag", 15, 10)]) == pytest.approx(0.015)
