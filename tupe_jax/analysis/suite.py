"""Comparison suites (`python -m launch compare --config=configs/compare.py:suite=...`): several positional schemes
trained with identical data, seeds and compute, once per seed of `config.seeds`, then the suite's analyses per seed,
the seed statistics and verdicts (`analysis.findings`), then `REPORT.md` + PNGs + `report.json` (`analysis.report`).

    run(config, workdir) -> dict          the whole suite (resumable: finished pretraining / fine-tuning runs are
                                          reused, so rerunning the command only does what is missing; a run that
                                          diverges is recorded as such and the others go on)
    parse_schemes / parse_seeds / scheme_config   the (scheme, seed) grid (analysis/schemes.py)
    glue_tasks(config) -> [str]           `config.glue.tasks` resolved ('auto': what data.glue_dir holds;
                                          the fine-tunes: analysis/suite_glue.py)

Layout of a compare workdir:
    DIR/config.json, DIR/REPORT.md, DIR/report.json, DIR/*.png
    DIR/seed<k>/*.json, *.png                                  the analyses' own outputs for seed k
    <runs_dir or DIR>/<pe>-<objective>[-tiedcls]-s<k>/         one `launch pretrain` workdir per (scheme, seed)
    DIR/glue/<pe>-<objective>[-tiedcls]-s<k>/<task>/           one `launch finetune` workdir per (scheme, seed, task)
A seed sets the initialisation, dropout, data order and masking of a pretraining run and the fine-tuning seed; all
schemes of one seed see the same data in the same order (paired comparisons).
Suites: see configs/compare.py.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
import time
from typing import Any

import jax
import ml_collections

from tupe_jax import config as config_lib
from tupe_jax import files
from tupe_jax import workdir as workdir_lib
from tupe_jax.analysis import extrapolate, findings, probe, report
from tupe_jax.analysis.schemes import Scheme, parse_schemes, parse_seeds, run_name, run_path, scheme_config
from tupe_jax.analysis.suite_glue import (Preempted, check_finetunes, finetune_all, glue_tasks,
                                          refuse_other_config, validate_finetunes)
from tupe_jax.errors import Diverged, UserError, require
from tupe_jax.metrics import has_eval_at, read_metrics
from tupe_jax.pretrain.loop import pretrain
from tupe_jax.pretrain.validate import validate as validate_pretrain

SUITES = ("extrapolation", "tupe", "probe")


def runs_root(config: ml_collections.ConfigDict, workdir: str) -> str:
    return str(config.runs_dir) or workdir


def validate(config: ml_collections.ConfigDict, num_devices: int) -> None:
    """Everything checkable before compute: the shared sections, each scheme's config, the suite's keys."""
    config_lib.require_finite(config)
    require(config.suite in SUITES, f"unknown suite {config.suite!r}", "--config.suite", "use one of " + "|".join(SUITES))
    seeds = parse_seeds(config)
    runs_dir = str(config.runs_dir)
    require(not runs_dir or not os.path.exists(runs_dir) or os.path.isdir(runs_dir), f"runs_dir {runs_dir} is a "
            "file, not a folder", "--config.runs_dir", "give a folder for the suite's runs (or leave it empty)")
    require(int(config.train.seed) == 0, "train.seed is set per run from seeds in a comparison suite",
            "--config.train.seed", "use --config.seeds=<k>[,<k>...] instead")
    schemes = parse_schemes(config)
    for scheme in schemes:
        validate_pretrain(scheme_config(config, scheme, seeds[0]), num_devices)
    require(config.suite != "extrapolation" or any(s.objective == "clm" for s in schemes), "suite=extrapolation "
            f"scores causal LMs only and schemes {config.schemes!r} has none: every run would train and no "
            "extrapolation be written", "--config.schemes", "add a causal scheme (e.g. alibi-clm), or use "
            "suite=tupe or suite=probe for MLM encoders")
    require(len(config.eval.lengths) > 0 and min(config.eval.lengths) >= 2, f"eval.lengths = {config.eval.lengths} "
            "needs lengths of at least 2", "--config.eval.lengths", "write e.g. '(128,256,512,1024)'")
    require(str(config.eval.mode) in extrapolate.MODES, f"unknown eval.mode {config.eval.mode!r}",
            "--config.eval.mode", "use one of " + "|".join(extrapolate.MODES))
    stride = int(config.eval.stride)
    require(str(config.eval.mode) != "sliding" or stride > 0, f"eval.mode=sliding needs a positive eval.stride (it "
            f"is {stride}; without one the windows do not overlap)", "--config.eval.stride",
            "give the stride in tokens (e.g. --config.eval.stride=64), or use eval.mode=nonoverlapping")
    require(str(config.eval.mode) == "sliding" or stride == 0, f"eval.stride = {stride} is read by eval.mode=sliding "
            f"only (eval.mode={config.eval.mode} would ignore it)", "--config.eval.stride",
            "add --config.eval.mode=sliding, or drop eval.stride (0 = unset)")
    require(int(config.eval.max_tokens) >= 0, f"eval.max_tokens = {config.eval.max_tokens} is negative",
            "--config.eval.max_tokens", "give a token count, or 0 for the whole validation split")
    require(not int(config.eval.max_tokens) or int(config.eval.max_tokens) > max(config.eval.lengths),
            f"eval.max_tokens = {config.eval.max_tokens} fills no window of length {max(config.eval.lengths)} "
            "(eval.lengths)", "--config.eval.max_tokens", "give more tokens than the longest length, or 0 for the "
            "whole validation split")
    if config.suite == "extrapolation":   # growth = ln ppl(longest) - ln ppl(max_len): both must be scored
        lengths, train_len = tuple(int(n) for n in config.eval.lengths), int(config.model.max_len)
        example = f"write e.g. '({train_len},{2 * train_len},{4 * train_len})'"
        require(train_len in lengths, f"eval.lengths = {lengths} lacks the training length model.max_len = "
                f"{train_len}: the growth past it is measured from the perplexity at it", "--config.eval.lengths",
                example)
        require(max(lengths) > train_len, f"eval.lengths = {lengths} has no length above the training length "
                f"model.max_len = {train_len}: nothing past it would be scored", "--config.eval.lengths", example)
    for key in ("steps", "train_tokens", "eval_tokens", "learning_rate"):
        require(config.probe[key] > 0, f"probe.{key} must be positive", f"--config.probe.{key}", "give a positive value")
    for key in ("epochs", "batch_size", "learning_rate"):
        require(config.glue[key] > 0, f"glue.{key} must be positive", f"--config.glue.{key}", "give a positive value")
    require(config.glue.max_steps >= 0, "glue.max_steps must be >= 0", "--config.glue.max_steps", "0 = no cap")
    if config.suite == "tupe":
        validate_finetunes(config, seeds[0], num_devices)


# ================================================================================================ pretraining
def _check_same_run(path: str, sub: ml_collections.ConfigDict) -> None:
    """Refuse to reuse a run trained with other model/data/train keys (not identical compute; data.glue_dir is read
    only by fine-tuning, so suites with and without GLUE share pretraining runs; data.cache_dir is where derived
    data is kept, not what it is). train.eval_steps counts: the validation losses the report sets side by side are
    means over that many batches. A folder with checkpoints and no config.json cannot be told apart: refused."""
    require(not workdir_lib.checkpoint_steps(path) or files.isfile(workdir_lib.config_path(path)),
            f"{path} holds checkpoints but no config.json, so whether it was trained with this suite's keys is "
            "unknown", "--config.runs_dir", "move that folder aside (or restore its config.json), or use a fresh "
            "workdir/runs_dir")
    refuse_other_config(path, sub, ("model", "data", "train"),
                         ("train.log_every", "train.eval_every", "data.glue_dir", "data.cache_dir"), "trained",
                         "--config.runs_dir",
                         "use a fresh workdir/runs_dir, or the same config as that run")


def pretrain_all(config: ml_collections.ConfigDict, workdir: str, schemes: list[Scheme],
                 seeds: list[int]) -> dict[int, list[dict]]:
    """Train every (scheme, seed), seed by seed, skipping finished runs; {seed: [{'scheme', 'seed', 'path',
    'seconds', 'reused'}] in scheme order}."""
    root, total, out = runs_root(config, workdir), int(config.train.steps), {}
    jobs = [(seed, scheme, run_path(root, scheme, seed), scheme_config(config, scheme, seed))
            for seed in seeds for scheme in schemes]
    for _, _, path, sub in jobs:   # a run in runs_dir that cannot be reused stops the suite before any training
        _check_same_run(path, sub)
    for i, (seed, scheme, path, sub) in enumerate(jobs, 1):
        done = (workdir_lib.checkpoint_steps(path) or [None])[-1]
        head = f"[compare {config.suite}] [{i}/{len(jobs)}] {run_name(scheme, seed)}"
        info = {"scheme": scheme.name, "seed": seed, "path": path, "seconds": None, "reused": True}
        if done is not None and done >= total and has_eval_at(path, done):
            print(f"{head}: finished run at step {done} in {path}, reusing it", flush=True)
        elif done is not None and done >= total:     # stopped before its final evaluation: `pretrain` writes it
            print(f"{head}: finished run at step {done} in {path} without its final evaluation; writing it",
                  flush=True)
            pretrain(sub, path)
        else:
            print(f"{head}: pretraining {total} steps -> {path}", flush=True)
            start = time.time()
            try:
                final = pretrain(sub, path)
            except Diverged as err:   # a finding of the suite, not a failure of it: recorded, the others go on
                info.update(seconds=time.time() - start, reused=False, diverged=err.what)
                print(f"{head}: {err.what}; left out of every analysis (its comparisons get no verdict; a rerun "
                      "trains it again from its last checkpoint)", flush=True)
                out.setdefault(seed, []).append(info)
                continue
            info.update(seconds=time.time() - start, reused=False)
            if int(final.get("step", total)) < total:   # preempted (SIGTERM): stop here, the run resumes next time
                raise Preempted(f"pretraining {run_name(scheme, seed)} stopped at step {final.get('step')} of {total}")
            print(f"{head}: done in {info['seconds'] / 60:.1f} min", flush=True)
        out.setdefault(seed, []).append(info)
    return out


def pretrain_summary(path: str) -> dict:
    """From metrics.jsonl: train loss history, eval history, final values."""
    rows = read_metrics(path)
    train_rows = [r for r in rows if "loss" in r and "split" not in r]
    evals = [r for r in rows if "eval_loss" in r and "split" not in r]
    by_step: dict[int, dict] = {}
    for r in evals:                                   # a resumed run may log a step twice: keep the last
        by_step[int(r["step"])] = r
    evals = [by_step[s] for s in sorted(by_step)]
    tps = [r["tokens_per_sec"] for r in train_rows if "tokens_per_sec" in r]
    seconds, prev = 0.0, 0
    for r in train_rows:                              # step_time_s: mean over the steps since the previous row
        if "step_time_s" in r and int(r["step"]) > prev:
            seconds += float(r["step_time_s"]) * (int(r["step"]) - prev)
            prev = int(r["step"])
    return {"train": [{"step": int(r["step"]), "loss": float(r["loss"])} for r in train_rows],
            "eval": [{k: v for k, v in r.items() if k == "step" or k.startswith("eval_")} for r in evals],
            "final_eval": evals[-1] if evals else {},
            "median_tokens_per_sec": sorted(tps)[len(tps) // 2] if tps else None,
            "train_seconds": seconds}


def _summary(info: dict) -> dict:
    """A run's entry in the report: `pretrain_all`'s info and its metrics; a diverged run has no final values (and
    no folder when it diverged before its first checkpoint: the failed command removed what it had made)."""
    if info.get("diverged") and not files.exists(os.path.join(info["path"], "metrics.jsonl")):
        return {**info, "train": [], "eval": [], "final_eval": {}, "median_tokens_per_sec": None, "train_seconds": 0.0}
    out = {**info, **pretrain_summary(info["path"])}
    if info.get("diverged"):
        out["final_eval"] = {}
    return out


# ================================================================================================ the suite
def _command() -> str:
    """The command line that started this process (as `python -m launch ...` when it was the launcher)."""
    argv = list(sys.argv)
    if argv and argv[0].replace(os.sep, "/").endswith("launch/__main__.py"):
        argv = ["python", "-m", "launch"] + argv[1:]
    return " ".join(shlex.quote(a) for a in argv)


def _analyses(config: ml_collections.ConfigDict, schemes: list[Scheme], infos: list[dict], out: str) -> dict:
    """The suite's analyses of one seed's runs, written into `out`; {'extrapolation': ..., 'probe': ...}."""
    suite, result = str(config.suite), {}
    kept = [(s, r["path"]) for s, r in zip(schemes, infos) if not r.get("diverged")]
    paths = [p for _, p in kept]
    if suite == "extrapolation":
        causal = [p for s, p in kept if s.objective == "clm"]
        if not causal:                # every causal run of this seed diverged
            return result
        print(f"[compare {suite}] extrapolation of {out}: {len(causal)} runs at lengths "
              f"{tuple(config.eval.lengths)}", flush=True)
        result["extrapolation"] = extrapolate.run(causal, [int(x) for x in config.eval.lengths],
                                                  mode=str(config.eval.mode), out=out,
                                                  stride=int(config.eval.stride) or None,
                                                  max_tokens=int(config.eval.max_tokens) or None)
    if suite == "probe" and paths:
        settings = probe.ProbeSettings(steps=int(config.probe.steps), train_tokens=int(config.probe.train_tokens),
                                       eval_tokens=int(config.probe.eval_tokens),
                                       learning_rate=float(config.probe.learning_rate), seed=0)
        print(f"[compare {suite}] probes of {out}: {len(paths)} runs, {settings.steps} steps per probe", flush=True)
        result["probe"] = probe.run(paths, out=out, settings=settings)
    return result


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Train the suite's (scheme, seed) runs, run its analyses per seed, compute the findings over seeds and write
    REPORT.md, report.json and PNGs into `workdir`. Preempted (SIGTERM): stops as `pretrain` does, exit 0."""
    try:
        return _run(config, workdir)
    except Preempted as stop:
        print(f"[compare {config.suite}] {stop} (preempted); rerun the same command to continue (finished runs are "
              "reused)", flush=True)
        return {"preempted": True}


