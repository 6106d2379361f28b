"""config.json, and the gate every command passes before it writes anything into a run's folder.

`check_config(workdir, config)` compares the new config with the folder's `config.json` and with its
checkpoints, and writes nothing. Only the `RESUMABLE` keys (meta.py) may differ (how long and how a run proceeds, never
what it computes); any other difference is refused naming the key and both values. The length is the exception
that needs a second look: where `train.steps` also sets the learning-rate schedule (decay_steps=0, or a fine-tune)
a longer run would train its next steps on another schedule, so that is refused too, unless `train.decay_steps` is
set to keep the schedule (`_schedule`). An allowed change is recorded in `config_history.jsonl` (time, command
line, key: [old, new]) when `write_config` stores the new config.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Optional

import ml_collections

from tupe_jax import config as config_lib
from tupe_jax import files
from tupe_jax.errors import UserError, require
from tupe_jax.optim import schedule_span
from tupe_jax.workdir.meta import HASHED_RESUMABLE, latest_meta, resumable, same_identity, with_added_defaults

HISTORY = "config_history.jsonl"


def config_path(workdir: str) -> str:
    return files.join(workdir, "config.json")


def tokenizer_path(workdir: str) -> str:
    return files.join(workdir, "tokenizer", "vocab.txt")


def _read_stored(path: str) -> dict[str, Any]:
    try:
        return files.read_json(path)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{path} is not valid JSON ({err})", "--workdir",
                        "restore it from a backup, or move the folder aside and use a fresh workdir") from None


def read_config(workdir: str) -> ml_collections.ConfigDict:
    """`workdir/config.json` as a locked ConfigDict (UserError if missing or not JSON)."""
    path = config_path(workdir)
    require(files.isfile(path), f"{path} does not exist", "--workdir", "point it at a run made by `launch pretrain`")
    return config_lib.lock(ml_collections.ConfigDict(_read_stored(path)))


# A fine-tune's, sweep's or suite's results, a prepared corpus's manifest: what a config change would misrepresent
# and a failed command keeps (undo.py).
RESULTS = ("results.json", "sweep.json", "report.json", "manifest.json")
WRITTEN = ("REPORT.md", "sweep.md", "metrics.jsonl", "loss.png")   # and what would be rewritten or appended to


def _has_results(workdir: str) -> bool:
    """Results (`RESULTS`) are in the folder."""
    return any(files.exists(files.join(workdir, name)) for name in RESULTS)


def holds_runs(workdir: str) -> bool:
    """A run's config.json is in a sub-folder up to three levels down (a suite's, a sweep's sub-runs)."""
    return any(files.glob(workdir, "/".join(["*"] * depth) + "/config.json") for depth in (1, 2, 3))


# What the top-level keys of a config.json say the folder holds (a pretraining run: none of these).
KINDS = (("suite", "a compare suite (`launch compare`)"), ("prepare", "a prepared corpus (`launch prepare`)"),
         ("task", "a fine-tuning run"))


def finetune_kind(workdir: str, config: Any) -> str:
    """"a glue-sweep folder (cola,rte)" for a sweep's root (its sub-runs below it), else "a fine-tuning run (rte)"."""
    if holds_runs(workdir):
        return f"a glue-sweep folder ({config.get('sweep', {}).get('tasks') or config.task})"
    return f"a fine-tuning run ({config.task})"


def refuse_inside_suite(path: str, where: str) -> None:
    """Refuse an output folder a compare suite's report embeds files from: the suite folder, its `seed<k>/` or
    `glue/` and what lies in `glue/` (an analysis of other runs would replace them). Its runs' folders are fine."""
    if files.is_remote(path):                 # checked where the bucket is (check_bucket), not here
        return
    folder = Path(os.path.abspath(os.path.expanduser(str(path))))
    for suite_dir, rest in ((folder, ""), (folder.parent, folder.name),
                            (folder.parent.parent, f"{folder.parent.name}/{folder.name}")):
        owned = rest == "" or re.fullmatch(r"seed\d+|glue(/[^/]+)?", rest)
        try:
            suite = bool(owned) and files.isfile(config_path(str(suite_dir))) and "suite" in _read_stored(
                config_path(str(suite_dir)))
        except UserError:                      # unreadable: not ours to judge here
            suite = False
        require(not suite, f"{path} is {'in ' if rest else ''}the compare suite folder {suite_dir}, whose report "
                "embeds the files there", where, "give the outputs a folder of their own")


def folder_kind(config: Any) -> str:
    """"a fine-tuning run", "a compare suite (...)", ..., or "a pretraining run", from a config's top-level keys."""
    return next((name for key, name in KINDS if key in config), "a pretraining run")


def _schedule(flat: dict[str, Any]) -> tuple:
    """What a run's learning-rate schedule depends on (`optim.learning_rate_fn`; a fine-tune's spans its steps or
    epochs): the steps where the linear decay reaches 0 and the warmup (cut to that span)."""
    if "train.warmup_ratio" in flat:      # a fine-tune (finetune/validate.py: schedule_section)
        return flat.get("train.steps"), flat.get("train.epochs")
    return schedule_span(flat.get("train.steps") or 0, flat.get("train.decay_steps") or 0,
                         flat.get("train.warmup_steps") or 0)


