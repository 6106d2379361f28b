"""Comparison suites: several positional schemes trained with identical data, seeds and compute, then analysed.

Arg (comma-separated, all optional): `suite=extrapolation|tupe|probe` (default extrapolation),
`size=tiny|small|medium|base|large` (default tiny: the model shape of configs/pretrain.py's preset, with short training).

    extrapolation  causal LMs bert_a, sinusoidal, rope, alibi, nopos trained at model.max_len (128), evaluated at
                   eval.lengths (128..1024): perplexity vs length (ALiBi, Press et al. 2022)
    tupe           MLM encoders bert_a, bert_r, tupe_a, tupe_r, tupe_a-tiedcls: validation MLM loss at equal steps,
                   then fine-tuning each on glue.tasks (TUPE, Ke et al. 2021, Table 1 / Fig. 5)
    probe          causal nopos, bert_a, sinusoidal, alibi + a bidirectional nopos MLM and its bert_a MLM reference:
                   perplexity / MLM loss and absolute-position probes per layer (NoPos, Haviv et al. 2022,
                   Tables 1 and 4, Fig. 2)

Ready-to-paste commands:

    # offline, the embedded corpus (minutes on a laptop CPU)
    python -m launch compare --config=configs/compare.py:suite=extrapolation --workdir=runs/cmp-extrapolation

    # WikiText-2 for the LMs, GLUE TSVs for fine-tuning
    python -m launch compare --config=configs/compare.py:suite=tupe --workdir=runs/cmp-tupe \
        --config.data.name=wikitext --config.data.path=../shared/data/wikitext-2 \
        --config.data.glue_dir=../shared/data/glue --config.glue.tasks=auto

    # the papers' sizes are a config change (BERT-base, 1M steps, on a TPU slice)
    python -m launch compare --config=configs/compare.py:suite=tupe,size=base --workdir=gs://b/cmp-tupe \
        --config.train.steps=1000000 --config.train.eval_every=10000 --config.data.name=tfds:wikipedia

Keys beyond configs/pretrain.py's (model/data/train/mesh/checkpoint are shared by every scheme of the suite):
  suite          which analyses run (above);
  schemes        comma-separated `<pe>[-mlm|-clm][-tiedcls]`; the objective defaults to `objective`; `-tiedcls`
                 turns TUPE's [CLS] untying off. Each scheme trains in `<runs_dir>/<pe>-<objective>[-tiedcls]/`;
                 model.pe / model.objective / model.untie_cls are set per scheme (untie_cls on for MLM).
  objective      default objective of the schemes (mlm | clm);
  seeds          comma-separated seeds (default "0"): every scheme trains once per seed; a seed sets init, dropout,
                 data order and masking (all schemes of a seed see the same data: paired comparisons) and the
                 fine-tuning seed. Runs live in `<runs_dir>/<scheme>-s<seed>/`. train.seed must stay 0.
                 With >= 3 seeds each finding gets a verdict (analysis/findings.py: mean ± std over seeds, paired
                 differences, "reproduced" only when they exceed the seed spread).
  runs_dir       '' = the compare workdir; else where the pretraining runs live, so suites can share them (a
                 finished run is reused, never retrained; a run with other model/data/train keys is refused);
  eval.lengths / eval.mode / eval.max_tokens   extrapolation (max_tokens 0 = whole validation split); with
                 suite=extrapolation eval.lengths must hold model.max_len and a longer length (the findings
                 measure growth = ln ppl(longest) − ln ppl(max_len));
  eval.stride    the stride S of eval.mode=sliding (required there, a positive number of tokens, capped at each
                 length L: analysis/extrapolate.py); 0 = unset, as eval.mode=nonoverlapping needs;
  probe.steps / probe.train_tokens / probe.eval_tokens / probe.learning_rate   the position probes: 30000
                 Adam steps of 512 tokens on 524288 training tokens (131072 from size=medium on). Each copy of
                 the features is train_tokens x (layers+1) x d x 4 bytes (0.8 GB tiny, 5 GB base, 13 GB large),
                 and about three are held at the peak: the features and their standardised copy in host memory,
                 that copy again on the accelerator. On the tiny causal runs 300 steps on 16384 tokens were far
                 from converged, 30000 on 524288 near it (docs/experiments/probe-sweep, `tools/run_experiments.sh
                 probe-sweep`); from size=small on, convergence is unmeasured;
  glue.tasks     comma-separated tasks; 'auto' = wordorder + every GLUE task with train and dev TSVs under
                 data.glue_dir (WNLI excluded, as in the TUPE paper; a data.glue_dir holding none is refused);
                 '' = no fine-tuning; every GLUE task named (not wordorder) must have its train and dev TSVs
                 there (checked before any pretraining), and a rerun may add tasks but not drop ones its
                 report.json has;
  glue.epochs / glue.learning_rate / glue.batch_size   one fine-tuning run per (scheme, seed, task);
  finetune       configs/glue.py's remaining sections (train, sweep, checkpoint, ...) for the fine-tunes;
  glue.max_steps fine-tuning steps per task are min(epochs x examples // batch, max_steps) (0 = no cap): a
                 capped big task (SST-2) sees only max_steps x batch_size training examples (said in the report).
"""
from __future__ import annotations

