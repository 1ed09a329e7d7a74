"""Reading jax.profiler traces (``benchmarks/device_trace.py``): the trace files jax.profiler
writes, and the split of a program's GPU time into its forward's and its backward's kernels, on
hand-written HLO lines in the shape XLA prints them and on a real (CPU) trace, whose thunks name
their instructions as a GPU's kernels do."""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from benchmarks import device_trace  # noqa: E402

# Instructions of an optimized LLaMA step in the shape XLA prints them (jax 0.11.2): a fusion
# inside a fused computation, fusions of both phases, a cuBLAS and a Pallas custom call of the
# backward, and a fusion with no op_name.
_HLO = '''HloModule jit_step
%fused_pad (param_0.1: f32[4,8]) -> bf16[4,8] {
  %exp.57.7 = f32[4,8]{1,0} exponential(%param_0.1), metadata={op_name="jit(step)/transpose(jvp(jit(log_softmax)))/exp"}
}
ENTRY %main {
  %loop_multiply_fusion_27 = bf16[4096,8192]{1,0} fusion(%c), kind=kLoop, calls=%fused_multiply, metadata={op_name="jit(step)/jvp(LlamaForCausalLM)/model/layers_12/mlp/mul"}
  %loop_pad_fusion = bf16[1,4096,128256]{2,1,0} fusion(%d), kind=kLoop, calls=%fused_pad, metadata={op_name="jit(step)/transpose(jvp())/pad" stack_frame_id=34}
  %custom-call.4 = bf16[4096,3072]{1,0} custom-call(%g), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/transpose(jvp(LlamaForCausalLM))/model/layers_3/mlp/down_proj/dot_general"}
  %pallas_call.7 = bf16[4096,3072]{1,0} custom-call(%h), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(step)/transpose(jvp(sebp_dw))/pallas_call"}
  ROOT %fusion.9 = f32[8]{0} fusion(%f), kind=kLoop, calls=%fused_computation
}
'''


def _kernel(name: str, ts: float, dur: float, hlo_op: str | None = None) -> dict:
  args = {} if hlo_op is None else {"hlo_op": hlo_op, "hlo_module": "jit_step"}
  return {"ph": "X", "pid": 1, "tid": 13, "name": name, "ts": ts, "dur": dur, "args": args}


def test_instruction_phases_read_each_instructions_op_name():
  assert device_trace.instruction_phases(_HLO) == {
    "exp.57.7": "backward", "loop_multiply_fusion_27": "forward", "loop_pad_fusion": "backward",
    "custom-call.4": "backward", "pallas_call.7": "backward"}  # not %fusion.9: no op_name


def test_phase_times_cut_each_call_where_its_backward_starts():
  # Launched op by op: each kernel names its instruction (inside a loop: "while.2::...").
  # cuBLAS's kernels and XLA's copies go with the stretch they ran in.
  phases = device_trace.instruction_phases(_HLO)
  events = [_kernel("loop_multiply_fusion_27", 0, 50.0, "loop_multiply_fusion_27"),
            _kernel("nvjet_fwd", 60, 200.0, "custom-call.9"),  # an instruction without op_name
            _kernel("fusion_9", 270, 20.0, "fusion.9"),
            _kernel("loop_pad_fusion", 300, 40.0, "while.2::loop_pad_fusion"),
            _kernel("nvjet_bwd", 350, 300.0, "custom-call.4"),
            _kernel("sebp_dw", 660, 100.0, "pallas_call.7"), _kernel("Memset 0", 770, 10.0)]
  assert device_trace.phase_times(
    device_trace.kernel_sides(events, phases, calls=1), calls=1) == pytest.approx(
    {"forward": 0.27, "backward": 0.45, "misplaced": 0.0})