def _refuse_new_schedule(old: dict[str, Any], new: dict[str, Any], finetune: bool) -> None:
    """A resume whose steps would change the learning-rate schedule of the steps already trained: it would compute
    neither the run it continues nor a fresh run of the new length."""
    if finetune:
        raise UserError(f"train.steps/epochs {old.get('train.steps')}/{old.get('train.epochs')} -> "
                        f"{new.get('train.steps')}/{new.get('train.epochs')} would change this fine-tune's learning-"
                        "rate schedule (warmup and decay span its steps) after it started", "--config.train.steps",
                        "fine-tune into a fresh workdir")
    total, _ = _schedule(old)
    raise UserError(f"train.steps {old.get('train.steps')} -> {new.get('train.steps')} would change this run's "
                    f"learning-rate schedule (it decays to 0 at step {total}: train.decay_steps="
                    f"{old.get('train.decay_steps')} means train.steps)", "--config.train.steps",
                    f"train on with the run's schedule by adding --config.train.decay_steps={total} (the rate is 0 "
                    f"after step {total}), or train a fresh run of the new length")


def _refuse_other_finetune_kind(workdir: str, kind: Optional[str], step: Optional[int]) -> None:
    """`finetune` into a sweep's root, or `glue-sweep` into a fine-tuning run: each would write its files among
    the other's (checkpoints beside sweep.json, sub-runs inside a run)."""
    if kind == "finetune":         # (each test only for its command: holds_runs lists three levels of folders)
        held, made = "a glue-sweep folder", "a fine-tuning run"
        found = files.exists(files.join(workdir, "sweep.json")) or holds_runs(workdir)
    elif kind == "glue-sweep":
        held, made = "a fine-tuning run", "a glue-sweep folder"
        found = step is not None or files.exists(files.join(workdir, "results.json"))
    else:
        return
    require(not found, f"{workdir} holds {held}; this command makes {made}", "--workdir",
            "give each command its own workdir")


def _shown(key: str, old: Any, new: Any) -> str:
    return f"{key}={old!r} (this command: {new!r})"


def check_config(workdir: str, config: ml_collections.ConfigDict, overwrite: Optional[bool] = None,
                 kind: Optional[str] = None) -> list[tuple[str, Any, Any]]:
    """The gate: [(key, old, new)] of the allowed changes against the folder's run; UserError for anything else.
    Reads only. `overwrite=True` replaces a config.json that no checkpoint or result depends on; `None` = the
    caller offers no such option (its messages do not suggest it). `kind`: the command ('finetune', 'glue-sweep'),
    which tells a fine-tuning run from a sweep's root (their configs have the same keys)."""
    path = config_path(workdir)
    step, meta = latest_meta(workdir)
    new = json.loads(config_lib.to_json(config))
    if not files.isfile(path):
        require(step is None or not meta.get("identity") or same_identity(meta["identity"], new),
                f"{workdir}/checkpoints (step {step}) were trained with other model/data settings and the folder has "
                "no config.json", "--workdir", "use a fresh workdir")
        # a run's tokenizer too (not a prepare's, which records the text it was learned on): a new run would take
        # that vocabulary as its own, over data.vocab_file or the one its corpus gives
        ours = WRITTEN + (("tokenizer/vocab.txt",) if "prepare" not in new else ())
        found = [n for n in RESULTS + ours if files.exists(files.join(workdir, n))]
        require(not found, f"{workdir} holds {found[0] if found else ''} but no config.json: a file of the name a "
                "command writes there, made by something else (or its run's config.json was removed)", "--workdir",
                "use a fresh workdir, or move that file aside")
        return []
    old = _read_stored(path)
    if folder_kind(old) != folder_kind(new):
        raise UserError(f"{workdir} holds {folder_kind(old)}; this command makes {folder_kind(new)}", "--workdir",
                        "give each command its own workdir" + (" (init_from reads the pretraining run, it is not "
                                                               "written)" if "task" in new else ""))
    _refuse_other_finetune_kind(workdir, kind, step)
    if overwrite:
        require(step is None and not _has_results(workdir) and not holds_runs(workdir),
                f"--overwrite_config would misrepresent {workdir}: its checkpoints/results were made with the "
                "stored config.json", "--overwrite_config", "use a fresh workdir")
        return []
    flat_old = with_added_defaults(config_lib.flatten(old))      # both sides: a config section without the key
    flat_new = with_added_defaults(config_lib.flatten(new))      # (e.g. prepare's small `model`) reads the same
    changed = [k for k in sorted(set(flat_old) | set(flat_new)) if flat_old.get(k) != flat_new.get(k)]
    same_schedule = _schedule(flat_old) == _schedule(flat_new)
    # init_step is resumable for a fine-tune (its results.json names the step read); a continued pretraining read
    # its init_step when it started, and its config.json must keep naming that step once it has a checkpoint
    read_init = step is not None and "task" not in new
    refused = [k for k in changed if (not resumable(k) or (k == "init_step" and read_init))
               and not (k == "train.decay_steps" and same_schedule and "task" not in new)]
    if refused:
        more = f" and {len(refused) - 1} more ({', '.join(refused[1:4])})" if len(refused) > 1 else ""
        fresh = step is None and not _has_results(workdir) and not holds_runs(workdir)
        first = _shown(refused[0], flat_old.get(refused[0]), flat_new.get(refused[0]))
        raise UserError(f"{path} holds a run with {first}{more}", "--workdir",
                        "resume with the run's settings (only steps, logging, checkpointing, mesh and data-loading "
                        "keys may change) or use a fresh workdir"
                        + (" (or --overwrite_config: nothing was trained there yet)"
                           if fresh and overwrite is not None else ""))
    steps = flat_new.get("train.steps")
    if step is not None and isinstance(steps, int) and 0 < steps < step:
        raise UserError(f"{workdir} is at step {step}; train.steps={steps} would end before it", "--config.train.steps",
                        f"give train.steps >= {step} to continue, or evaluate the run as it is")
    more = not (isinstance(steps, int) and 0 < steps <= step) if step is not None else False   # steps left to train
    if more and not same_schedule and any(k in changed for k in ("train.steps", "train.epochs")):
        _refuse_new_schedule(flat_old, flat_new, "task" in new)
    if step is not None and meta.get("identity") and not same_identity(meta["identity"], new,
                                                                      paths_then(workdir, flat_old)):
        raise UserError(f"{path} does not match its checkpoint step {step} (model/data settings differ: was "
                        "config.json edited by hand?)", "--workdir", "restore the run's config.json or use a fresh "
                        "workdir")
    return [(k, flat_old.get(k), flat_new.get(k)) for k in changed]


