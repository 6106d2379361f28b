"""Comparison suites: configs, scheme and seed parsing, GLUE task resolution, the seed-statistics verdict rule, and
tiny suites end to end (two seeds)."""
import json
import os

import pytest

import launch
from tupe_jax.analysis import findings
from tupe_jax.analysis import report as report_lib
from tupe_jax.analysis import suite as suite_lib
from tupe_jax import config as config_lib
from tupe_jax.errors import UserError
from tests.workdir_fixtures import tree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "compare.py")


def load(arg, **overrides):
    config = config_lib.load_config(f"{CONFIG}:{arg}")
    return config_lib.apply_overrides(config, {k: str(v) for k, v in overrides.items()})


@pytest.mark.parametrize("suite", ["extrapolation", "tupe", "probe"])
def test_every_suite_config_validates(suite):
    config = load(f"suite={suite}")
    suite_lib.validate(config, 8)           # what the launcher checks: every scheme's own pretraining config too
    schemes = suite_lib.parse_schemes(config)
    assert len(schemes) >= 5
    assert len({suite_lib.scheme_config(config, s, 0).model.pe for s in schemes}) >= 4


def test_scheme_names_objectives_and_tied_cls():
    config = load("suite=tupe", schemes="tupe_a,learned-clm,tupe_a-tiedcls,nopos-mlm")
    schemes = suite_lib.parse_schemes(config)
    assert [s.name for s in schemes] == ["tupe_a-mlm", "bert_a-clm", "tupe_a-mlm-tiedcls", "nopos-mlm"]
    subs = [suite_lib.scheme_config(config, s, 0).model for s in schemes]
    assert [m.untie_cls for m in subs] == [True, False, False, True]
    assert [m.objective for m in subs] == ["mlm", "clm", "mlm", "mlm"]
    # everything but the scheme keys is shared
    shared = {k: v for k, v in subs[0].items() if k not in ("pe", "objective", "untie_cls")}
    assert all({k: v for k, v in m.items() if k in shared} == shared for m in subs)


@pytest.mark.parametrize("schemes,needle", [("bert_a,nonsense", "nonsense"), ("bert_a-xyz", "-xyz"), ("rope-fairseq", "sinusoidal"),
                                            ("alibi-clm-tiedcls", "tiedcls"), ("rope,rope", "twice"), ("", "no"),
                                            ("alibi-mlm-clm", "twice or both"), ("bert_a-mlm-mlm", "twice or both")])
def test_bad_schemes_are_one_line_errors(schemes, needle):
    with pytest.raises(UserError, match=needle):
        suite_lib.parse_schemes(load("suite=extrapolation", schemes=schemes))


def test_seeds_parse_and_set_the_run_seed():
    config = load("suite=tupe", seeds="2, 0,5")
    assert suite_lib.parse_seeds(config) == [2, 0, 5]
    scheme = suite_lib.parse_schemes(config)[0]
    assert [suite_lib.scheme_config(config, scheme, k).train.seed for k in (2, 5)] == [2, 5]
    assert suite_lib.run_name(scheme, 5) == "bert_a-mlm-s5"


@pytest.mark.parametrize("seeds,needle", [("0,x", "'x'"), ("1,1", "twice"), ("", "no seeds"), ("-1", "'-1'"),
                                          ("0,99999999999999999999", r"\[0, 2\*\*32\)"), ("0,\u00b2", "'\u00b2'"),
                                          ("0,4294967296", r"\[0, 2\*\*32\)")])
def test_bad_seeds_are_one_line_errors(seeds, needle):
    with pytest.raises(UserError, match=needle):
        suite_lib.parse_seeds(load("suite=tupe", seeds=seeds))


