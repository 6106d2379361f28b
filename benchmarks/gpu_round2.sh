#!/usr/bin/env bash
# Issue #18's GPU checks in one prepared script (NOT yet run: no GPU was lent to the session that wrote it).
# From the repo root on the device machine (about 8 minutes on an H200; outputs in $OUT, else benchmarks/):
#   0. whether cuDNN's fused attention can carry attention dropout in training (gpu_cudnn_dropout_probe.py)
#   1. the fused paths' bias precision (gpu_bias_precision.py: xla float32 bias, cudnn shifted bf16 bias)
#   2. MFU at the default settings (attention dropout 0: fused cuDNN attention) for bert_a, tupe_a, tupe_r
#   3. MFU at the paper's recipe (attention dropout 0.1: the einsum path) for the same three
set -u
OUT=${OUT:-benchmarks}
export OUT
# needs .whl/ (the pure-Python wheels gpu_device_run.sh installs; carry it to the device machine)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
PYTHONPATH=/tmp/site:$PWD timeout 60 python3 benchmarks/gpu_cudnn_dropout_probe.py \
  --json "$OUT/results_gpu_cudnn_dropout_probe.json" 2>&1 | tee "$OUT/gpu_cudnn_dropout_probe.log"
PYTHONPATH=/tmp/site:$PWD timeout 120 python3 benchmarks/gpu_bias_precision.py --backends xla,cudnn \
  --json "$OUT/results_gpu_bias_precision.json" 2>&1 | tee "$OUT/gpu_bias_precision.log"
CONFIGS=bert_a:bias:cudnn,tupe_a:bias:cudnn,tupe_r:bias:cudnn
GPU_SKIP_SMOKE=1 GPU_BENCH_CONFIGS=$CONFIGS GPU_BENCH_BUDGET=120 GPU_BENCH_TIMEOUT=200 GPU_BENCH_TAG=_default \
  bash benchmarks/gpu_device_run.sh
GPU_SKIP_SMOKE=1 GPU_BENCH_CONFIGS=$CONFIGS GPU_BENCH_BUDGET=120 GPU_BENCH_TIMEOUT=200 GPU_BENCH_TAG=_paper \
  GPU_ATTN_DROPOUT=0.1 bash benchmarks/gpu_device_run.sh