def _refuse_to_shrink(workdir: str, schemes: list[Scheme], seeds: list[int], tasks: list[str]) -> None:
    """A rerun with fewer schemes, seeds or GLUE tasks would replace the folder's report with one that covers less
    (a 3-seed report with verdicts by a 1-seed one); more may be added."""
    path = os.path.join(workdir, "report.json")
    if not os.path.isfile(path):
        return
    try:
        old = files.read_json(path)
        had = ([s["name"] for s in old["schemes"]], [int(k) for k in old["seeds"]],
               [str(t) for t in old.get("glue_tasks", [])])
    except (ValueError, KeyError, TypeError):
        return                             # not a report this can read: the suite writes a whole new one
    names = {s.name for s in schemes}
    lost = [n for n in had[0] if n not in names] + [f"seed {k}" for k in had[1] if k not in seeds] + \
        [f"GLUE task {t}" for t in had[2] if t not in tasks]
    require(not lost, f"{path} covers {', '.join(lost[:4])}{' ...' if len(lost) > 4 else ''}, which this command's "
            "suite lacks: its report would replace that one with less", "--config.schemes / --config.seeds / "
            "--config.glue.tasks", "give every scheme, seed and GLUE task the report has (more may be added), or "
            "use a fresh workdir")


def _run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    validate(config, jax.device_count())
    schemes, seeds, suite = parse_schemes(config), parse_seeds(config), str(config.suite)
    tasks = glue_tasks(config) if suite == "tupe" else []     # resolved once ('auto' lists data.glue_dir)
    _refuse_to_shrink(workdir, schemes, seeds, tasks)
    os.makedirs(workdir, exist_ok=True)
    timings: dict[str, float] = {}
    print(f"[compare {suite}] {len(schemes)} schemes x {len(seeds)} seeds: {', '.join(s.name for s in schemes)}; "
          f"{config.train.steps} steps x batch {config.train.batch_size} x {config.model.max_len} tokens each, "
          f"seeds {','.join(map(str, seeds))}, data {config.data.name}", flush=True)

    if tasks:
        check_finetunes(config, workdir, schemes, seeds, runs_root(config, workdir), tasks)
    start = time.time()
    runs = pretrain_all(config, workdir, schemes, seeds)
    timings["pretrain_s"] = time.time() - start
    result: dict[str, Any] = {
        "suite": suite, "command": _command(), "config": json.loads(config_lib.to_json(config)), "seeds": seeds,
        "schemes": [], "timings": timings}
    for i, scheme in enumerate(schemes):
        per_seed = {str(seed): _summary(runs[seed][i]) for seed in seeds}
        result["schemes"].append({**dataclasses.asdict(scheme), "name": scheme.name, "label": scheme.label,
                                  "seeds": per_seed})

    start = time.time()
    for seed in seeds:
        try:
            analyses = _analyses(config, schemes, runs[seed], os.path.join(workdir, f"seed{seed}"))
        except UserError as err:      # a run's unreadable checkpoint: `--step` is no flag of compare
            if err.where != "--step":
                raise
            raise UserError(err.what, "--config.runs_dir", "move that run's folder aside (a rerun trains it "
                            "again), or restore its checkpoint") from None
        for key, value in analyses.items():
            result.setdefault(key, {})[str(seed)] = value
    if suite in ("extrapolation", "probe"):
        timings[f"{suite}_s"] = time.time() - start
    if tasks:
        start = time.time()
        result["glue"] = finetune_all(config, workdir, schemes, runs, tasks)
        result["glue_tasks"] = tasks
        timings["glue_s"] = time.time() - start
    result["findings"] = findings.evaluate(result)

    if jax.process_index() == 0:   # one writer (the processes' command lines and timings differ)
        # report.json first, so a report can be re-rendered from it (report.render())
        files.write_json(os.path.join(workdir, "report.json"), result, indent=1)
        written = report.write(files.read_json(os.path.join(workdir, "report.json")), workdir)   # as `render` reads
        print(f"[compare {suite}] wrote {', '.join(written)} in {workdir}", flush=True)
    return result