def test_seeds_are_refused_where_jax_keys_would_alias_them():
    import jax  # pylint: disable=import-outside-toplevel
    # the reason for the 2**32 limit: a JAX key keeps 32 bits of its seed (64-bit JAX off)
    assert (jax.random.PRNGKey(2 ** 32 + 1) == jax.random.PRNGKey(1)).all()
    assert suite_lib.parse_seeds(load("suite=tupe", seeds=f"{2 ** 32 - 1}")) == [2 ** 32 - 1]
    with pytest.raises(UserError, match=r"train.seed = 4294967296 is outside \[0, 2\*\*32\)"):
        config_lib.require_seed(load("suite=tupe", **{"train.seed": 2 ** 32}))


def test_train_seed_is_refused_in_a_suite():
    with pytest.raises(UserError, match="--config.seeds"):
        suite_lib.validate(load("suite=extrapolation", **{"train.seed": 3}), 8)


def test_bad_suite_is_a_user_error():
    with pytest.raises(UserError, match="suite"):
        load("suite=nope")


def test_glue_tasks_auto_finds_the_tsvs(tmp_path):
    (tmp_path / "RTE").mkdir()
    for split in ("train", "dev"):
        (tmp_path / "RTE" / f"{split}.tsv").write_text("index\tsentence1\tsentence2\tlabel\n")
    (tmp_path / "QNLI").mkdir()
    (tmp_path / "QNLI" / "dev.tsv").write_text("")           # dev only: not usable
    config = load("suite=tupe", **{"glue.tasks": "auto", "data.glue_dir": tmp_path})
    assert suite_lib.glue_tasks(config) == ["wordorder", "rte"]
    assert suite_lib.glue_tasks(load("suite=tupe", **{"glue.tasks": "auto"})) == ["wordorder"]
    with pytest.raises(UserError, match="glue_dir"):      # before any training
        suite_lib.validate(load("suite=tupe", **{"glue.tasks": "rte"}), 8)


@pytest.mark.parametrize("tasks,glue_dir,needle", [
    ("rte", "missing", "data.glue_dir .*missing is not a folder"),
    ("wordorder,qnli", "here", "no train and dev files of GLUE task 'qnli'"),
    ("auto", "empty", "holds no GLUE task with train and dev files"),
    ("auto", "missing", "is not a folder")])
