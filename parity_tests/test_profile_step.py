"""The per-kernel profiler of the model benchmarks (``benchmarks/profile_step.py``).

Its trace reading is checked on a hand-written trace in the shape jax.profiler writes on a GPU
(device and host processes, a stream thread and an XLA-ops annotation thread); its families on
kernel names seen in H200 traces of this project. End to end, it runs the tiny BERT on a GPU,
where the SEBP variant must show the three Pallas kernels and the dense one none, and on a CPU,
where it must stop saying that the trace has no GPU kernels.
"""

from __future__ import annotations

import gzip
import json

import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("optax")

from benchmarks import profile_step  # noqa: E402


@pytest.mark.parametrize("name, family", [
  ("sebp_dx", "SEBP dX"),
  ("sebp_dw", "SEBP dW"),
  ("sebp_partition", "SEBP partition"),
  ("sebp_grads", "SEBP dX + dW (one launch)"),  # BlockConfig(fused=True)
  ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNN", "GEMM (cuBLAS)"),
  ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "GEMM (cuBLAS)"),
  ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", "attention (cuDNN)"),
  ("Memset (Device)", "copies"),
  ("Memcpy DtoH (Device -> Pinned)", "copies"),
  ("loop_multiply_fusion_12", profile_step.OTHER),
  ("input_reduce_fusion_3", profile_step.OTHER),
  # The torch side (benchmarks.profile_torch): the reference's Triton kernels and torch's own.
  ("_grads_kernel", "SEBP dX + dW (one launch)"),
  ("_split_sum_kernel", "SEBP dW"),
  ("_compact_kernel", "SEBP partition"),
  ("fmha_cutlassB_bf16_aligned_64x64_k64_sm80", "attention (cuDNN)"),
  ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float> >",
   "torch elementwise, reductions"),
])
def test_kernel_family_sorts_real_kernel_names(name, family):
  assert profile_step.kernel_family(name) == family


def _meta(kind: str, pid: int, name: str, tid: int = 0) -> dict:
  return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": {"name": name}}


def _kernel(pid: int, tid: int, name: str, dur: float) -> dict:
  return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": 0.0, "dur": dur}


def test_kernel_times_sums_device_kernels_once_per_call():
  events = [
    _meta("process_name", 1, "/device:GPU:0"), _meta("process_name", 2, "/host:CPU"),
    _meta("thread_name", 1, "Stream #13(Compute)", tid=13),
    _meta("thread_name", 1, "XLA Ops", tid=99),
    # Two calls of a program: a GEMM twice per call, an SEBP kernel once per call.
    *[_kernel(1, 13, "nvjet_a", 100.0) for _ in range(4)],
    _kernel(1, 13, "sebp_dx", 30.0), _kernel(1, 13, "sebp_dx", 50.0),
    _kernel(1, 99, "fusion.3", 400.0),   # an op annotation spanning kernels: not counted
    _kernel(2, 5, "PjitFunction", 900.0),  # host side: not counted
    {"ph": "i", "pid": 1, "tid": 13, "name": "marker", "ts": 0.0},  # not a complete event
  ]
  times = profile_step.kernel_times(events, calls=2)
  assert times == {"nvjet_a": (0.2, 2.0), "sebp_dx": (0.04, 1.0)}


def test_memset_neighbours_name_the_kernels_around_large_memsets():
  def at(name, ts, dur, tid=13):
    return {"ph": "X", "pid": 1, "tid": tid, "name": name, "ts": ts, "dur": dur}

  # Two calls; listed out of time order, as a trace may hold them.
  events = [
    at("cudnn_fprop", 30.0, 5.0), at("Memset 3", 20.0, 8.0), at("sebp_dx", 0.0, 10.0),
    at("Memset 3", 25.0, 1.0),                      # small: launch cost, not listed
    at("sebp_dx", 100.0, 10.0), at("Memset 3", 120.0, 8.0), at("cudnn_fprop", 130.0, 5.0),
    at("Memset (Device)", 0.0, 16.0, tid=7),        # alone on another stream
  ]
  got = profile_step.memset_neighbours(events, calls=2)
  assert got == [["-", "-", 0.008, 0.5],
                 ["sebp_dx", "Memset 3", 0.004, 0.5],   # the run: first memset, then the small one
                 ["sebp_dx", "cudnn_fprop", 0.004, 0.5]]
  assert profile_step.memset_neighbours(events, calls=2, min_us=10.0) == [["-", "-", 0.008, 0.5]]
  entry = profile_step.variant_entry("v", [1.0], {"sebp_dx": (0.01, 1.0)}, got)
  report = profile_step.markdown_report({
    "benchmark": "bert", "gpu": "H100", "dtype": "bfloat16", "batch": 2, "seq_len": 8,
    "workload": "trec", "active_fraction": 0.5, "traced_calls": 2, "versions": {"jax": "0"},
    "variants": [entry]})
  assert "| `sebp_dx` | `cudnn_fprop` | 0.004 | 0.5 |" in report


