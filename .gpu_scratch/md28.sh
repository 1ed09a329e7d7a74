#!/bin/bash
set -x
nvidia-smi --query-gpu=name --format=csv
timeout 570 python -m benchmarks.multi_device --models llama --llama-layers 28 --steps 4 --out-dir $OUT --tag v16_28layers --time-budget 560 2> $OUT/md28.err
grep -v "^W1127\|^I1127" $OUT/md28.err | tail -12
cat $OUT/*.md
