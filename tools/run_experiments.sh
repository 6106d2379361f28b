#!/usr/bin/env bash
# The seeded comparison runs behind docs/experiments/ and the README's findings table (issue: reproduce the seed
# findings with seeds). Each step reuses finished runs, so rerunning only does what is missing; on a fresh clone
# the whole script is ~4.5 hours on 2 CPU cores (tupe-a-5k: ~1 hour of it; probe-sweep: ~1 hour and probe's 12
# probes: ~25 min, both redone on each call, as probes are not reused). Usage:
#   tools/run_experiments.sh [extrapolation|probe|probe-sweep|sinusoidal|tupe|nopos-mlm|nopos-mlm-5k|tupe-a-5k|publish]...
#   (no argument: all, in that order)
# extrapolation -> probe and tupe -> nopos-mlm depend on each other's runs; the two chains may run in parallel.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
# the committed reports were made with flax's 32-bit dropout masks (before 16-bit masks became the default)
DATA="--config.data.name=wikitext --config.data.path=../shared/data/wikitext-2 --config.model.dropout_bits=32"
RUNS=runs/cmp/runs                        # every pretraining run, shared by the suites
CLM="--config.train.steps=1500 --config.train.eval_every=250 --config.seeds=0,1,2"
MLM="--config.train.steps=${MLM_STEPS:-1500} --config.train.eval_every=250 --config.seeds=0,1,2"

step() {
  case "$1" in
    extrapolation)   # causal LMs at 128 tokens, evaluated to 1024
      $PY -m launch compare --config=configs/compare.py:suite=extrapolation --workdir=runs/cmp/extrapolation $DATA \
        --config.runs_dir=$RUNS $CLM --config.schemes=bert_a,sinusoidal,rope,alibi,nopos ;;
    probe-sweep)     # do those probes converge? probe steps x training tokens on the causal NoPos and BERT-A runs;
                     # ALiBi's at the longest cell (needs the probe suite's alibi runs)
      $PY tools/probe_sweep.py $(for s in nopos bert_a; do for i in 0 1 2; do echo "--workdir=$RUNS/$s-clm-s$i"; done
        done) --steps=300,3000,30000 --train_tokens=16384,524288 --out=docs/experiments/probe-sweep
      $PY tools/probe_sweep.py $(for i in 0 1 2; do echo "--workdir=$RUNS/nopos-clm-s$i"; done) --steps=100000 \
        --train_tokens=524288 --out=docs/experiments/probe-sweep/long
      $PY tools/probe_sweep.py $(for i in 0 1 2; do echo "--workdir=$RUNS/alibi-clm-s$i"; done) --steps=30000 \
        --train_tokens=524288 --out=docs/experiments/probe-sweep/alibi ;;
    sinusoidal)      # design check: our scaled sinusoidal table vs fairseq's
      $PY -m launch compare --config=configs/compare.py:suite=extrapolation --workdir=runs/cmp/sinusoidal $DATA \
        --config.runs_dir=$RUNS $CLM --config.schemes=sinusoidal,sinusoidal-fairseq ;;
    probe)           # NoPos: absolute-position probes of the causal runs above
      $PY -m launch compare --config=configs/compare.py:suite=probe --workdir=runs/cmp/probe $DATA \
        --config.runs_dir=$RUNS $CLM --config.schemes=nopos,bert_a,sinusoidal,alibi ;;
    nopos-mlm)       # NoPos: bidirectional NoPos vs BERT-A (reuses the tupe suite's bert_a MLMs)
      $PY -m launch compare --config=configs/compare.py:suite=tupe --workdir=runs/cmp/nopos-mlm $DATA \
        --config.runs_dir=$RUNS $MLM --config.schemes=bert_a,nopos --config.glue.tasks= ;;
    nopos-mlm-5k)    # the same pair at 5000 steps (10.2M tokens), where the scale scan's BERT-A MLM pulls ahead of NoPos
      $PY -m launch compare --config=configs/compare.py:suite=tupe --workdir=runs/cmp/nopos-mlm-5k $DATA \
        --config.runs_dir=runs/cmp/runs-5k --config.train.steps=5000 --config.train.eval_every=500 \
        --config.seeds=0,1,2 --config.schemes=bert_a,nopos --config.glue.tasks= ;;
    tupe-a-5k)       # TUPE-A vs BERT-A at 5000 steps, with GLUE; 16-bit dropout masks (the default), so its own runs
      $PY -m launch compare --config=configs/compare.py:suite=tupe --workdir=runs/cmp/tupe-a-5k \
        --config.data.name=wikitext --config.data.path=../shared/data/wikitext-2 \
        --config.runs_dir=runs/cmp/runs-5k-b16 --config.train.steps=5000 --config.train.eval_every=500 \
        --config.seeds=0,1,2 --config.schemes=bert_a,tupe_a --config.data.glue_dir=../shared/data/glue \
        --config.glue.tasks=sst2,mrpc,stsb,cola --config.glue.max_steps=150 --config.glue.learning_rate=3e-4 ;;
    tupe)            # TUPE: MLM curves of the four schemes + tied [CLS], then GLUE dev fine-tunes
      $PY -m launch compare --config=configs/compare.py:suite=tupe --workdir=runs/cmp/tupe $DATA \
        --config.runs_dir=$RUNS $MLM --config.schemes=bert_a,bert_r,tupe_a,tupe_r,tupe_a-tiedcls \
        --config.data.glue_dir=../shared/data/glue --config.glue.tasks=sst2,mrpc,stsb,cola \
        --config.glue.max_steps=150 --config.glue.learning_rate=3e-4 ;;
    publish)         # copy the reports (not the checkpoints) into docs/experiments/
      for s in extrapolation probe sinusoidal nopos-mlm nopos-mlm-5k tupe tupe-a-5k; do
        [ -f runs/cmp/$s/report.json ] || continue
        mkdir -p docs/experiments/$s
        (cd runs/cmp/$s && find . -maxdepth 2 \( -name '*.md' -o -name '*.json' -o -name '*.png' \) \
          -not -name config.json -not -path './glue/*' -not -path './.*' | while read -r f; do
            mkdir -p "../../../docs/experiments/$s/$(dirname "$f")"; cp "$f" "../../../docs/experiments/$s/$f"; done)
      done ;;
    *) echo "error: unknown step '$1', tools/run_experiments.sh, use one of: $STEPS" >&2; exit 2 ;;
  esac
}
STEPS="extrapolation probe probe-sweep sinusoidal tupe nopos-mlm nopos-mlm-5k tupe-a-5k publish"
set -f               # a step is a word, never a file pattern
for t in $*; do    # every step named is checked before the first one runs (hours of training)
  case " $STEPS " in
    *" $t "*) ;;
    *) echo "error: unknown step '$t', tools/run_experiments.sh, use one of: $STEPS" >&2; exit 2 ;;
  esac
done
for s in "${@:-$STEPS}"; do for t in $s; do step "$t"; done; done
