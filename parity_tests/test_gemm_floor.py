"""``benchmarks/gemm_floor.py``: the products it times are the ones it names, and its tiny run
end to end on the CPU (the Pallas kernels in the interpreter) into a temporary folder.

The products are checked against a float64 numpy product of the kept rows, independent of both
the kernels and XLA's dot; the end-to-end run checks the result file's schema and the markdown.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from benchmarks import gemm_floor  # noqa: E402
from benchmarks.layer_shapes import LayerShape  # noqa: E402
from benchmarks.tune_blocks import CANDIDATES  # noqa: E402
from sebp_jax.backends import pallas as pallas_backend  # noqa: E402
from parity_tests.tolerances import assert_close  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHAPE = gemm_floor.TINY_SHAPE
INTERPRET = jax.default_backend() != "gpu"  # the Triton kernels themselves on a GPU
ROW_FIELDS = {"part": str, "shape": str, "M": int, "K": int, "N": int, "count": int,
              "kept_fraction": float, "gemm": str, "config": str, "ms": float,
              "rel_err": float}


def _reference(gemm: str, x, kernel, dy, count: int) -> np.ndarray:
  x, kernel, dy = (np.asarray(a, np.float64) for a in (x, kernel, dy))
  return dy[:count] @ kernel.T if gemm == "dx" else x[:count].T @ dy[:count]


@pytest.mark.parametrize("gemm, config, count", [
  ("dx", CANDIDATES["default"], SHAPE.rows),
  ("dx", CANDIDATES["dx128x256"], SHAPE.rows),
  ("dw", CANDIDATES["dw128x256"], SHAPE.rows),
  ("dw", CANDIDATES["dw256x128"], 77),  # a count that ends inside a row block
  ("dw", pallas_backend.BlockConfig(dw_split=3), 77),
], ids=["dx_default", "dx128x256", "dw128x256", "dw256x128_77_rows", "dw_split3_77_rows"])
def test_pallas_and_cublas_products_equal_the_float64_product(gemm, config, count):
  x, kernel, dy = gemm_floor.gemm_inputs(SHAPE, count, jnp.bfloat16, seed=0)
  assert not np.asarray(dy[count:]).any() and np.asarray(dy[:count]).any(axis=1).all()
  want = _reference(gemm, x, kernel, dy, count)
  pallas = jax.jit(gemm_floor.pallas_gemm(gemm, config, SHAPE.rows, count, interpret=INTERPRET))
  cublas = jax.jit(gemm_floor.cublas_gemm(gemm, count))
  got = pallas(x, kernel, dy)
  assert got.dtype == jnp.bfloat16
  assert_close(got[:count] if gemm == "dx" else got, want, jnp.bfloat16, what=f"pallas {gemm}")
  assert_close(cublas(x, kernel, dy), want, jnp.bfloat16, what=f"dot_general {gemm}")


def test_dx_split_configs_are_sized_for_the_device():
  # floor_rows sizes a candidate's dX launch (its programs) for the device, as a model's is.
  rows = gemm_floor.floor_rows("tiny", SHAPE, ["dx_split2"], jnp.bfloat16, reps=2, trials=1,
                               interpret=INTERPRET)
  assert [(r["gemm"], r["config"]) for r in rows] == [("dx", "cublas"), ("dx", "dx_split2")]
  assert all(r["rel_err"] < 2e-2 for r in rows)


def test_configs_run_the_gemms_whose_tiles_they_change():
  assert gemm_floor.gemms_of(CANDIDATES["dx128x256"]) == ("dx",)
  assert gemm_floor.gemms_of(CANDIDATES["dw128x256"]) == ("dw",)
  assert gemm_floor.gemms_of(CANDIDATES["default"]) == ("dx", "dw")
  assert gemm_floor.gemms_of(CANDIDATES["big"]) == ("dx", "dw")
  assert all(name in CANDIDATES for name in gemm_floor.FLOOR_CONFIGS)


def test_a_config_that_does_not_tile_the_shape_is_named():
  with pytest.raises(ValueError, match="dx128x256: dx tiles"):
    gemm_floor.floor_rows("small", LayerShape(1, 128, 128, 128), ["dx128x256"], jnp.bfloat16,
                          reps=2, trials=1, interpret=True)


def test_a_spent_time_budget_runs_nothing_and_says_so(tmp_path):
  result = gemm_floor.main(["--tiny", "--out-dir", str(tmp_path), "--time-budget", "0",
                            "--fractions", "0.5"])
  assert result["rows"] == [] and result["skipped"] == ["floor tiny", "dw_split tiny 0.5",
                                                        "kept tiny 0.5"]
  assert "Not run (time budget spent): floor tiny" in (tmp_path / "gemm_floor.md").read_text()


def test_tiny_end_to_end_on_the_interpreter(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="",
             PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
  done = subprocess.run(
    [sys.executable, "-m", "benchmarks.gemm_floor", "--parts", "floor", "dw_split", "--tiny",
     "--out-dir", str(tmp_path),
     "--tag", "t", "--reps", "2", "--trials", "2", "--configs", "default", "dx128x256",
     "dw128x256", "--fractions", "0.05", "1.0", "--splits", "1", "3", "--dw-tiles", "128x256",
     "--tile-splits", "2"],
    cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  result = json.loads((tmp_path / "gemm_floor_t.json").read_text())
  assert result["interpret"] and result["gpu"] is None and result["dtype"] == "bfloat16"
  assert {"jax", "jaxlib", "flax", "triton"} <= set(result["versions"])
  assert result["skipped"] == []
  rows = result["rows"]
  for row in rows:
    for field, kind in ROW_FIELDS.items():
      assert isinstance(row[field], kind), (field, row)
    assert row["ms"] >= 0 and math.isfinite(row["ms"])
    assert row["rel_err"] < 2e-2, row  # each Pallas product against dot_general's
    assert (row["block_config"] is None) == (row["config"] == "cublas")
  floor = {(r["gemm"], r["config"]) for r in rows if r["part"] == "floor"}
  assert floor == {("dx", "cublas"), ("dx", "default"), ("dx", "dx128x256"), ("dw", "cublas"),
                   ("dw", "default"), ("dw", "dw128x256")}
  split = [r for r in rows if r["part"] == "dw_split"]
  assert {(r["count"], r["config"]) for r in split} == {
    (count, config) for count in (12, 256) for config in ("cublas", "split1", "split3",
                                                          "t128x256_s2")}
  by_config = {r["config"]: r for r in split if r["count"] == 12}
  assert by_config["split3"]["block_config"]["dw_split"] == 3
  assert by_config["t128x256_s2"]["block_config"]["dw_n"] == 256
  assert by_config["t128x256_s2"]["tiles"] == 2 and by_config["cublas"]["tiles"] is None
  md = (tmp_path / "gemm_floor_t.md").read_text()
  assert "## Every row kept" in md and "## dW per row split" in md and "jax " in md
  assert "| tiny | 256×256→256 | 5% |" in md


@pytest.mark.parametrize("fraction", [0.0, 0.3])
def test_kept_rows_time_both_products_beside_cublas_or_zeros(fraction):
  rows = gemm_floor.kept_rows("tiny", SHAPE, fraction, jnp.bfloat16, reps=2, trials=1,
                              interpret=INTERPRET)
  count = int(fraction * SHAPE.rows)
  assert {r["count"] for r in rows} == {count}
  others = ("cublas",) if count else ()
  assert [(r["gemm"], r["config"]) for r in rows] == [
    *(("dx", c) for c in others or ("xla_zeros",)), ("dx", "table"),
    *(("dw", c) for c in others), ("dw", "table")]
  cublas_ms = {r["gemm"]: r["ms"] for r in rows if r["config"] == "cublas"}
  for row in rows:
    assert row["ms"] >= 0 and (row["block_config"] is None) == (row["config"] != "table")
    if row["config"] == "table":
      # Against cuBLAS with the dropped rows' zeros; with nothing kept, dX and dW must be zeros.
      assert row["rel_err"] < 2e-2 if count else row["rel_err"] == 0.0
      # The speed against cuBLAS's on the same rows; none without kept rows. (A busy CPU can
      # time either at 0, which has no ratio: the check does not depend on the timer.)
      reference = cublas_ms.get(row["gemm"])
      want = reference / row["ms"] if reference and row["ms"] > 0 else None
      assert row["vs_cublas"] == want and (count or want is None)


def test_kept_fraction_zero_is_refused_beside_dw_split(tmp_path):
  with pytest.raises(SystemExit):
    gemm_floor.main(["--tiny", "--out-dir", str(tmp_path), "--fractions", "0"])


def test_markdown_names_card_versions_and_a_floor_dw_split():
  base = dict(part="floor", shape="bert_attn", M=16384, K=768, N=768, count=16384,
              kept_fraction=1.0, gemm="dw")
  result = {"device": "NVIDIA H100 80GB HBM3", "dtype": "bfloat16", "trials": 15, "reps": 6,
            "versions": {"jax": "0.11.2", "torch": None}, "interpret": False, "skipped": [],
            "rows": [dict(base, config="cublas", ms=0.048, vs_cublas=1.0, block_config=None),
                     dict(base, config="default", ms=0.059, vs_cublas=0.8136,
                          block_config={"dw_split": 3})]}
  md = gemm_floor.markdown(result)
  assert md.startswith("# Pallas GEMMs alone against cuBLAS: NVIDIA H100 80GB HBM3, bfloat16")
  assert "Versions: jax 0.11.2." in md and "interpreter" not in md
  assert "| bert_attn | 16384×768→768 | 100% | 0.048 | 0.059 (0.81×, split 3) |" in md
  assert "## dW per row split" not in md
