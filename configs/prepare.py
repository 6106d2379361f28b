"""`launch prepare` config: which corpus, which tokenizer, which examples (see tupe_jax/data/prepare.py).

Arg (comma-separated, all optional): `objective=mlm|clm` (default mlm), `max_len=N` (default 128),
`vocab_size=N` (default 30522, the TUPE paper's).

    python -m launch prepare --config=configs/prepare.py:objective=mlm,max_len=128 --workdir=prepared/wiki2 \
        --config.data.name=wikitext --config.data.path=../shared/data/wikitext-2
    python -m launch pretrain --config=configs/pretrain.py:pe=tupe_r --workdir=runs/x \
        --config.data.name=prepared --config.data.path=prepared/wiki2 --config.model.vocab_size=30522

Keys: `data.*` as for pretraining (name, path, file_pattern, split_by, holdout, packing, vocab_file, tfds_*;
`data.num_threads` = worker processes, 0 = all cores, the one key that may change on a resume);
`model.{objective, max_len, vocab_size}` (the run that reads the directory must use the same objective and
max_len, and a vocab_size >= the vocabulary's); `prepare.splits` ('' = every split the corpus has; tfds: train),
`prepare.shard_mb` (MB of text per shard, default 64: one worker's unit of work and of resumption).
"""
from __future__ import annotations

import ml_collections

from tupe_jax.config import lock, parse_arg
from tupe_jax.data import default_data_config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    arg = parse_arg(arg, objective="mlm", max_len=128, vocab_size=30522)
    config = ml_collections.ConfigDict()
    config.model = ml_collections.ConfigDict(dict(objective=arg.objective, max_len=int(arg.max_len),
                                                  vocab_size=int(arg.vocab_size)))
    config.data = default_data_config()
    config.data.num_threads = 0
    config.prepare = ml_collections.ConfigDict(dict(splits="", shard_mb=64.0))
    return lock(config)
