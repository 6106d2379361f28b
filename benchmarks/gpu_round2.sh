#!/usr/bin/env bash
# Issue #18's GPU checks in one prepared script, for one call of the device tool (at most 600 s a command).
# Here, once: `bash benchmarks/gpu_wheels.sh` (the four wheels the H200 machine lacks, into the git-ignored .whl/).
# Then with the device tool, from the repo root: run(command="bash benchmarks/gpu_round2.sh", carry=[".whl"],
# timeout_s=600). Steps in order of importance, each under its own timeout and all under one deadline
# (GPU_ROUND_DEADLINE_S, default 560 s after the start; a step with under 20 s left is skipped and says so):
#   0. a smoke run of the model (gpu_mfu.py --smoke) on the machine's flax; if it fails, flax from .whl/opt
#   1. the pallas kernel's phases with attention dropout 0.1 (gpu_pallas_phases.py, 60 s), its mask precomputed by
#      XLA (kernels/masks.py; session 23's default): in session 22 the backward hashing its mask in the kernels did
#      not finish compiling; if this one does not either, the pallas steps below are left out
#   2. the fused paths' bias precision (gpu_bias_precision.py: xla float32 bias; cudnn through
#      attention.cudnn_inputs, causal ALiBi folded into q/k; the cuDNN column session 22 measured before that)
#   3. cuDNN and xla compute the causal models (ALiBi, its bias folded into q/k for cuDNN; RoPE) as the einsum path
#   4. if the canary failed: gpu_pallas_bisect.py compiles dK/dV and dQ alone (the precomputed form; dK/dV also at
#      8 warps, at 1 stage, and hashing in the kernel) to find the kernel and the compile stage that stall;
#      else the pallas kernel computes the einsum model with attention dropout 0.1 (2 layers of BERT-base width,
#      seq 512, bf16, the same masks)
#   5. MFU at the paper's recipe (attention dropout 0.1): bert_a on the einsum path, then bert_a, tupe_r and tupe_a
#      on the pallas kernel (gpu_mfu.py; `attention_kernels` in each row says which kernel ran)
#   6. MFU at the default settings (attention dropout 0): cuDNN for the three, and pallas for bert_a
#   7. causal LMs (alibi, rope) on cuDNN with the causal mask as an explicit array and as is_causal
#      (attention.NATIVE_CAUSAL_MASK, off until this A/B shows a gain); the pallas tiles come after the kernel compiles
# Outputs in $OUT (the device tool brings back at most 8 files): at most seven JSON files and gpu_round2.log.
# GPU_ROUND_STEPS=6,7 runs only those steps (a second device call for what the first one's deadline left out; the
# pallas rows then run unless GPU_ROUND_PALLAS=0: set it when the first call's canary failed).
# (Session 22 also ran gpu_cudnn_dropout_probe.py: cuDNN's dropout takes no traced seed, so it is not rerun.)
# tests/test_gpu_scripts.py runs these scripts' Python paths on CPU at smoke sizes, so a change elsewhere that
# breaks them fails the suite rather than a device session.
set -u
START=$SECONDS
DEADLINE=${GPU_ROUND_DEADLINE_S:-560}
ONLY=${GPU_ROUND_STEPS:-}
OUT=${OUT:-benchmarks}
LOG="$OUT/gpu_round2.log"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
selected() {  # selected N: whether step N runs (GPU_ROUND_STEPS)
  [ -z "$ONLY" ] || [[ ",$ONLY," == *",$1,"* ]]
}
step() {  # step SECONDS NAME COMMAND...: run with a timeout (capped by the deadline), everything into the one log
  local seconds=$1 name=$2; shift 2
  selected "${name%% *}" || return 0
  local left=$((DEADLINE - (SECONDS - START)))
  if [ "$left" -lt 20 ]; then
    echo "=== $name: skipped, ${left}s left of the ${DEADLINE}s deadline" | tee -a "$LOG"; return
  fi
  [ "$seconds" -gt "$left" ] && seconds=$left
  echo "=== $name ($(date -u +%H:%M:%S), +$((SECONDS - START))s, timeout ${seconds}s): $*" | tee -a "$LOG"
  timeout "$seconds" "$@" 2>&1 | tee -a "$LOG"
  echo "=== $name: exit ${PIPESTATUS[0]}" | tee -a "$LOG"
}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | tee -a "$LOG"
python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__,
jax.devices())" 2>&1 | tee -a "$LOG"
if ! timeout 90 python3 benchmarks/gpu_mfu.py --smoke --configs bert_a:bias:xla --json /tmp/smoke.json >>"$LOG" 2>&1
then
  echo "=== 0 smoke failed with the machine's flax; flax from .whl/opt instead" | tee -a "$LOG"
  tail -5 "$LOG"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_flax .whl/opt/*.whl
  export PYTHONPATH=/tmp/site_flax:$PYTHONPATH
  step 90 "0 smoke, flax from .whl/opt" python3 benchmarks/gpu_mfu.py --smoke --configs bert_a:bias:xla \
    --json /tmp/smoke.json
else
  echo "=== 0 smoke: passed (+$((SECONDS - START))s)" | tee -a "$LOG"
fi
PALLAS=1
if selected 1; then
  step 60 "1 pallas phases, dropout 0.1, precomputed mask" python3 benchmarks/gpu_pallas_phases.py --rate 0.1 \
    --bias --heads 12 --batch 4 --dropout_mask precomputed --json "$OUT/results_gpu_pallas_phases.json"
  grep -q '"backward run 0"' "$OUT/results_gpu_pallas_phases.json" 2>/dev/null || PALLAS=
  [ -z "$PALLAS" ] && echo "=== the pallas backward did not compile in time: pallas steps left out" | tee -a "$LOG"
elif [ "${GPU_ROUND_PALLAS:-1}" = 0 ]; then
  PALLAS=
fi
step 60 "2 bias precision" python3 benchmarks/gpu_bias_precision.py --backends xla,cudnn,cudnn_model \
  --json "$OUT/results_gpu_bias_precision.json"
step 90 "3 cuDNN computes the causal models" python3 benchmarks/gpu_check_fused.py --backends cudnn,xla \
  --cases alibi:bias:clm,rope:bias:clm --json "$OUT/results_gpu_cudnn_clm_check.json"
if [ -z "$PALLAS" ]; then
  step 170 "4 which backward kernel, which compile stage" python3 benchmarks/gpu_pallas_bisect.py --timeout 30 \
    --json "$OUT/results_gpu_pallas_bisect.json"
else
  step 120 "4 pallas = einsum with dropout" python3 benchmarks/gpu_check_fused.py --backends pallas \
    --attention_dropout 0.1 --cases bert_a:bias,tupe_r:bias --json "$OUT/results_gpu_pallas_check.json"
fi
step 190 "5 MFU, paper recipe" python3 benchmarks/gpu_mfu.py --batch 32 --steps 20 --budget_s 150 \
  --attention_dropout 0.1 \
  --configs "bert_a:bias:einsum${PALLAS:+,bert_a:bias:pallas,tupe_r:bias:pallas,tupe_a:bias:pallas}" \
  --json "$OUT/results_gpu_mfu_paper.json"
step 140 "6 MFU, default settings" python3 benchmarks/gpu_mfu.py --batch 32 --steps 20 --budget_s 100 \
  --configs "bert_a:bias:cudnn,tupe_a:bias:cudnn,tupe_r:bias:cudnn${PALLAS:+,bert_a:bias:pallas}" \
  --json "$OUT/results_gpu_mfu_default.json"
step 150 "7 MFU, causal LMs: explicit vs native causal mask" python3 benchmarks/gpu_mfu.py --batch 32 --steps 20 \
  --budget_s 120 --objective clm --causal_mask explicit,native --configs alibi:bias:cudnn,rope:bias:cudnn \
  --json "$OUT/results_gpu_mfu_clm.json"
echo "=== done (+$((SECONDS - START))s)" | tee -a "$LOG"