def test_glue_tasks_the_folder_lacks_are_refused_before_any_training(tmp_path, tasks, glue_dir, needle):
    """A missing folder or task was found after all the pretraining (hours); with 'auto' the GLUE fine-tunes were
    dropped without a word."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "here" / "QNLI").mkdir(parents=True)
    (tmp_path / "here" / "QNLI" / "dev.tsv").write_text("index\tquestion\tsentence\tlabel\n0\ta\tb\tentailment\n")
    config = load("suite=tupe", **{"glue.tasks": tasks, "data.glue_dir": tmp_path / glue_dir})
    with pytest.raises(UserError, match=needle):
        suite_lib.validate(config, 8)


def test_a_rerun_with_fewer_glue_tasks_is_refused(tmp_path):
    """A rerun without a task replaced the report with one lacking its fine-tunes (its old glue.png stayed)."""
    (tmp_path / "report.json").write_text(json.dumps({"schemes": [{"name": "tupe_a-mlm"}], "seeds": [0],
                                                      "glue_tasks": ["wordorder"]}))
    config = load("suite=tupe", schemes="tupe_a", seeds="0", **{"glue.tasks": ""})
    with pytest.raises(UserError, match="covers GLUE task wordorder, which this command's suite lacks"):
        suite_lib._refuse_to_shrink(str(tmp_path), suite_lib.parse_schemes(config), [0], suite_lib.glue_tasks(config))
    more = load("suite=tupe", schemes="tupe_a", seeds="0", **{"glue.tasks": "wordorder"})
    suite_lib._refuse_to_shrink(str(tmp_path), suite_lib.parse_schemes(more), [0], suite_lib.glue_tasks(more))


TINY = {"model.hidden_size": 32, "model.num_layers": 2, "model.num_heads": 2, "model.mlp_dim": 64,
        "model.vocab_size": 512, "model.max_len": 32, "train.steps": 20, "train.batch_size": 8,
        "train.warmup_steps": 4, "train.eval_every": 10, "train.eval_steps": 2, "train.log_every": 5,
        "checkpoint.async_save": "false", "eval.lengths": "(16,32,64)", "eval.max_tokens": 2048}


@pytest.mark.slow
def test_tiny_extrapolation_suite_end_to_end_and_resume(tmp_path, capsys):
    cache = tmp_path / "cache"
    workdir = tmp_path / "cmp"
    argv = ["compare", f"--config={CONFIG}:suite=extrapolation", f"--workdir={workdir}",
            "--config.schemes=alibi,bert_a", "--config.seeds=0,1", f"--config.data.cache_dir={cache}"]
    argv += [f"--config.{k}={v}" for k, v in TINY.items()]
    assert launch.main(argv) == 0
    for name in ("REPORT.md", "report.json", "loss_curves.png", "extrapolation.png", "config.json"):
        assert (workdir / name).is_file(), name
    report = json.loads((workdir / "report.json").read_text())
    assert [s["name"] for s in report["schemes"]] == ["alibi-clm", "bert_a-clm"]
    assert report["seeds"] == [0, 1]
    assert all(len(r["eval"]) == 2 and r["train"] for s in report["schemes"] for r in s["seeds"].values())
    for seed in ("0", "1"):
        assert (workdir / f"alibi-clm-s{seed}" / "checkpoints").is_dir()
        assert (workdir / f"seed{seed}" / "extrapolation.json").is_file()
        runs = {os.path.basename(r["workdir"]): r for r in report["extrapolation"][seed]["runs"]}
        assert [x["defined"] for x in runs[f"alibi-clm-s{seed}"]["results"]] == [True, True, True]
        # learned table: defined only up to max_len
        assert [x["defined"] for x in runs[f"bert_a-clm-s{seed}"]["results"]] == [True, True, False]
    # the two seeds are different runs: different initialisation and data order give different losses
    alibi = report["schemes"][0]["seeds"]
    assert alibi["0"]["final_eval"]["eval_loss"] != alibi["1"]["final_eval"]["eval_loss"]
    # bert_a is undefined past max_len, so ALiBi has nothing to be compared with: no extrapolation finding
    assert not any("past the training length" in f["claim"] for f in report["findings"])
    text = (workdir / "REPORT.md").read_text()
    assert "## Extrapolation" in text and "## Findings" not in text and "`alibi-clm`" in text and " ± " in text
    written = {p.name: p.read_bytes() for p in workdir.iterdir() if p.is_file()}
    report_lib.render(str(workdir))                 # what compare wrote is what its report.json renders to
    assert {p.name: p.read_bytes() for p in workdir.iterdir() if p.is_file()} == written

    # a second run reuses the finished pretraining runs, writing the final evaluation one lacks (it stopped after its
    # last checkpoint; the report set its step-10 loss beside the others' step-20 ones); other keys are refused
    history = workdir / "alibi-clm-s1" / "metrics.jsonl"
    rows = history.read_text().splitlines()
    final = max(i for i, line in enumerate(rows) if "eval_loss" in line)
    history.write_text("\n".join(rows[:final] + rows[final + 1:]) + "\n")
    capsys.readouterr()
    assert launch.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("reusing it") == 3 and out.count("without its final evaluation; writing it") == 1
    again = json.loads((workdir / "report.json").read_text())
    assert again["schemes"][0]["seeds"]["1"]["final_eval"] == alibi["1"]["final_eval"]
    assert "(4 of 4 pretraining runs reused from an earlier command" in (workdir / "REPORT.md").read_text()
    assert launch.main(argv + ["--config.train.learning_rate=0.5"]) == 2   # the suite folder's gate refuses it
    err = capsys.readouterr().err
    assert "train.learning_rate=" in err and "(this command: 0.5)" in err and "--overwrite_config" not in err
    # fewer seeds or schemes would replace the report with one that covers less: refused, the folder unchanged
    before = {p: p.read_bytes() for p in workdir.iterdir() if p.is_file()}
    fewer = [a for a in argv if not a.startswith("--config.seeds=")] + ["--config.seeds=0"]
    assert launch.main(fewer) == 2
    assert "report.json covers seed 1, which this command's suite lacks" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in workdir.iterdir() if p.is_file()} == before


@pytest.mark.slow
def test_tiny_tupe_suite_fine_tunes_and_tabulates(tmp_path):
    workdir = tmp_path / "cmp"
    config = load("suite=tupe", schemes="tupe_a", **TINY, **{"data.cache_dir": tmp_path / "cache",
                                                              "glue.max_steps": 3, "glue.epochs": 1})
    report = suite_lib.run(config, str(workdir))
    assert set(report["glue"]) == {"tupe_a-mlm"}
    assert report["glue"]["tupe_a-mlm"]["0"]["wordorder"]["steps"] == 3
    assert (workdir / "glue" / "tupe_a-mlm-s0" / "wordorder" / "results.json").is_file()
    assert (workdir / "glue.png").is_file() and "## Fine-tuning" in (workdir / "REPORT.md").read_text()
    # the pretraining run trained again (moved aside and rerun, as the suite advises for a bad checkpoint): the
    # fine-tune's scores are of weights no longer there, and the suite said nothing and reused them
    results = json.loads((workdir / "glue" / "tupe_a-mlm-s0" / "wordorder" / "results.json").read_text())
    saved = workdir / "tupe_a-mlm-s0" / "checkpoints" / str(results["init_step"]) / "_CHECKPOINT_METADATA"
    made = saved.read_text()
    record = json.loads(made)
    assert results["init_checkpoint"] == f"{record['init_timestamp_nsecs']}-{record['commit_timestamp_nsecs']}"
    saved.write_text(json.dumps({**record, "commit_timestamp_nsecs": record["commit_timestamp_nsecs"] + 1}))
    before = tree(str(workdir))
    with pytest.raises(UserError, match=r"wordorder was fine-tuned from .*tupe_a-mlm-s0 step \d+ as saved then, and "
                                        r"that checkpoint is another one now \(the run was trained again\), --workdir, "
                                        r"move .*tupe_a-mlm-s0 aside"):
        suite_lib.run(config, str(workdir))
    assert tree(str(workdir)) == before                   # refused before any pretraining, nothing rewritten
    saved.write_text(made)
    assert suite_lib.run(config, str(workdir))["glue"] == report["glue"]      # the same checkpoint: reused


def test_a_finished_run_is_shared_by_suites_with_and_without_glue(tmp_path):
    """data.glue_dir is read only by fine-tuning: a pretraining run made by a suite with GLUE is reused by one
    without; a key that changes the training is still refused."""
    config = load("suite=tupe", **{"data.glue_dir": tmp_path / "glue"})
    scheme = suite_lib.parse_schemes(config)[0]
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(config_lib.to_json(suite_lib.scheme_config(config, scheme, 0)))
    suite_lib._check_same_run(str(run), suite_lib.scheme_config(load("suite=tupe"), scheme, 0))
    with pytest.raises(UserError, match="learning_rate"):
        suite_lib._check_same_run(str(run), suite_lib.scheme_config(
            load("suite=tupe", **{"train.learning_rate": 0.5}), scheme, 0))
    # data.cache_dir is where derived data is kept, not what it is: another one shares the run and its fine-tunes
    suite_lib._check_same_run(str(run), suite_lib.scheme_config(
        load("suite=tupe", **{"data.cache_dir": tmp_path / "elsewhere"}), scheme, 0))
    from tupe_jax.analysis import suite_glue  # pylint: disable=import-outside-toplevel
    ft = tmp_path / "ft"
    ft.mkdir()
    (ft / "config.json").write_text(config_lib.to_json(suite_glue._glue_base(config, scheme, 0, str(run), "rte")))
    suite_glue._check_same_finetune(str(ft), suite_glue._glue_base(
        load("suite=tupe", **{"data.glue_dir": tmp_path / "glue", "data.cache_dir": tmp_path / "elsewhere"}),
        scheme, 0, str(run), "rte"))
    with pytest.raises(UserError, match=r"was fine-tuned with other keys \(data.glue_dir"):
        suite_glue._check_same_finetune(str(ft), suite_glue._glue_base(load("suite=tupe"), scheme, 0, str(run), "rte"))


def test_a_run_with_checkpoints_and_no_config_is_not_reused(tmp_path, monkeypatch):
    """Its checkpoints were reused whatever keys they were trained with ("reusing it"), and the analysis failed."""
    config = load("suite=tupe")
    sub = suite_lib.scheme_config(config, suite_lib.parse_schemes(config)[0], 0)
    (tmp_path / "run").mkdir()
    monkeypatch.setattr(suite_lib.workdir_lib, "checkpoint_steps", lambda path: [20])
    with pytest.raises(UserError, match="holds checkpoints but no config.json"):
        suite_lib._check_same_run(str(tmp_path / "run"), sub)
    monkeypatch.setattr(suite_lib.workdir_lib, "checkpoint_steps", lambda path: [])
    suite_lib._check_same_run(str(tmp_path / "run"), sub)      # an empty folder: trained afresh


def test_a_run_in_runs_dir_that_cannot_be_reused_stops_the_suite_before_any_training(tmp_path, monkeypatch):
    """The second job's foreign run was found only after the first job had trained."""
    config = load("suite=extrapolation", schemes="alibi,nopos", **{"runs_dir": str(tmp_path / "runs")})
    nopos = suite_lib.parse_schemes(config)[1]
    foreign = tmp_path / "runs" / suite_lib.run_name(nopos, 0)
    foreign.mkdir(parents=True)
    (foreign / "config.json").write_text(config_lib.to_json(suite_lib.scheme_config(
        load("suite=extrapolation", **{"model.max_len": 64}), nopos, 0)))
    trained = []
    monkeypatch.setattr(suite_lib, "pretrain", lambda sub, path: trained.append(path) or {"step": 0})
    with pytest.raises(UserError, match=r"was trained with other keys \(model.max_len"):
        suite_lib.pretrain_all(config, str(tmp_path / "suite"), suite_lib.parse_schemes(config), [0])
    assert trained == []