@pytest.mark.gpu
def test_profile_of_the_tiny_bert_shows_the_sebp_kernels(tmp_path):
  profile_step._main(["--model", "bert", "--tiny", "--batch", "4", "--workload", "trec",
                      "--steps", "2", "--out-dir", str(tmp_path),
                      "--variants", "jax-dense", "jax-sebp-pallas-nocond", "jax-bound"])
  result = json.loads((tmp_path / "profile_bert_tiny_b4_trec.json").read_text())
  by_name = {v["variant"]: v for v in result["variants"]}
  sebp = {"SEBP dX", "SEBP dW", "SEBP partition"}
  assert sebp <= {f for f, ms in by_name["jax-sebp-pallas-nocond"]["families"].items() if ms > 0}
  assert not sebp & set(by_name["jax-dense"]["families"])
  assert not sebp & set(by_name["jax-bound"]["families"])
  for v in by_name.values():
    assert sum(v["families"].values()) == pytest.approx(v["busy_ms"])
    # Each traced call cut into its forward and its backward: both found, together the busy
    # time; the kernels on the side their own instruction does not name are a small part.
    phases = v["phases"]
    assert phases["forward"] + phases["backward"] == pytest.approx(v["busy_ms"])
    assert phases["forward"] > 0 and phases["backward"] > 0
    assert 0 <= phases["misplaced"] < 0.25 * v["busy_ms"]
    assert sum(v["backward_families"].values()) == pytest.approx(phases["backward"])
    assert 0 < v["busy_ms"] and 0 < v["wall_ms"] and v["launches"] >= 1
  assert "| **GPU busy** |" in (tmp_path / "profile_bert_tiny_b4_trec.md").read_text()


def test_profile_without_a_gpu_stops_and_says_so(tmp_path):
  if jax.devices()[0].platform == "gpu":
    pytest.skip("a GPU is present: the end-to-end GPU test runs instead")
  with pytest.raises(RuntimeError, match="no GPU kernel events; profile on a GPU"):
    profile_step._main(["--model", "bert", "--tiny", "--batch", "2", "--workload", "trec",
                        "--steps", "1", "--out-dir", str(tmp_path), "--variants", "jax-dense",
                        "--hlo"])
  # The HLO is written before the trace: the program's own, with the model's op names in it.
  hlo = gzip.decompress((tmp_path / "hlo_bert_tiny_b2_trec_jax-dense.txt.gz").read_bytes()).decode()
  assert hlo.startswith("HloModule") and "ENTRY" in hlo and "BertForSequenceClassification" in hlo


# Lines in the shape of an optimized HLO module of the LLaMA step (jax 0.11.2, H100).
_HLO = '''HloModule jit_sparse
%fused_pad (param_0.1: f32[4,8]) -> bf16[4,8] {
  %exp.57.7 = f32[4,8]{1,0} exponential(%param_0.1), metadata={op_name="jit(sparse)/transpose(jvp(jit(log_softmax)))/exp"}
}
ENTRY %main {
  %input_add_reduce_fusion.6 = (f32[4096]{0}, bf16[4096,3072]{1,0}) fusion(%a, %b), kind=kInput, calls=%fused_add_reduce.6, metadata={op_name="jit(sparse)/transpose(jvp(LlamaForCausalLM))/model/layers_3/input_layernorm/mul" scheduling_name="input_add_reduce_fusion.6"}, backend_config={}
  %loop_multiply_fusion_27 = bf16[4096,8192]{1,0} fusion(%c), kind=kLoop, calls=%fused_multiply, metadata={op_name="jit(sparse)/jvp(LlamaForCausalLM)/model/layers_12/mlp/mul"}
  ROOT %loop_pad_fusion = bf16[1,4096,128256]{2,1,0} fusion(%d), kind=kLoop, calls=%fused_pad, metadata={op_name="jit(sparse)/transpose(jvp())/pad" stack_frame_id=34}
  %pallas_call.985 = bf16[4096,3072]{1,0} custom-call(%e), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(sparse)/sebp_dx/pallas_call"}
  %fusion.9 = f32[8]{0} fusion(%f), kind=kLoop, calls=%fused_computation
}
'''


