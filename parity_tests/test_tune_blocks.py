"""``benchmarks/tune_blocks.py`` end to end on a tiny layer, on the CPU (the Pallas kernels in the
interpreter): every configuration is checked against the dense backward, and ``--planned`` hands
each one the kept rows as a row plan instead of scoring ``dy``."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

from benchmarks import tune_blocks  # noqa: E402
from benchmarks.layer_shapes import LayerShape  # noqa: E402
from sebp_jax.plan import RowPlan  # noqa: E402

TINY = LayerShape(batch=2, seq_len=48, in_features=40, out_features=72)


@pytest.mark.parametrize("tied", [False, True], ids=["kn", "tied"])
@pytest.mark.parametrize("planned", [False, True], ids=["scored", "planned"])
def test_every_configuration_checked_and_timed(monkeypatch, tmp_path, planned, tied):
  # A tied shape's weight goes to the backward as the model stores it, (N, K), and its dW comes
  # back in that layout, checked against the dense one transposed.
  backward = tune_blocks.pallas_backend.backward
  plans, layouts = [], []

  def recording_backward(x, kernel, *args, plan=None, kernel_nk=False, **kwargs):
    plans.append(plan)
    layouts.append((kernel.shape, kernel_nk))
    return backward(x, kernel, *args, plan=plan, kernel_nk=kernel_nk,
                    interpret=jax.default_backend() != "gpu", **kwargs)

  monkeypatch.setitem(tune_blocks.LAYER_SHAPES, "tiny",
                      LayerShape(**{**TINY.__dict__, "tied": tied}))
  monkeypatch.setattr(tune_blocks.pallas_backend, "backward", recording_backward)
  out = tmp_path / "tune.json"
  monkeypatch.setattr(sys, "argv", [
    "tune_blocks", "--shapes", "tiny", "--fractions", "0.4",
    "--configs", "table", "default", "dw_k64", "--baselines", "dense", "--reps", "2",
    "--dtype", "float32",
    "--out", str(out)] + (["--planned"] if planned else []))
  tune_blocks.main()
  result = json.loads(out.read_text())
  assert result["planned"] is planned
  rows = {row["config"]: row for row in result["rows"]}
  assert set(rows) == {"table", "default", "dw_k64", "dense"}
  # "table" is the layer's own entry of the tile table, as the model's layer gets it.
  table = tune_blocks.pallas_backend.block_config(TINY.rows, TINY.in_features, TINY.out_features,
                                                 jnp.float32)
  assert rows["table"]["block_config"] == dataclasses.asdict(table)
  # The tuner's own bar is 2e-2; a dropped row costs O(1).
  for name in ("table", "default", "dw_k64"):
    assert rows[name]["rel_err_dx"] < 1e-2 and rows[name]["rel_err_dw"] < 1e-2, rows[name]
    assert rows[name]["ms"] >= 0.0
  assert plans and all(isinstance(plan, RowPlan) == planned for plan in plans)
  stored = (TINY.out_features, TINY.in_features) if tied else (TINY.in_features, TINY.out_features)
  assert set(layouts) == {(stored, tied)}