@pytest.mark.slow
def test_a_diverged_run_is_recorded_and_its_comparisons_get_no_verdict(tmp_path, monkeypatch):
    """One diverged run stopped the whole suite (no report for the others), though the verdict rule says a diverged
    seed gives no verdict."""
    real = suite_lib.pretrain

    def pretrain(sub, path):
        if os.path.basename(path) == "nopos-clm-s1":       # this run alone, at a rate that diverges
            sub = sub.copy_and_resolve_references()
            sub.train.learning_rate = 1e4
        return real(sub, path)

    monkeypatch.setattr(suite_lib, "pretrain", pretrain)
    config = load("suite=extrapolation", schemes="alibi,nopos", seeds="0,1",
                  **TINY, **{"data.cache_dir": tmp_path / "cache"})
    report = suite_lib.run(config, str(tmp_path / "cmp"))
    nopos = report["schemes"][1]["seeds"]
    assert nopos["1"]["diverged"].startswith("training diverged at step") and nopos["1"]["final_eval"] == {}
    assert "diverged" not in nopos["0"] and nopos["0"]["final_eval"]["eval_loss"] > 0
    assert [os.path.basename(r["workdir"]) for r in report["extrapolation"]["1"]["runs"]] == ["alibi-clm-s1"]
    verdicts = {f["claim"]: f["verdict"] for f in report["findings"]}
    assert verdicts and set(verdicts.values()) == {findings.UNDEFINED}, verdicts
    text = (tmp_path / "cmp" / "REPORT.md").read_text()
    assert "Diverged, so without final values" in text and "`nopos-clm` seed 1: training diverged" in text
    extrapolation = text.split("## Extrapolation", 1)[1]
    assert next(r for r in extrapolation.splitlines() if r.startswith("| `nopos-clm`")).count("(1 of 2)") == 3
    written = {p.name: p.read_bytes() for p in (tmp_path / "cmp").iterdir() if p.is_file()}
    report_lib.render(str(tmp_path / "cmp"))
    assert {p.name: p.read_bytes() for p in (tmp_path / "cmp").iterdir() if p.is_file()} == written


