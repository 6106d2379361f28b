"""Pretraining config: one Transformer LM, any positional scheme, MLM encoder or causal decoder.

Arg (comma-separated, all optional): `pe=<scheme>` (default tupe_r), `size=tiny|small|medium|base|large` (default tiny),
`objective=mlm|clm` (default mlm).

Ready-to-paste commands:

    # a few minutes on a laptop CPU, the built-in corpus
    python -m launch pretrain --config=configs/pretrain.py:pe=tupe_r,size=tiny --workdir=runs/tiny-tupe_r \
        --config.train.steps=200 --config.train.batch_size=16

    # the same harness, causal LM, rotary positions
    python -m launch pretrain --config=configs/pretrain.py:pe=rope,size=tiny,objective=clm --workdir=runs/tiny-rope-clm

    # the TUPE paper's BERT-base recipe (batch 256 x 512, 1M steps) on a TPU pod slice, FSDP over all chips
    python -m launch pretrain --config=configs/pretrain.py:pe=tupe_r,size=base --workdir=gs://bucket/tupe_r-base \
        --config.data.name=tfds:wikipedia --config.mesh.data=1 --config.mesh.fsdp=-1

Schemes (`pe=`): bert_a (alias learned), sinusoidal, rope, alibi, t5, bert_r, nopos, tupe_a, tupe_r, bert_ad.
In causal configs (`objective=clm`) `model.untie_cls` is forced to False (there is no [CLS] token to untie) and
the model uses pre-LN blocks; MLM configs use post-LN as in TUPE's code. The MLM keys data.mask_prob,
data.max_predictions and data.packing given on the command line for a new causal run are refused (it reads none).

Continued pretraining (`--config.init_from=RUN`, a fresh workdir): RUN's model keys are taken where the command
line leaves them to the presets (a given one must equal RUN's), its tokenizer is copied, and every param starts at
RUN's checkpoint; data.vocab_file is refused (the tokenizer is RUN's), and a prepared directory (data.name=prepared)
must have been prepared with RUN's vocab.txt as data.vocab_file.

    python -m launch import-hf --from=path/to/bert-base-uncased --workdir=runs/bert-hf
    python -m launch pretrain --config=configs/pretrain.py --workdir=runs/bert-hf-wiki --config.init_from=runs/bert-hf \
        --config.data.name=tfds:wikipedia --config.train.steps=10000 --config.train.learning_rate=5e-5
"""
from __future__ import annotations

import ml_collections

from tupe_jax.config import lock, parse_arg
from tupe_jax.data import default_data_config
from tupe_jax.errors import UserError
from tupe_jax.model import OBJECTIVES
from tupe_jax.positional import ALIASES, SCHEMES

# Model-shape presets: (num_layers, hidden_size, num_heads, mlp_dim, vocab_size, max_len).
SIZES = {
    "tiny": (2, 128, 2, 512, 2048, 128),
    "small": (4, 256, 4, 1024, 8192, 128),
    "medium": (4, 512, 8, 2048, 16384, 128),      # BERT-small (Turc et al. 2019): the accelerator script's shape
    "base": (12, 768, 12, 3072, 30522, 512),
    "large": (24, 1024, 16, 4096, 30522, 512),
}

# Training presets per size: (steps, batch_size, learning_rate, warmup_steps, dtype).
# `base`/`large` record the TUPE paper's recipe: batch 256 x 512 tokens, peak lr 1e-4, 10k warmup, linear decay
# to 0 over 1M steps (Adam b=(0.9, 0.999), eps 1e-6, weight decay 0.01, clip 1.0, dropout 0.1: shared below).
TRAIN = {
    "tiny": (1000, 32, 1e-3, 100, "float32"),
    "small": (10_000, 64, 5e-4, 500, "float32"),
    "medium": (20_000, 128, 5e-4, 1000, "bfloat16"),
    "base": (1_000_000, 256, 1e-4, 10_000, "bfloat16"),
    "large": (1_000_000, 256, 1e-4, 10_000, "bfloat16"),
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """Build the locked pretraining config for `arg` = "pe=...,size=...,objective=..."."""
    arg = parse_arg(arg, pe="tupe_r", size="tiny", objective="mlm")
    pe = ALIASES.get(arg.pe, arg.pe)
    if pe not in SCHEMES:
        raise UserError(f"unknown positional scheme pe={arg.pe!r}", "--config=configs/pretrain.py:pe=...",
                        "use one of " + "|".join(SCHEMES + tuple(ALIASES)))
    for name, value, known in (("size", arg.size, tuple(SIZES)), ("objective", arg.objective, OBJECTIVES)):
        if value not in known:
            raise UserError(f"unknown {name}={value!r}", f"--config=configs/pretrain.py:{name}=...",
                            "use one of " + "|".join(known))
    layers, hidden, heads, mlp, vocab, max_len = SIZES[arg.size]
    steps, batch, lr, warmup, dtype = TRAIN[arg.size]
    causal = arg.objective == "clm"

    config = ml_collections.ConfigDict()
    config.model = ml_collections.ConfigDict(dict(
        num_layers=layers, hidden_size=hidden, num_heads=heads, mlp_dim=mlp, vocab_size=vocab, max_len=max_len,
        dtype=dtype, pe=pe, objective=arg.objective,
        untie_cls=not causal,            # forced False for clm: no [CLS] position to untie
        dropout_rate=0.1, attention_dropout_rate=0.1,
        rope_base=10000.0, rope_style="half", rope_fraction=1.0,
        rel_num_buckets=32, rel_max_distance=128,
        layer_norm_eps=1e-5, attention_backend="einsum", tupe_form="bias",
        sinusoidal_style="scaled",        # scaled | fairseq (the NoPos/ALiBi papers' table; positional/sinusoidal.py)
        dropout_bits=16,                  # 16 (four masks per hash) | 32 (flax's; runs made before the key); dropout.py
        type_vocab_size=0,                # segment embeddings: 0 none (TUPE's and our own models), 2 BERT's (import-hf)
        last_layer_rows="predicted",      # MLM: the last block at the head's positions only | all (runs before the key)
    ))
    config.data = default_data_config()  # keys documented in tupe_jax/data/__init__.py
    config.train = ml_collections.ConfigDict(dict(
        steps=steps, batch_size=batch, learning_rate=lr, warmup_steps=warmup,
        decay_steps=0,                    # 0: decay to zero at train.steps
        seed=0, weight_decay=0.01, clip_norm=1.0, adam_b1=0.9, adam_b2=0.999, adam_eps=1e-6,
        grad_accum_steps=1, log_every=50, eval_every=1000, eval_steps=20,
        dropout_rng="threefry2x32",       # threefry2x32 | rbg | unsafe_rbg (rbg: faster masks on GPU/TPU)
        profile_steps="",                 # "START,END": a jax.profiler trace of those steps in workdir/profile/
    ))
    config.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))  # -1: fill with remaining devices
    config.checkpoint = ml_collections.ConfigDict(dict(every=1000, keep=3, async_save=True))
    config.metrics = ml_collections.ConfigDict(dict(peak_tflops=0.0))  # per-device peak for MFU; 0: look up
    # Continue pretraining from another run or an import (import-hf, import-fairseq), in a fresh workdir: its
    # params, tokenizer and model keys; the optimizer, the schedule (warmup included) and the data start anew.
    config.init_from = ""                 # that run's workdir, its checkpoints/ or checkpoints/<step>
    config.init_step = -1                 # its checkpoint step; -1: the newest
    return lock(config)
