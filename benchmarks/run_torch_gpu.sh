#!/usr/bin/env bash
# The torch reference on one GPU in about 9 minutes (issue 19): its GPU tests, the layer benchmark
# on two shapes, BERT-base b32 and LLaMA-3.2-3B b1 with the torch variants (dense, SEBP, bound,
# the paper's Top-N, compiled dense), and a per-kernel-family profile of each model's backward.
#
#   OUT=/some/dir bash benchmarks/run_torch_gpu.sh     # results under $OUT/torch
#
# Every stage has its own time limit, so a slow or failing stage costs only its share; each
# writes JSON + md (+ PNG for the models) naming the card and library versions.
set -u
out=${OUT:-benchmarks/results}/torch
mkdir -p "$out"
py=${PYTHON:-python}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/card.txt"
$py -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" >> "$out/card.txt"
cat "$out/card.txt"
stage() { local limit=$1; shift; echo "== $* (limit ${limit}s)"; SECONDS=0; timeout "$limit" "$@"; echo "== rc $? after ${SECONDS}s"; }
stage 100 $py -m pytest parity_tests/test_torch_sebp_linear.py parity_tests/test_torch_hf.py -m gpu -q -x \
  -p no:cacheprovider --junitxml="$out/gpu_tests_torch.xml" 2>&1 | tail -8
stage 50 $py -m benchmarks.layer_torch --check --shapes bert_base_ffn_up,llama32_3b_mlp_up_b1 \
  --out "$out/torch_layer.json" 2>&1 | tail -16
stage 150 $py -m benchmarks.bert --tag torch --out-dir "$out" --steps 8 --time-budget 140 \
  --variants torch-dense torch-sebp torch-bound torch-sebp-topn torch-dense-compiled 2>&1 | tail -4
stage 140 $py -m benchmarks.llama --tag torch --out-dir "$out" --batches 1 --time-budget 130 \
  --workloads piqa obqa full_length --variants torch-dense torch-sebp torch-bound torch-dense-compiled 2>&1 | tail -4
stage 30 $py -m benchmarks.profile_torch --model bert --batch 32 --workload glue_sst2 --out-dir "$out"
stage 50 $py -m benchmarks.profile_torch --model llama --batch 1 --workload piqa --out-dir "$out" \
  --variants torch-sebp torch-bound
$py -m benchmarks.summary "$out"/bert_torch.json "$out"/llama_b1_torch.json | tee "$out/summary_torch.md"