def test_an_unreadable_checkpoint_in_the_analyses_names_the_suites_flag(tmp_path, monkeypatch):
    """The line said `--step`, a flag compare refuses."""
    from tupe_jax import checkpoint  # pylint: disable=import-outside-toplevel
    config = load("suite=extrapolation", schemes="alibi", seeds="0")
    run = {"scheme": "alibi-clm", "seed": 0, "path": str(tmp_path / "alibi-clm-s0"), "seconds": None, "reused": True}
    monkeypatch.setattr(suite_lib, "pretrain_all", lambda *a: {0: [run]})
    monkeypatch.setattr(suite_lib, "pretrain_summary", lambda path: {"train": [], "eval": [], "final_eval": {}})
    monkeypatch.setattr(suite_lib, "_analyses", lambda *a: (_ for _ in ()).throw(
        checkpoint.unreadable(run["path"] + "/checkpoints", 20, [20], OSError("bad"), "--step")))
    with pytest.raises(UserError, match=r"step 20 in .*alibi-clm-s0/checkpoints failed to restore .*, "
                                        r"--config.runs_dir, move that run's folder aside"):
        suite_lib.run(config, str(tmp_path / "cmp"))


def test_a_fine_tune_made_otherwise_stops_the_suite_before_any_pretraining(tmp_path, monkeypatch):
    """It was found at its turn, after every pretraining run had trained."""
    from tupe_jax.analysis import suite_glue  # pylint: disable=import-outside-toplevel
    keys = {**TINY, "data.cache_dir": tmp_path / "cache", "glue.tasks": "wordorder", "glue.max_steps": 3}
    config = load("suite=tupe", schemes="tupe_a", seeds="0", **keys)
    other = load("suite=tupe", schemes="tupe_a", seeds="0", **keys, **{"glue.learning_rate": 0.5})
    scheme = suite_lib.parse_schemes(config)[0]
    ft = tmp_path / "cmp" / "glue" / "tupe_a-mlm-s0" / "wordorder"
    ft.mkdir(parents=True)
    (ft / "config.json").write_text(config_lib.to_json(suite_glue.glue_config(
        other, scheme, 0, os.path.abspath(tmp_path / "cmp" / "tupe_a-mlm-s0"), "wordorder")))
    monkeypatch.setattr(suite_lib, "pretrain", lambda sub, path: pytest.fail("pretrained"))
    with pytest.raises(UserError, match=r"wordorder was fine-tuned with other keys \(train.learning_rate"):
        suite_lib.run(config, str(tmp_path / "cmp"))


def test_only_process_0_writes_the_report(tmp_path, monkeypatch):
    """Every process wrote report.json and REPORT.md (their command lines differ): the folder held one process's
    report.json and another's REPORT.md."""
    config = load("suite=extrapolation", schemes="alibi", seeds="0")
    run = {"scheme": "alibi-clm", "seed": 0, "path": str(tmp_path / "alibi-clm-s0"), "seconds": None, "reused": True}
    monkeypatch.setattr(suite_lib, "pretrain_all", lambda *a: {0: [run]})
    monkeypatch.setattr(suite_lib, "pretrain_summary", lambda path: {"train": [], "eval": [], "final_eval": {}})
    monkeypatch.setattr(suite_lib, "_analyses", lambda *a: {})
    monkeypatch.setattr(suite_lib.jax, "process_index", lambda: 1)
    assert suite_lib.run(config, str(tmp_path / "cmp"))["schemes"][0]["name"] == "alibi-clm"
    assert sorted(os.listdir(tmp_path / "cmp")) == []
