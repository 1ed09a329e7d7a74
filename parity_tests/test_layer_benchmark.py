"""``benchmarks.layer``: what each timed case is handed, on a tiny shape, on the CPU.

The timer is replaced by one that records its cases, so these check the inputs and the result
rows, not any time.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from benchmarks import layer  # noqa: E402
from benchmarks.layer_shapes import LayerShape, padded_gradient  # noqa: E402

TINY = LayerShape(batch=2, seq_len=16, in_features=8, out_features=12)


def test_each_input_sets_ideal_keeps_its_own_rows(monkeypatch):
  monkeypatch.setitem(layer.LAYER_SHAPES, "tiny", TINY)
  seen = {}

  def recording_timer(cases, *, trials):
    seen.update(cases)
    return {name: [1.0] * trials for name in cases}

  rows = layer.run(["tiny"], [0.3], ["xla-nocond", "dense"], jnp.float32, reps=2,
                   timer=recording_timer, input_sets=3)
  counts = [padded_gradient(TINY, 0.3, jnp.float32, seed)[3] for seed in range(3)]
  assert len(set(counts)) > 1  # the sets differ, so one set's rows for all would be caught
  _, ideal_sets = seen[layer.IDEAL]
  assert [dy.shape[0] for _, _, dy in ideal_sets] == counts
  for (x, _, dy), (x_rows, _, dy_rows) in zip(seen["dense"][1], ideal_sets):
    keep = np.asarray(jnp.any(dy != 0, axis=1))
    np.testing.assert_array_equal(x_rows, x[keep])
    np.testing.assert_array_equal(dy_rows, dy[keep])
  assert {r["active_rows"] for r in rows} == {np.mean(counts)}
  assert all(r["active_rows_per_set"] == counts for r in rows)
  assert all(r["rel_err_vs_dense"] < 1e-6 for r in rows if r["impl"] == "xla-nocond")



class _CutOff(Exception):
  pass


def test_a_cut_off_run_keeps_its_points(monkeypatch, tmp_path):
  """The JSON is rewritten after every point, so a time limit mid-run loses only the point in
  flight (v12's LLaMA layers ran out of time before a JSON written once at the end)."""
  monkeypatch.setitem(layer.LAYER_SHAPES, "tiny", TINY)
  points = []

  def timer_cut_off_at_second_point(cases, *, trials):
    points.append(cases)
    if len(points) > 1:
      raise _CutOff
    return {name: [1.0] * trials for name in cases}

  monkeypatch.setitem(layer.TIMERS, "wall", timer_cut_off_at_second_point)
  out = tmp_path / "layer.json"
  with pytest.raises(_CutOff):
    layer.main(["--shapes", "tiny", "--fractions", "0.3", "0.6", "--impls", "xla", "dense",
                "--reps", "1", "--timer", "wall", "--out", str(out)])
  result = json.loads(out.read_text())
  assert len({r["active_fraction"] for r in result["rows"]}) == 1
  assert {r["impl"] for r in result["rows"]} == {"xla", "dense", layer.IDEAL}
  assert result["input_sets"] == 1 and out.with_suffix(".md").exists()
