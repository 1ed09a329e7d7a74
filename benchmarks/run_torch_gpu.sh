#!/usr/bin/env bash
# The torch reference on one GPU, one suite per call, each within a device call's 10 minutes (issue 19):
#
#   OUT=/some/dir PYTHON=python bash benchmarks/run_torch_gpu.sh [SUITE]   # results under $OUT/torch
#
# SUITE (default eager):
# * tests: the GPU tests of every torch test file, four workers (2026-11-29: 579 in ~105 s).
# * eager: host vs GPU time per layer (host_overhead_torch, backward on autograd's worker thread
#   and on the calling thread), BERT-base b32 with torch-dense, torch-sebp-plan (row plan of the
#   attention mask) and torch-bound, each eager, eager with the backward on the calling thread
#   (*-caller-thread) and replayed from CUDA graphs (no host launch overhead), LLaMA-3.2-3B b1
#   eager with the three, also on the calling thread, on piqa and full_length, and a
#   per-kernel-family profile of the eager BERT step.
# * compiled-bert: the torch.compile GPU tests, BERT-base b32 (every workload) with the three under
#   torch.compile and replayed from CUDA graphs (the compiled BERT step launched from the host
#   waits on its launches: 2026-11-29, busy 14.8 ms in a 22.7 ms step), and the profile of the
#   compiled plan (Inductor's kernels).
# * compiled-bert-host: BERT-base b32 with the three under torch.compile as a user runs it
#   (launched from the host), and torch-sebp-compiled (rows scored in every layer).
# * compiled-llama: LLaMA-3.2-3B b1 on piqa and full_length with the three under torch.compile
#   (compilation alone takes minutes: each row's compile_s says how many seconds).
# * compiled-llama-ab: LLaMA-3.2-3B b1 on piqa under torch.compile, dense, the plan and the plan's
#   launch as up to v29 (dW's programs first: torch-sebp-plan-dw-first-compiled), in one process.
# * layer: one layer's backward (benchmarks.layer_torch, checked against dense first) on
#   BERT-base's three shapes and LLaMA-3.2-3B b1's MLP, q/o and k/v projections and tied LM head, dense,
#   SEBP (a planned layer's one launch among them) and cuBLAS on the kept rows only, replayed
#   from CUDA graphs.
# On a machine of two GPUs the compiled suites run side by side, each with its own OUT and
# CUDA_VISIBLE_DEVICES.
#
# Every stage has its own time limit, so a slow or failing stage costs only its share. Each stage
# writes its own files naming the card and library versions, and appends what it printed to
# $OUT/torch/summary_torch.md, the one file that carries every number.
set -u
suite=${1:-eager}
case "$suite" in tests|eager|compiled-bert|compiled-bert-host|compiled-llama|compiled-llama-ab|layer) ;;
  *) echo "usage: bash benchmarks/run_torch_gpu.sh [tests|eager|compiled-bert|compiled-bert-host|compiled-llama|compiled-llama-ab|layer]" >&2
     exit 2;;
esac
framework=torch
source "$(dirname "$0")/gpu_stages.sh"
summary_header "torch reference on one GPU, suite $suite" "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"

if [ "$suite" = tests ]; then
  stage 240 "GPU tests (torch files)" $py -m pytest parity_tests/test_torch_launch.py \
    parity_tests/test_torch_sebp_linear.py parity_tests/test_torch_hf.py parity_tests/test_torch_graph.py \
    parity_tests/test_torch_attention.py parity_tests/test_torch_compiled.py -m gpu -q -n 4 \
    -p no:cacheprovider --junitxml="$out/gpu_tests_torch.xml"
elif [ "$suite" = eager ]; then
  # 2026-11-29: 34 s with every Triton path's launches also through kernel[grid] (v33's A/B).
  stage 70 "host vs GPU time per layer (BERT-base stack, 3 % real)" $py -m benchmarks.host_overhead_torch \
    --out "$out/host_overhead_torch.json" --profile "$out/host_overhead_torch_profile.txt"
  append "$out/host_overhead_torch_profile.txt"
  # 2026-11-29: 26-29 s per eager variant, 187 s for seven.
  stage 280 "BERT-base b32 (eager, eager on the calling thread, CUDA-graphed)" $py -m benchmarks.bert \
    --tag torch --out-dir "$out" --steps 8 --time-budget 270 --variants torch-dense torch-sebp-plan \
    torch-bound torch-dense-caller-thread torch-sebp-plan-caller-thread torch-bound-caller-thread \
    torch-dense-graphed torch-sebp-plan-graphed torch-bound-graphed
  append "$out/bert_torch.md"
  # 2026-11-29: ~20 s per variant.
  stage 140 "LLaMA-3.2-3B b1" $py -m benchmarks.llama --tag torch --out-dir "$out" --batches 1 --time-budget 130 \
    --workloads piqa full_length --variants torch-dense torch-sebp-plan torch-bound \
    torch-dense-caller-thread torch-sebp-plan-caller-thread torch-bound-caller-thread
  append "$out/llama_b1_torch.md"
  stage 30 "BERT b32 profile (glue_sst2)" $py -m benchmarks.profile_torch --model bert --batch 32 \
    --workload glue_sst2 --out-dir "$out" --variants torch-dense torch-sebp-plan
  append "$out/profile_torch_bert_b32_glue_sst2.md"
  stage 10 "speedups over torch dense, way to the torch bound" $py -m benchmarks.summary \
    "$out/bert_torch.json" "$out/llama_b1_torch.json"
