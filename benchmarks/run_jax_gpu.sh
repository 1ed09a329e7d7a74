#!/usr/bin/env bash
# The JAX side on one GPU, one suite per call, each within a device call's 10 minutes (issue 15):
#
#   OUT=/some/dir PYTHON=python bash benchmarks/run_jax_gpu.sh [SUITE]   # results under $OUT/jax
#
# SUITE (default llama-b1):
# * tests: the GPU tests of every file but the torch reference's own (run_torch_gpu.sh tests),
#   the cross-framework parity files included, eight workers.
# * llama-b1, llama-b4: the README's LLaMA-3.2-3B rows, PIQA at batch 1 or 4: jax-dense, the row
#   plan without a conditional and jax-bound, each with the backward's GPU time inside its
#   loss-and-gradients program (bwd GPU ×) beside the wall-clock one, then their ranges
#   (2026-12-02: ~370 s at b1, ~400 s at b4, each variant compiling 35-110 s).
# * bert: the README's BERT-base b32 row, the same three on every workload.
# * profile-llama-b1, profile-llama-b4: `benchmarks.profile_step` of the three on PIQA: GPU time
#   per kernel family and per phase (forward, backward), wall and busy time, launches.
# * mosaic-probe: the Mosaic GPU dX and dW probes' GPU test, then `benchmarks.mosaic_probe`
#   (LLaMA-3.2-3B b1's weights at 64 and 128 kept rows, against XLA's GEMMs on the same rows).
#
# EXTRA_VARIANTS (optional): more variants of benchmarks.workloads.VARIANTS for the model and
# profile suites, run after the row plan, e.g. an A/B of a launch option:
#   EXTRA_VARIANTS=jax-sebp-pallas-plan-nocond-dw-per-sibling bash benchmarks/run_jax_gpu.sh bert
#
# Each stage writes its own files naming the card and library versions, and appends what it
# printed to $OUT/jax/summary_jax.md, the one file that carries every number.
set -u
suite=${1:-llama-b1}
case "$suite" in tests|llama-b1|llama-b4|bert|profile-llama-b1|profile-llama-b4|mosaic-probe) ;;
  *) echo "usage: bash benchmarks/run_jax_gpu.sh [tests|llama-b1|llama-b4|bert|profile-llama-b1|profile-llama-b4|mosaic-probe]" >&2
     exit 2;;
esac
framework=jax
source "$(dirname "$0")/gpu_stages.sh"
summary_header "sebp_jax on one GPU, suite $suite" "import jax, jaxlib, flax, triton; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, 'triton', triton.__version__, jax.devices())"

variants="jax-dense jax-sebp-pallas-plan-nocond ${EXTRA_VARIANTS:-} jax-bound"
case "$suite" in
  tests)
    stage 560 "GPU tests (every file but the torch reference's)" $py -m pytest parity_tests -m gpu \
      --ignore-glob='parity_tests/test_torch_*' -q -n 8 -p no:cacheprovider \
      --junitxml="$out/gpu_tests_jax.xml";;
  llama-b*)
    batch=${suite#llama-b}
    stage 570 "LLaMA-3.2-3B b$batch, PIQA" $py -m benchmarks.llama --tag jax --out-dir "$out" \
      --batches "$batch" --workloads piqa --time-budget 540 --variant-timeout 220 --variants $variants
    append "$out/llama_b${batch}_jax.md"
    stage 20 "speedups over jax-dense, way to the bound" $py -m benchmarks.summary \
      "$out/llama_b${batch}_jax.json";;
  bert)
    stage 570 "BERT-base b32, every workload" $py -m benchmarks.bert --tag jax --out-dir "$out" \
      --time-budget 540 --variants $variants
    append "$out/bert_jax.md"
    stage 20 "speedups over jax-dense, way to the bound" $py -m benchmarks.summary "$out/bert_jax.json";;
  profile-llama-b*)
    batch=${suite#profile-llama-b}
    stage 570 "LLaMA-3.2-3B b$batch profile, PIQA" $py -m benchmarks.profile_step --model llama \
      --batch "$batch" --workload piqa --out-dir "$out" --variants $variants
    append "$out/profile_llama_b${batch}_piqa.md";;
  mosaic-probe)
    stage 120 "GPU test of the Mosaic GPU dX probe" $py -m pytest parity_tests/test_mosaic_probe.py \
      -m gpu -q -p no:cacheprovider
    stage 400 "Mosaic GPU dX probe (LLaMA-3.2-3B b1 weights)" $py -m benchmarks.mosaic_probe \
      --out "$out/mosaic_probe.json"
    append "$out/mosaic_probe.md";;
esac
rm -f "$out/stage.log"
