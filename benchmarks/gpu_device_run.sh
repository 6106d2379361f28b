#!/usr/bin/env bash
# The exact command behind RESULTS.md's GPU table: run from the repo root on a GPU machine whose python3 already
# has jax (CUDA) and flax; missing pure-Python packages come as wheels in .whl/ (ml_collections, grain,
# array-record, portpicker; .whl/opt/ holds a flax 0.12.8 fallback used only if the machine's flax fails the smoke).
# Writes gpu_mfu.json and gpu_mfu.log to $OUT (or benchmarks/). Env: GPU_BENCH_CONFIGS (gpu_mfu.py --configs),
# GPU_BENCH_BUDGET / GPU_BENCH_TIMEOUT (seconds), GPU_SKIP_SMOKE=1 (skip the 30 s script check), GPU_BENCH_PROFILE=1 (3-step traces),
# GPU_ATTN_DROPOUT (gpu_mfu.py --attention_dropout; 0.1 = the paper's recipe), GPU_BENCH_TAG (suffix of the output names).
set -u
OUT=${OUT:-benchmarks}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
python3 -c "import jax, flax, optax, orbax.checkpoint as o; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
if [ -n "${GPU_SKIP_SMOKE:-}" ]; then :
elif ! timeout 120 python3 benchmarks/gpu_mfu.py --smoke --configs bert_a:bias:xla,tupe_a:bias:xla --json /tmp/smoke.json; then
  echo "smoke failed with the machine's flax; retrying with flax 0.12.8"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_flax .whl/opt/*.whl
  export PYTHONPATH=/tmp/site_flax:$PYTHONPATH
  timeout 120 python3 benchmarks/gpu_mfu.py --smoke --configs bert_a:bias:xla --json /tmp/smoke.json || exit 1
fi
timeout "${GPU_BENCH_TIMEOUT:-360}" python3 benchmarks/gpu_mfu.py --batch 32 --steps 20 --budget_s "${GPU_BENCH_BUDGET:-270}" \
  --configs "${GPU_BENCH_CONFIGS:-}" ${GPU_BENCH_PROFILE:+--profile_dir "$OUT"} \
  ${GPU_ATTN_DROPOUT:+--attention_dropout "$GPU_ATTN_DROPOUT"} \
  --json "$OUT/gpu_mfu${GPU_BENCH_TAG:-}.json" 2>&1 | tee "$OUT/gpu_mfu${GPU_BENCH_TAG:-}.log"