def test_fusion_sources_name_each_kernel_with_its_model_op():
  assert profile_step.fusion_sources(_HLO) == {
    "input_add_reduce_fusion_6": "bwd LlamaForCausalLM/model/layers_*/input_layernorm/mul",
    "loop_multiply_fusion_27": "fwd LlamaForCausalLM/model/layers_*/mlp/mul",
    "loop_pad_fusion": "bwd pad",
  }  # not the fused computations' own ops, not custom calls, not fusions without an op_name


def test_top_kernels_show_their_model_op_and_old_results_still_render():
  kernels = {"loop_pad_fusion": (1.3, 1.0), "sebp_dx": (0.5, 28.0)}
  entry = profile_step.variant_entry("v", [2.0], kernels,
                                     sources=profile_step.fusion_sources(_HLO))
  assert entry["kernels"] == [["loop_pad_fusion", profile_step.OTHER, 1.3, 1.0, "bwd pad"],
                              ["sebp_dx", "SEBP dX", 0.5, 28.0, ""]]
  result = {"benchmark": "llama", "gpu": "H100", "dtype": "bfloat16", "batch": 1, "seq_len": 8,
            "workload": "piqa", "active_fraction": 0.02, "traced_calls": 1,
            "versions": {"jax": "0"}, "variants": [entry]}
  report = profile_step.markdown_report(result)
  assert "| kernel | family | ms | launches | model op |" in report
  assert "| `loop_pad_fusion` | XLA fusions, other | 1.300 | 1 | bwd pad |" in report
  assert "| `sebp_dx` | SEBP dX | 0.500 | 28 |  |" in report
  legacy = {**entry, "kernels": [k[:4] for k in entry["kernels"]]}  # a v15 result file
  report = profile_step.markdown_report({**result, "variants": [legacy]})
  assert "| kernel | family | ms | launches |\n" in report
  assert "| `loop_pad_fusion` | XLA fusions, other | 1.300 | 1 |\n" in report


def test_the_report_gives_each_variants_backward_kernels_and_dense_over_them():
  phases = {"jax-dense": {"forward": 1.0, "backward": 3.0, "misplaced": 0.1},
            "jax-sebp-pallas": {"forward": 1.0, "backward": 0.22, "misplaced": 0.1},
            "jax-bound": None}  # e.g. a result written before the phases
  backward = {"jax-dense": {"nvjet_tst": (2.5, 3.0), "loop_add_fusion": (0.5, 1.0)},
              "jax-sebp-pallas": {"sebp_dx_1": (0.12, 1.0), "sebp_dw_1": (0.1, 1.0)},
              "jax-bound": None}
  entries = [profile_step.variant_entry(name, [2.0], {"k": (1.0, 1.0)}, phases=phase,
                                        backward_kernels=backward[name])
             for name, phase in phases.items()]
  assert "phases" not in entries[2] and "backward_families" not in entries[2]
  assert entries[1]["backward_families"] == {"SEBP dX": 0.12, "SEBP dW": 0.1}
  report = profile_step.markdown_report({
    "benchmark": "llama", "gpu": "H200", "dtype": "bfloat16", "batch": 1, "seq_len": 8,
    "workload": "piqa", "active_fraction": 0.02, "traced_calls": 2, "versions": {"jax": "0"},
    "variants": entries})
  assert "| GPU busy, backward | 3.00 | 0.22 | – |" in report
  assert "| GPU busy, backward: jax-dense's ÷ the variant's | 1.00× | 13.64× | – |" in report
  # The backward's families side by side, a variant without them marked.
  assert "| GEMM (cuBLAS) | 2.50 | 0.00 | – |" in report
  assert "| SEBP dX | 0.00 | 0.12 | – |" in report


def test_the_report_reads_the_phases_of_the_first_gpu_run():
  # results/v42_h200/call1 and call5: "unattributed" where the cut's results have "misplaced".
  entry = profile_step.variant_entry("jax-dense", [2.0], {"k": (1.0, 1.0)}, phases={
    "forward": 0.4, "backward": 0.5, "unattributed": 0.1})
  report = profile_step.markdown_report({
    "benchmark": "llama", "gpu": "H200", "dtype": "bfloat16", "batch": 1, "seq_len": 8,
    "workload": "piqa", "active_fraction": 0.02, "traced_calls": 2, "versions": {"jax": "0"},
    "variants": [entry]})
  assert "| GPU busy, backward | 0.50 |" in report
  assert "| of which on the other side's instruction (misplaced) | – |" in report