elif [ "$suite" = compiled-bert ]; then
  # 2026-11-29: 100 s ran 42 of these 51 tests (compiling each model takes seconds).
  stage 160 "GPU tests (torch.compile, the GEMM launch)" $py -m pytest parity_tests/test_torch_compiled.py \
    parity_tests/test_torch_sebp_linear.py parity_tests/test_torch_graph.py \
    -k "compiled or inductor or plan_bias or traceable or dx_programs" -m gpu -q -x \
    -p no:cacheprovider --junitxml="$out/gpu_tests_torch_compiled.xml"
  # Three compilations and captures of 70-110 s each (2026-11-29, three workloads: 70 + 109 + 70 s).
  stage 320 "BERT-base b32 (torch.compile, CUDA-graphed)" $py -m benchmarks.bert \
    --tag torch_compiled_graphed --out-dir "$out" --steps 8 --time-budget 310 \
    --variants torch-dense-compiled-graphed torch-sebp-plan-compiled-graphed \
    torch-bound-compiled-graphed
  append "$out/bert_torch_compiled_graphed.md"
  # The plan's compilation and profile (2026-11-29: ~95 s; with the bound's too the suite ran past
  # a device call's 600 s, and the bound's kernels do not change with SEBP's: results/v27_h200/).
  stage 110 "BERT b32 profile, compiled (glue_sst2)" $py -m benchmarks.profile_torch --model bert \
    --batch 32 --workload glue_sst2 --out-dir "$out" --variants torch-sebp-plan-compiled
  append "$out/profile_torch_bert_b32_glue_sst2.md"
  stage 10 "speedups over compiled torch dense, way to the compiled bound" $py -m benchmarks.summary \
    "$out/bert_torch_compiled_graphed.json"
elif [ "$suite" = compiled-bert-host ]; then
  # Four compilations of ~30-90 s each (2026-11-29: 384 s for the four on 11 workloads).
  stage 420 "BERT-base b32 (torch.compile)" $py -m benchmarks.bert --tag torch_compiled \
    --out-dir "$out" --steps 8 --time-budget 410 --variants torch-dense-compiled \
    torch-sebp-plan-compiled torch-sebp-compiled torch-bound-compiled
  append "$out/bert_torch_compiled.md"
  stage 10 "speedups over compiled torch dense, way to the compiled bound" $py -m benchmarks.summary \
    "$out/bert_torch_compiled.json"
elif [ "$suite" = layer ]; then
  # 2026-11-29 (v30): 150 s for seven shapes and six planned variants (now eight and seven).
  stage 400 "one layer (BERT-base shapes, LLaMA-3.2-3B b1 MLP, q/o, k/v and LM head)" $py -m benchmarks.layer_torch \
    --check --shapes bert,llama32_3b_mlp_up_b1,llama32_3b_mlp_down_b1,llama32_3b_attn_q_o_b1,llama32_3b_attn_k_v_b1,llama32_3b_lm_head_b1 \
    --out "$out/layer_torch.json"
  append "$out/layer_torch.md"
elif [ "$suite" = compiled-llama-ab ]; then
  # Three compilations of ~100 s each (2026-11-29: 465 s for three variants on two workloads).
  stage 520 "LLaMA-3.2-3B b1 (torch.compile), the launch order A/B" $py -m benchmarks.llama \
    --tag torch_compiled_ab --out-dir "$out" --batches 1 --time-budget 510 --variant-timeout 300 \
    --workloads piqa --variants torch-dense-compiled torch-sebp-plan-compiled \
    torch-sebp-plan-dw-first-compiled
  append "$out/llama_b1_torch_compiled_ab.md"
else
  stage 520 "LLaMA-3.2-3B b1 (torch.compile)" $py -m benchmarks.llama --tag torch_compiled \
    --out-dir "$out" --batches 1 --time-budget 510 --variant-timeout 300 --workloads piqa \
    full_length --variants torch-dense-compiled torch-sebp-plan-compiled torch-bound-compiled
  append "$out/llama_b1_torch_compiled.md"
  stage 10 "speedups over compiled torch dense, way to the compiled bound" $py -m benchmarks.summary \
    "$out/llama_b1_torch_compiled.json"
fi
rm -f "$out/stage.log"
