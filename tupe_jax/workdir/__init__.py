"""Everything about a run's folder (`--workdir`). A folder changes only through `claim`, the one gate.

    gate.py    config.json: `check_config` (before anything is written: the stored config and the checkpoints
               against the new one; only `meta.RESUMABLE` keys may change, each change recorded in
               config_history.jsonl), `read_config`, `write_config`
    lock.py    one run per folder: `RunLock` (`.lock`, an exclusive flock that dies with its process);
               `refuse_if_held` (read only: a live holder is refused before the gate reads its checkpoints)
    claim.py   `claim(workdir, config)`: check, lock, write, run; after a failure undo what the command wrote
    undo.py    `Before`: the folder as a command found it, and putting it back after a failure; `staging_folder`
    provenance.py  `provenance.jsonl`: a row per command (command line, git commit, packages, devices, processes)
    meta.py    what defines a run (`RESUMABLE`, `identity_hash`) and the checkpoint's meta item (`make_meta`,
               `check_compatible`, `check_tokenizer`), `checkpoint_steps`, `checkpoint_identity` (when a step was
               saved: a fine-tune's record of its source), `read_meta`, `read_kept_step` (a step of a
               run that may still be training and pruning its checkpoints)
    run.py     `LoadedRun` / `load_run`: a finished run for evaluate, fine-tuning and every analysis (`corpus_config`:
               its config naming another corpus to score)

A run folder holds:
    config.json          the resolved config (what the run is; `config_history.jsonl`: the allowed changes)
    provenance.jsonl     who ran what where: one row per command that claimed the folder
    tokenizer/vocab.txt  the run's WordPiece vocabulary (data.tokenizer)
    checkpoints/<step>/  Orbax items state / data / meta (checkpoint.py; meta from `make_meta`)
    metrics.jsonl, tensorboard/   (metrics.py)
    results.json, predictions/    fine-tuning runs (finetune/)
    analysis/            outputs of the analysis commands (default `--out`)
    logs/                the full traceback of an unexpected failure (the launcher's last resort)
    profile/             a jax.profiler trace when `train.profile_steps` is set
Whole-file writes go through `files.write_json` / `files.write_text` (atomic).
"""
from tupe_jax.workdir.claim import agree, check_bucket, check_folder, claim, refuse_in_checkpoints, still_held
from tupe_jax.workdir.gate import check_config, config_path, differing_keys, read_config, tokenizer_path, write_config
from tupe_jax.workdir.lock import LeaseLost, RunLock, owns_folder, refuse_if_held
from tupe_jax.workdir.meta import (RESUMABLE, RUN_IDENTITY_SECTIONS, check_compatible, check_tokenizer,
                                   checkpoint_identity, checkpoint_steps, make_meta, read_kept_step, read_meta)
from tupe_jax.workdir.run import LoadedRun, corpus_config, load_run, load_runs
from tupe_jax.workdir.undo import staging_folder

__all__ = ["RESUMABLE", "RUN_IDENTITY_SECTIONS", "LeaseLost", "LoadedRun", "RunLock", "agree", "check_compatible",
           "check_bucket", "check_config", "check_folder", "check_tokenizer", "checkpoint_identity",
           "checkpoint_steps", "claim",
           "config_path", "corpus_config", "differing_keys", "load_run", "load_runs", "make_meta", "owns_folder",
           "read_config", "read_kept_step", "read_meta", "refuse_if_held", "refuse_in_checkpoints", "staging_folder",
           "still_held", "tokenizer_path", "write_config"]
