#!/bin/bash
# Two GPUs: multi_device LLaMA FSDP base vs --pgle, same machine.
set -x
nvidia-smi --query-gpu=name --format=csv
python -m benchmarks.multi_device --models llama --steps 5 --out-dir $OUT --tag v16_base --time-budget 240 2> $OUT/base.err
tail -5 $OUT/base.err
python -m benchmarks.multi_device --models llama --steps 5 --pgle --out-dir $OUT --tag v16_pgle --time-budget 300 2> $OUT/pgle.err
grep -c "empty trace" $OUT/pgle.err
tail -8 $OUT/pgle.err
cat $OUT/*.md
