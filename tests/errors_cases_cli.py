"""The catalogue's rows for the command line itself (tests/errors_cases.py splices them in): flags, the --config
file a user wrote, the multi-process flags, and the commands a folder of another kind is given to.
"""
from __future__ import annotations

import os

from errors_inputs import Case, ROOT, config_file, finetune, other_run_workdir, pretrain, suite_with_runs, write

COMPARE = "--config=" + os.path.join(ROOT, "configs", "compare.py")
PREPARE = "--config=" + os.path.join(ROOT, "configs", "prepare.py")


def _compare(e, name: str, arg: str = "", *extra: str) -> list[str]:
    return ["compare", COMPARE + (f":{arg}" if arg else ""), f"--workdir={e.wd(name)}", *extra]


CLI_CASES = [
    Case("unknown_flag", "unknown command-line flag", lambda e: pretrain(e, "c1") + ["--bogus"], "--bogus"),
    Case("unknown_command", "unknown command", lambda e: ["pretrian", f"--workdir={e.wd('c2')}"], "pretrian"),
    Case("override_without_config", "override given to a command that reads the workdir's config",
         lambda e: ["evaluate", f"--workdir={e.run}", "--config.train.steps=3"], "--config.train.steps"),
    Case("bad_lengths", "extrapolate with malformed --lengths",
         lambda e: ["extrapolate", f"--workdir={e.run}", "--lengths=128,abc"], "--lengths"),
    Case("negative_step", "`evaluate --step=-1` (it was read as 'no checkpoint')",
         lambda e: ["evaluate", f"--workdir={e.run}", "--step=-1"], "--step"),
    Case("workdir_twice", "--workdir given twice to a one-run command (the last one was used)",
         lambda e: ["evaluate", f"--workdir={e.run}", f"--workdir={e.wd('w2')}"], "--workdir is given twice"),
    Case("config_twice", "--config given twice (the last one was used)",
         lambda e: pretrain(e, "c5") + [pretrain(e, "c5")[1]], "--config is given twice"),
    Case("override_twice", "an override given twice (the last one was used)",
         lambda e: pretrain(e, "c6") + ["--config.train.steps=3"], "--config.train.steps is given twice"),
    Case("config_arg_twice", "a config arg given twice (the last one was used)",
         lambda e: pretrain(e, "c7", "pe=tupe_r,pe=rope"), "config arg 'pe' is given twice"),
    Case("flag_abbreviated", "an abbreviated flag (--overwrite was taken for --overwrite_config)",
         lambda e: pretrain(e, "c8") + ["--overwrite"], "--overwrite"),
    Case("config_is_folder", "--config naming a folder",
         lambda e: ["pretrain", f"--config={ROOT}/configs", f"--workdir={e.wd('c9')}"], "is a folder"),
    Case("config_syntax_error", "a config file with a syntax error (names its line)",
         lambda e: ["pretrain", config_file(e, "syntax"), f"--workdir={e.wd('c10')}"], "syntax.py line 1"),
    Case("config_raises", "a config file whose get_config raises (names its line)",
         lambda e: ["pretrain", config_file(e, "raises"), f"--workdir={e.wd('c11')}"],
         "raises.py line 2: get_config raised RuntimeError: no such preset"),
    Case("config_not_configdict", "a config file returning a dict",
         lambda e: ["pretrain", config_file(e, "dict"), f"--workdir={e.wd('c12')}"], "get_config returned a dict"),
    Case("config_missing_section", "a config file without a section the command reads",
         lambda e: ["pretrain", config_file(e, "no_metrics"), f"--workdir={e.wd('c13')}"], "lacks section metrics"),
    Case("config_unknown_key", "a config file with a key nothing reads (train.stpes)",
         lambda e: ["pretrain", config_file(e, "misspelled"), f"--workdir={e.wd('c14')}"],
         "has unknown key train.stpes"),
    Case("process_id_alone", "--process_id without --num_processes (it ran single-process)",
         lambda e: pretrain(e, "c15") + ["--process_id=3"], "--process_id=3 without --num_processes"),
    Case("num_processes_zero", "--num_processes=0", lambda e: pretrain(e, "c16") + ["--num_processes=0"],
         "--num_processes=0 is not a process count"),
    Case("distributed_off_contradiction", "--distributed=off with --num_processes=2 (it ran single-process)",
         lambda e: pretrain(e, "c17") + ["--distributed=off", "--num_processes=2"], "--distributed=off contradicts"),
    Case("demo_override", "an override given to `demo` (its own fixed config)",
         lambda e: ["demo", f"--workdir={e.wd('c18')}", "--config.train.steps=3"], "'demo' runs its own fixed config"),
    Case("cudnn_off_gpu", "attention_backend=cudnn on a machine without a GPU",
         lambda e: pretrain(e, "c19", model__attention_backend="cudnn"), "--config.model.attention_backend"),
    Case("vocab_too_small", "model.vocab_size too small to learn a vocabulary (refused after reading the corpus)",
         lambda e: pretrain(e, "c20", model__vocab_size=10), "--config.model.vocab_size"),
    Case("split_by_unknown", "unknown data.split_by on the built-in corpus (it was ignored)",
         lambda e: pretrain(e, "c21", data__split_by="paragraph"), "--config.data.split_by"),
    Case("prepare_split_twice", "`prepare` with a split named twice (it was prepared twice)",
         lambda e: ["prepare", PREPARE, f"--workdir={e.wd('c22')}", "--config.prepare.splits=train,train"],
         "names a split twice"),
    # ---------------------------------------------------------------- fine-tunes, sweeps and suites
    Case("init_step_without_init_from", "init_step without init_from (it trained from scratch)",
         lambda e: finetune(e, "c23", init_from="", init_step=5), "init_step = 5 without init_from"),
    Case("glue_buckets_below_3", "data.glue_buckets holding 0",
         lambda e: finetune(e, "c24", data__glue_buckets="(0,64)"), "--config.data.glue_buckets"),
    Case("sweep_lrs_same_folder", "sweep.learning_rates naming one sub-run folder twice (one trained, both reported)",
         lambda e: ["glue-sweep", *finetune(e, "c25", sweep__learning_rates="(1e-4,1.0000001e-4)")[1:]],
         "same sub-run folder lr=0.0001"),
    Case("sweep_seed_twice", "a seed given twice in sweep.seeds",
         lambda e: ["glue-sweep", *finetune(e, "c26", sweep__seeds="(0,0)")[1:]], "same sub-run folder seed=0"),
    Case("compare_eval_mode", "unknown eval.mode in a suite (refused after all the pretraining)",
         lambda e: _compare(e, "c27", "", "--config.eval.mode=overlapping"), "--config.eval.mode"),
    Case("compare_max_tokens", "negative eval.max_tokens in a suite (it dropped the last token)",
         lambda e: _compare(e, "c28", "", "--config.eval.max_tokens=-1"), "--config.eval.max_tokens"),
    Case("compare_max_tokens_short", "eval.max_tokens that fills no window of the longest length (the lengths past "
         "it were scored on the same shorter windows, or NaN)",
         lambda e: _compare(e, "c28b", "", "--config.eval.max_tokens=100"), "fills no window of length"),
    Case("compare_over_a_report", "`compare` into a folder holding a REPORT.md it did not write (it was replaced)",
         lambda e: _compare(e, "c28c", "") if write(os.path.join(e.wd("c28c"), "REPORT.md"), b"my notes\n") else [],
         "holds REPORT.md but no config.json"),
    Case("analysis_out_in_a_suite", "an analysis's --out inside a compare suite (it replaced the suite's plots)",
         lambda e: ["extrapolate", f"--workdir={e.run}", "--lengths=16",
                    f"--out={suite_with_runs(e)}/seed0"],
         "is in the compare suite folder"),
    Case("report_of_a_run", "`report` on a pretraining run (no report.json)", lambda e: ["report", f"--workdir={e.run}"],
         "report.json does not exist"),
    Case("compare_probe_lr", "negative probe.learning_rate in a suite",
         lambda e: _compare(e, "c29", "suite=probe", "--config.probe.learning_rate=-1"), "--config.probe.learning_rate"),
    Case("compare_finetune_key", "a fine-tune key a suite sets itself (it was replaced silently)",
         lambda e: _compare(e, "c30", "suite=tupe", "--config.finetune.train.learning_rate=1e-3"),
         "--config.glue.learning_rate"),
    Case("compare_finetune_warmup", "a suite's fine-tune warmup_ratio 5 (refused after all the pretraining)",
         lambda e: _compare(e, "c31", "suite=tupe", "--config.finetune.train.warmup_ratio=5"),
         "--config.finetune.train.warmup_ratio"),
    # ---------------------------------------------------------------- folders of another kind
    Case("pretrain_into_suite", "pretrain into a compare folder (--overwrite_config was suggested and ruined it)",
         lambda e: pretrain(e, "x")[:2] + [f"--workdir={suite_with_runs(e)}"] + pretrain(e, "x")[3:],
         "holds a compare suite"),
    Case("overwrite_suite_with_runs", "--overwrite_config on a compare folder whose runs started",
         lambda e: _compare(e, "x")[:2] + [f"--workdir={suite_with_runs(e)}", "--overwrite_config"],
         "--overwrite_config would misrepresent"),
    Case("evaluate_suite", "`evaluate` on a compare folder (it said 'no checkpoint')",
         lambda e: ["evaluate", f"--workdir={suite_with_runs(e)}"], "holds a compare suite"),
    Case("prepare_into_run", "`prepare` into a pretraining run's folder",
         lambda e: ["prepare", PREPARE, f"--workdir={other_run_workdir(e)}"], "holds a pretraining run"),
]
