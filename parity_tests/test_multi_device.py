"""SEBP on 4 devices against single-device dense autodiff, and its compiled collectives against the
dense program's: data parallel, FSDP and 2-D meshes under automatic sharding (with
:func:`sebp_jax.sharded_rows`), an explicit-sharding mesh, and ``jax.shard_map``.

The checks run in one subprocess per backend with 4 forced host devices
(:mod:`parity_tests.multi_device_checks`), so the rest of the suite keeps its single device.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import subprocess
import sys

import pytest

from benchmarks.collective_bytes import COLLECTIVES

REPO = pathlib.Path(__file__).resolve().parents[1]
CASES = ("data_parallel", "fsdp", "data_fsdp", "explicit", "shard_map_unchecked",
         # With a row plan of the whole batch, which each device re-plans for its own rows.
         "data_parallel_planned", "data_fsdp_planned", "explicit_planned",
         # With the weights stored (out, in), as a tied embedding is (transpose_kernel=True).
         "data_parallel_nk", "fsdp_nk", "explicit_nk",
         # The first layer as two siblings under one backward (sebp_matmuls).
         "fsdp_siblings", "data_fsdp_planned_siblings", "explicit_siblings",
         # Two blocks as one lax.scan over stacked, FSDP-sharded weights (a scanned model).
         "fsdp_scanned", "fsdp_planned_scanned")
# The Pallas interpreter (jax 0.10) cannot run kernels whose loops carry varying values inside
# shard_map(check_vma=True): the interpreter is checked unchecked, and the GPU kernels' tracing
# under check_vma=True is checked by `pallas_traces_in_shard_map`.
CASES_BY_IMPL = {"xla": CASES + ("shard_map", "errors", "finetune", "value_and_grad_data_parallel",
                                  "value_and_grad_fsdp", "plan_once_per_step"),
                 "interpret": CASES + ("pallas_traces_in_shard_map",),
                 "pallas": CASES + ("shard_map",)}


@functools.cache
def _results(impl: str) -> dict[str, dict]:
  """The checks' JSON lines by case: on 4 CPU devices, or (``pallas``) on this machine's GPUs."""
  env = dict(os.environ,
             PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
  devices = [] if impl == "pallas" else ["--host-devices", "4"]
  done = subprocess.run([sys.executable, "-m", "parity_tests.multi_device_checks", *devices,
                         impl, *CASES_BY_IMPL[impl]], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
  return {line["case"]: line for line in lines}


def _check_gradients_and_collectives(result: dict, exact: bool = True) -> None:
  """Gradients within tolerance of one device's dense autodiff, and SEBP adds no collective:
  with ``exact``, the same collectives as dense's, kind by kind, count and bytes. XLA:GPU picks
  a program's collectives itself (combining them, forming reduce-scatters, keeping some
  synchronous), so on GPUs (``exact=False``) SEBP may reduce in fewer: it runs no kind dense does
  not, and no more of them, moving no more bytes."""
  message = json.dumps(result)  # whole: pytest would cut the dicts short
  assert result["error_over_tolerance"] <= 1.0, message
  sebp, dense = result["sebp"], result["dense"]
  assert sum(dense.values()) > 0, "the dense program has no collective at all"
  if exact:
    assert sebp == dense, message
    return
  kinds = [kind for kind in sebp if not kind.endswith(" bytes")]
  assert {kind for kind in kinds if sebp[kind]} <= {kind for kind in kinds if dense[kind]}, message
  assert sum(sebp[kind] for kind in kinds) <= sum(dense[kind] for kind in kinds), message
  assert (sum(v for k, v in sebp.items() if k.endswith(" bytes"))
          <= sum(v for k, v in dense.items() if k.endswith(" bytes"))), message


@pytest.mark.parametrize("impl,case", [(impl, case) for impl in ("xla", "interpret")
                                       for case in CASES_BY_IMPL[impl]
                                       if case in CASES + ("shard_map",)])
def test_gradients_and_collectives_match_dense(impl, case):
  _check_gradients_and_collectives(_results(impl)[case])


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES_BY_IMPL["pallas"])
def test_pallas_gradients_and_collectives_match_dense_on_gpus(case):
  results = _results("pallas")
  if results["devices"]["count"] < 2:
    pytest.skip("needs 2 GPUs or more")
  _check_gradients_and_collectives(results[case], exact=False)


def test_pallas_kernels_trace_inside_checked_shard_map():
  # Tracing raised "manual_axis_type on jax.ShapeDtypeStruct must not be None" before; how many
  # kernels a layer launches depends on the kernel version.
  assert _results("interpret")["pallas_traces_in_shard_map"]["pallas_calls"] > 0


def test_each_devices_plan_is_made_once_per_step_not_per_layer():
  # Every planned layer re-plans its device's rows from the same mask; XLA's common
  # subexpression elimination leaves one plan (its prefix sums) whatever the depth.
  scans = _results("xla")["plan_once_per_step"]["scans"]
  assert scans["2"] == scans["5"] > 0, scans


def test_unfollowable_sharding_is_an_error_naming_the_fix():
  messages = _results("xla")["errors"]["messages"]
  assert "sharded_rows" in messages["auto_without_rows"]
  # A row plan over sharded rows is applied on each device: one that misses real rows is caught.
  assert "layer layer" in messages["plan_misses_rows"]
  assert "outside the plan" in messages["plan_misses_rows"]
  assert "'model'" in messages["tensor_parallel"]
  assert "where=" in messages["tensor_parallel"]


@pytest.mark.parametrize("layout", ["data_parallel", "fsdp"])
def test_sebp_value_and_grad_under_sharding(layout):
  # A flax MLP through sebp_value_and_grad (its sparse branch) inside sharded_rows.
  result = _results("xla")[f"value_and_grad_{layout}"]
  assert result["error_over_tolerance"] <= 1.0, result


def test_finetune_trains_the_same_on_four_devices():
  runs = _results("xla")["finetune"]["runs"]
  one = runs["one"]["losses"]
  for name in ("data_parallel", "fsdp"):
    # The same batches, split over 4 devices: the same losses up to float32 summation order.
    assert len(runs[name]["losses"]) == len(one) == 3
    for a, b in zip(runs[name]["losses"], one):
      assert abs(a - b) <= 1e-5 * abs(b), (name, runs[name]["losses"], one)
    assert runs[name]["report_names_mesh"], runs[name]
  assert runs["fsdp"]["mesh"].startswith("mesh data=4, FSDP")


def test_benchmark_summary_from_rows(tmp_path):
  from benchmarks import multi_device

  def row(devices, variant, bwd_ms, step_ms):
    return dict(model="bert", parallelism="data parallel", devices=devices, per_device_batch=4,
                workload="trec", active_fraction=0.2, variant=variant, fwd_ms=1.0, bwd_ms=bwd_ms,
                step_ms=step_ms, sequences_per_s=4 * devices / step_ms * 1e3, compile_s=1.0,
                error=None)

  rows = [row(1, "dense", 4.0, 10.0), row(1, "sebp", 2.0, 8.0),
          row(2, "dense", 4.4, 11.0), row(2, "sebp", 2.4, 9.0)]
  result = {"gpu": "test card", "warmup": 1, "steps": 3, "note": "", "rows": rows,
            "versions": {"jax": "0"}, "xla_flags": "--xla_gpu_enable_pipelined_all_gather=true"}
  paths = multi_device.write(tmp_path, "md", result)
  (summary,) = result["summary"]
  assert summary["bwd_speedup_1"] == 2.0 and abs(summary["bwd_speedup_n"] - 4.4 / 2.4) < 1e-12
  assert abs(summary["speedup_kept"] - (4.4 / 2.4) / 2.0) < 1e-12
  assert abs(summary["sebp_scaling"] - 2 * 8.0 / 9.0) < 1e-12
  assert [p.suffix for p in paths] == [".json", ".md", ".png"]
  assert "test card" in paths[1].read_text()
  assert "XLA_FLAGS: `--xla_gpu_enable_pipelined_all_gather=true`" in paths[1].read_text()
  # step − fwd − bwd, e.g. 8.0 − 1.0 − 2.0 for one device's SEBP row; none where a time is missing
  assert "| 2.00 | 8.00 | 5.00 |" in paths[1].read_text()
  assert multi_device.rest_ms({**rows[0], "step_ms": None}) is None


def test_benchmark_rejects_pgle_without_a_warm_up_step():
  from benchmarks import multi_device

  # Checked before any device is looked at: each program's first warm-up call is its recompile.
  with pytest.raises(SystemExit, match="--pgle needs --warmup >= 1"):
    multi_device.main(["--pgle", "--warmup", "0", "--tiny"])


@pytest.mark.parametrize("scan", [False, True])
def test_benchmark_builds_the_scanned_llama_on_request(scan):
  from benchmarks import multi_device

  args = multi_device._parser().parse_args(["--tiny", *(["--scan-layers"] if scan else [])])
  module = multi_device.model_spec(multi_device.MODELS["llama"], args).jax_module()
  assert module.config.scan_layers is scan


def _gpu_result(sebp: dict, dense: dict) -> dict:
  zero = {kind: 0 for kind in COLLECTIVES}
  return {"case": "c", "error_over_tolerance": 0.1, "sebp": zero | sebp, "dense": zero | dense}


def test_gpu_rule_lets_sebp_reduce_in_fewer_collectives_but_never_more():
  # explicit_siblings on 2× H200: XLA:GPU reduces dense's two gradients in an all-reduce and a
  # reduce-scatter, SEBP's in one reduce-scatter of both.
  fewer = _gpu_result({"all-gather": 1, "reduce-scatter": 1, "all-gather bytes": 3072,
                       "reduce-scatter bytes": 1536},
                      {"all-gather": 1, "all-reduce": 1, "reduce-scatter": 1,
                       "all-gather bytes": 3072, "all-reduce bytes": 1536,
                       "reduce-scatter bytes": 768})
  _check_gradients_and_collectives(fewer, exact=False)
  with pytest.raises(AssertionError):
    _check_gradients_and_collectives(fewer)
  more_bytes = _gpu_result({"all-gather": 1, "all-gather bytes": 4096},
                           {"all-gather": 1, "all-gather bytes": 3072})
  new_kind = _gpu_result({"all-gather": 1, "all-to-all": 1, "all-gather bytes": 64},
                         {"all-gather": 2, "all-gather bytes": 3072})
  for result in (more_bytes, new_kind):
    with pytest.raises(AssertionError):
      _check_gradients_and_collectives(result, exact=False)
