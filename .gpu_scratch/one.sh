#!/bin/bash
set -x
nvidia-smi --query-gpu=name --format=csv
mkdir -p $OUT/new $OUT/old $OUT/new2 $OUT/llama
B="--model bert --batch 32 --workload glue_sst2 --variants jax-dense jax-sebp-pallas-plan-nocond --steps 3"
timeout 150 python -m benchmarks.profile_step $B --out-dir $OUT/new 2>&1 | tail -3
(cd .gpu_scratch/old && PYTHONPATH=$PWD timeout 150 python -m benchmarks.profile_step $B --out-dir $OUT/old 2>&1 | tail -3)
timeout 150 python -m benchmarks.profile_step $B --out-dir $OUT/new2 2>&1 | tail -3
for d in new old new2; do head -16 $OUT/$d/*.md | tail -13; done
timeout 260 python -m benchmarks.profile_step --model llama --batch 1 --workload piqa --variants jax-dense jax-sebp-pallas-plan-nocond jax-bound --steps 3 --hlo --out-dir $OUT/llama 2>&1 | tail -3
head -16 $OUT/llama/*.md | tail -13
tar czf $OUT/all.tgz -C $OUT new old new2 llama
rm -rf $OUT/new $OUT/old $OUT/new2 $OUT/llama