import os

import ml_collections

from tupe_jax.config import load_config, lock, parse_arg
from tupe_jax.errors import UserError

SUITES = {
    "extrapolation": ("bert_a,sinusoidal,rope,alibi,nopos", "clm"),
    "tupe": ("bert_a,bert_r,tupe_a,tupe_r,tupe_a-tiedcls", "mlm"),
    "probe": ("nopos,bert_a,sinusoidal,alibi,nopos-mlm,bert_a-mlm", "clm"),
}

# Compare-specific training presets per size: (steps, batch_size, learning_rate, warmup_steps, eval_every).
TRAIN = {
    "tiny": (500, 16, 1e-3, 50, 100),
    "small": (3000, 32, 5e-4, 300, 250),
    "medium": (4000, 128, 5e-4, 400, 500),     # tools/paper_scale_gpu.sh: minutes on one accelerator
    "base": (1_000_000, 256, 1e-4, 10_000, 10_000),
    "large": (1_000_000, 256, 1e-4, 10_000, 10_000),
}
# The probes' training tokens per size: tiny's is the probe-length sweep's near-converged cell; from medium on fewer,
# as about three copies of every layer's features of them are held (convergence unmeasured from small on).
PROBE_TRAIN_TOKENS = {"tiny": 524_288, "small": 524_288, "medium": 131_072, "base": 131_072, "large": 131_072}


def _sibling_config(name: str, arg: str):
    """`configs/<name>.py:get_config(arg)`, found next to this file (works wherever configs/ is)."""
    return load_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py") + ":" + arg)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """Build the locked comparison config for `arg` = "suite=...,size=..."."""
    arg = parse_arg(arg, suite="extrapolation", size="tiny")
    if arg.suite not in SUITES:
        raise UserError(f"unknown suite={arg.suite!r}", "--config=configs/compare.py:suite=...",
                        "use one of " + "|".join(SUITES))
    if arg.size not in TRAIN:
        raise UserError(f"unknown size={arg.size!r}", "--config=configs/compare.py:size=...",
                        "use one of " + "|".join(TRAIN))
    schemes, objective = SUITES[arg.suite]
    first_pe = schemes.split(",")[0].split("-")[0]
    pre = _sibling_config("pretrain", f"pe={first_pe},size={arg.size},objective={objective}")
    glue = _sibling_config("glue", f"task=wordorder,pe={first_pe},size={arg.size}")
    steps, batch, lr, warmup, eval_every = TRAIN[arg.size]

    config = ml_collections.ConfigDict()
    config.suite = arg.suite
    config.schemes = schemes
    config.objective = objective
    config.runs_dir = ""
    config.seeds = "0"
    config.model = ml_collections.ConfigDict(pre.model.to_dict())
    config.data = ml_collections.ConfigDict(pre.data.to_dict())
    config.train = ml_collections.ConfigDict(pre.train.to_dict())
    config.train.update(dict(steps=steps, batch_size=batch, learning_rate=lr, warmup_steps=warmup,
                             eval_every=eval_every, eval_steps=20, log_every=25, seed=0))
    config.mesh = ml_collections.ConfigDict(pre.mesh.to_dict())
    config.checkpoint = ml_collections.ConfigDict(pre.checkpoint.to_dict())
    config.checkpoint.every = 100_000            # the final step is always saved; intermediate ones are not needed
    config.metrics = ml_collections.ConfigDict(pre.metrics.to_dict())
    config.eval = ml_collections.ConfigDict(dict(lengths=(128, 256, 512, 1024), mode="nonoverlapping",
                                                 max_tokens=65536, stride=0))
    config.probe = ml_collections.ConfigDict(dict(steps=30000, train_tokens=PROBE_TRAIN_TOKENS[arg.size],
                                                  eval_tokens=4096, learning_rate=2e-3))
    config.glue = ml_collections.ConfigDict(dict(tasks="wordorder", epochs=3, learning_rate=1e-4, batch_size=32,
                                                 max_steps=150))
    # configs/glue.py's settings for the fine-tunes; task, model, data, mesh, init_from and the glue.* keys above
    # are filled in per (scheme, task) by the suite.
    config.finetune = ml_collections.ConfigDict({k: v for k, v in glue.to_dict().items()
                                                 if k not in ("model", "data", "mesh")})
    return lock(config)