def write_config(workdir: str, config: ml_collections.ConfigDict, overwrite: Optional[bool] = None,
                 write: bool = True) -> None:
    """Pass the gate (`check_config`), then (process 0, `write`) store config.json, appending the allowed changes
    to config_history.jsonl. An unchanged config is not rewritten."""
    changes = check_config(workdir, config, overwrite=overwrite)
    if write:
        store_config(workdir, config, changes)


def paths_then(workdir: str, flat_old: dict[str, Any]) -> list[dict[str, Any]]:
    """The values `HASHED_RESUMABLE` keys had in this run: config.json's, and each older one config_history.jsonl
    records (a checkpoint made before session 41 hashed the path it was made with, maybe not config.json's now)."""
    now = {k: flat_old[k] for k in HASHED_RESUMABLE if k in flat_old}
    then, path = [now], files.join(workdir, HISTORY)
    for line in (files.read_text(path).splitlines() if files.isfile(path) else []):
        try:
            changes = json.loads(line).get("changes") or {}
        except (ValueError, AttributeError):
            continue                # a torn or foreign line: its values are not needed to read the others
        row = {k: v[0] for k, v in changes.items() if k in now and isinstance(v, list) and v}
        then += [{**now, k: v} for k, v in row.items()] + ([{**now, **row}] if len(row) > 1 else [])
    return then


def store_config(workdir: str, config: ml_collections.ConfigDict, changes: list[tuple[str, Any, Any]]) -> None:
    """Store config.json (unless unchanged) and record `changes` (from `check_config`) in config_history.jsonl."""
    text = config_lib.to_json(config) + "\n"
    path = config_path(workdir)
    if files.isfile(path) and files.read_text(path) == text:
        return
    if changes:
        row = {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "command": " ".join(sys.argv), "changes": {k: [a, b] for k, a, b in changes}}
        files.append_text(files.join(workdir, HISTORY), files.to_json(row, indent=None) + "\n")
        fewer = [b for k, a, b in changes if k == "checkpoint.keep" and isinstance(a, int) and isinstance(b, int)
                 and b < a]
        print(f"{workdir}: config changed (recorded in {HISTORY}): "
              + "; ".join(f"{k} {a!r} -> {b!r}" for k, a, b in changes)
              + (f" (only the newest {fewer[0]} checkpoints are kept: older steps are deleted at the next save)"
                 if fewer else ""), flush=True)
    files.write_text(path, text)


def differing_keys(workdir: str, config: ml_collections.ConfigDict, sections: tuple[str, ...],
                   ignore: tuple[str, ...] = ()) -> list[str]:
    """"key: old -> new" for keys of `sections` where `workdir/config.json` differs from `config` (bar `ignore`
    prefixes); [] when the folder has no config.json."""
    path = config_path(workdir)
    if not files.isfile(path):
        return []
    old = config_lib.unflatten(with_added_defaults(config_lib.flatten(_read_stored(path))))
    new = config_lib.unflatten(with_added_defaults(config_lib.flatten(config.to_dict())))
    return [d for d in config_lib.config_differences(old, new, sections) if not d.startswith(ignore)]
