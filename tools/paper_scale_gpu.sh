#!/usr/bin/env bash
# The TUPE comparison at BERT-small size on ONE accelerator (a GPU, or a TPU host): pretrain BERT-A and TUPE-R
# (4 layers, d 512, 8 heads, MLP 2048, vocab 16384, 128 tokens, bf16; configs/compare.py size=medium:
# 4000 steps x batch 128 = 65.5M tokens each) on WikiText-2 (or a prepared corpus: DATA_ARGS), then fine-tune
# each on SST-2, MRPC, STS-B and CoLA. Sized to finish in about 10 minutes on an H200 at ~40% MFU, an ESTIMATE:
# this script has not run on an accelerator yet (no device was lent to the session that wrote it).
#
#   tools/paper_scale_gpu.sh                       # seed 0 into runs/paper-scale
#   SEEDS=0,1,2 OUT=gs://bucket/paper-scale tools/paper_scale_gpu.sh
#   DATA_ARGS="--config.data.name=prepared --config.data.path=/data/wiki-prepared" tools/paper_scale_gpu.sh
#
# Needs: pip install -e ".[cuda]" (or ".[tpu]"); GLUE TSVs in $GLUE (default ../shared/data/glue).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/paper-scale}
SEEDS=${SEEDS:-0}
GLUE=${GLUE:-../shared/data/glue}
DATA_ARGS=${DATA_ARGS:---config.data.name=wikitext --config.data.path=../shared/data/wikitext-2}
PY=${PY:-python}
# shellcheck disable=SC2086
exec "$PY" -m launch compare --config=configs/compare.py:suite=tupe,size=medium --workdir="$OUT" \
    --config.schemes=bert_a,tupe_r --config.seeds="$SEEDS" $DATA_ARGS --config.data.glue_dir="$GLUE" \
    --config.train.dropout_rng=rbg \
    --config.glue.tasks=sst2,mrpc,stsb,cola --config.glue.epochs=3 --config.glue.max_steps=1500 \
    --config.glue.learning_rate=1e-4 --config.glue.batch_size=32 "$@"
