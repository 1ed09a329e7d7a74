#!/bin/bash
set -x
nvidia-smi --query-gpu=name --format=csv
timeout 330 python -m benchmarks.bert --variants jax-dense jax-sebp-pallas-plan-nocond jax-bound --out-dir $OUT/r --tag v16 --time-budget 320 2>&1 | tail -4
(cd .gpu_scratch/old && PYTHONPATH=$PWD timeout 200 python -m benchmarks.bert --variants jax-dense jax-sebp-pallas-plan-nocond --workloads trec glue_rte glue_sst2 --out-dir $OUT/r --tag v16_head --time-budget 190 2>&1 | tail -4)
cat $OUT/r/*.md | grep -v "^$" | head -80
tar czf $OUT/bert.tgz -C $OUT r && rm -rf $OUT/r