def test_phase_times_of_kernels_replayed_from_a_cuda_graph():
  # The format of an H200's trace (jax 0.11.2): every kernel of a command buffer names the
  # buffer as its `hlo_op`, so fusions are found by their kernel names. Two calls; in each, the
  # backward runs a forward fusion again (XLA launches one kernel, named after the first, for
  # identical fusions) and the forward runs a fusion of the backward that needs no activation.
  phases = device_trace.instruction_phases(_HLO)

  def replayed(name, ts, dur):
    return _kernel(name, ts, dur, "command_buffer_1")

  call = [("loop_multiply_fusion_27", 50.0), ("loop_pad_fusion", 5.0), ("nvjet_a", 200.0),
          ("loop_multiply_fusion_27", 50.0),                      # the forward ends
          ("loop_pad_fusion", 40.0), ("nvjet_b", 300.0), ("loop_multiply_fusion_27", 20.0),
          ("sebp_dw", 100.0), ("Memset 0", 10.0), ("loop_pad_fusion", 40.0)]
  events = [replayed(name, 1000 * c + 10 * i, dur)
            for c in range(2) for i, (name, dur) in enumerate(call)]
  assert device_trace.phase_times(
    device_trace.kernel_sides(events, phases, calls=2), calls=2) == pytest.approx(
    {"forward": 0.305, "backward": 0.51, "misplaced": 0.025})
  sides = device_trace.kernel_sides(events, phases, calls=2)
  assert [e["name"] for e, *_ in sides] == [name for _ in range(2) for name, _ in call]
  assert [(side, misplaced) for _, side, misplaced in sides[:7]] == [
    ("forward", False), ("forward", True), ("forward", False), ("forward", False),
    ("backward", False), ("backward", False), ("backward", True)]
  # Traced alone, a forward with no backward after it is all forward.
  assert device_trace.phase_times(
    device_trace.kernel_sides(events[:4], phases, calls=1), calls=1) == pytest.approx(
    {"forward": 0.305, "backward": 0.0, "misplaced": 0.005})


def test_trace_events_reads_what_jax_profiler_writes(tmp_path):
  square = jax.jit(lambda x: x * x)
  x = jnp.ones((8,))
  square(x).block_until_ready()
  with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
    square(x).block_until_ready()
  events = device_trace._trace_events(tmp_path)
  processes = {e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "process_name"}
  assert any("/host:" in name for name in processes)
  assert any(e.get("ph") == "X" for e in events)
  with pytest.raises(RuntimeError, match="no perfetto trace"):
    device_trace._trace_events(tmp_path / "empty")


def _sebp_grad():
  from sebp_jax import sebp_matmul

  def loss(w, x):
    return jnp.sum(jnp.tanh(sebp_matmul(x, w, impl="xla", crossover=1.0)) ** 2)

  grad = jax.jit(jax.value_and_grad(loss))
  w, x = jnp.ones((128, 64)), jnp.ones((256, 128))
  jax.block_until_ready(grad(w, x))
  return grad, (w, x)


def test_phase_times_of_a_real_trace_find_both_phases():
  # On a CPU the thunks that XLA runs carry `hlo_op` as a GPU's kernels do; the program's own
  # HLO sorts them into the forward's and the backward's (here SEBP's dX and dW products).
  grad, args = _sebp_grad()
  phases = device_trace.instruction_phases(grad.lower(*args).compile().as_text())
  events = [e for e in device_trace.traced_events(lambda: jax.block_until_ready(grad(*args)))
            if e.get("ph") == "X" and "hlo_op" in (e.get("args") or {})]
  times = device_trace.phase_times(
    device_trace.kernel_sides(events, phases, calls=1), calls=1)
  assert times["forward"] > 0 and times["backward"] > 0
  assert {phases[e["args"]["hlo_op"]] for e in events if e["args"]["hlo_op"] in phases} == {
    "forward", "backward"}


def test_traced_phase_times_is_none_without_gpu_kernels():
  if jax.devices()[0].platform == "gpu":
    pytest.skip("a GPU is present: the model benchmarks' GPU rows carry the phases")
  grad, args = _sebp_grad()
  hlo = grad.lower(*args).compile().as_text()
  assert device_trace.traced_phase_times(lambda: jax.block_until_ready(grad(*args)), hlo, 1) is None


@pytest.mark.parametrize("forward, plausible", [(6.6, True), (151.7, True), (185.0, False),
                                                (245.9, False)])
def test_implausible_cut_flags_a_forward_longer_than_its_program(forward, plausible):
  # The forward program of dense LLaMA b4 took 157.0 ms on the host; its cut once gave the
  # forward 245.9 ms of GPU time and the backward ~95 ms too little (benchmarks/NOTES.md "v44").
  phases = {"forward": forward, "backward": 200.7, "misplaced": 7.2}
  why = device_trace.implausible_cut(phases, 157.0)
  assert (why is None) == plausible
  if not plausible:
    assert f"{forward:.2f} ms" in why and "157.00 ms" in why
