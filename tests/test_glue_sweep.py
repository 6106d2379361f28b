"""The GLUE sweep and its neighbours: every task's files and the finished sub-runs are checked before anything
trains (a rerun with other settings, another pretraining step or edited TSVs ranked old and new runs side by side),
a sweep's root and a fine-tuning run refuse each other's command, and MNLI's diagnostic file is read before
training."""
import json
import os
import shutil

import pytest

from tests.glue_fixtures import DIRS, load_config_module, make_pretrained, tiny_model_overrides, write_glue_dir
from tests.workdir_fixtures import tree
from tupe_jax import workdir as workdir_lib
from tupe_jax.errors import UserError
from tupe_jax.finetune import runner as ft_runner
from tupe_jax.finetune import sweep as ft_sweep
from tupe_jax.finetune import validate as ft_validate

GLUE_CFG = load_config_module("glue")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A tiny tupe_r pretraining run (checkpoint 10) and a GLUE folder with all nine tasks."""
    root = tmp_path_factory.mktemp("sweep_env")
    make_pretrained(root / "pre", root / "cache")
    write_glue_dir(str(root / "glue"))
    return root


def make_config(root, task="rte", **sweep):
    config = GLUE_CFG.get_config(f"task={task},pe=tupe_r,size=tiny")
    tiny_model_overrides(config)
    config.data.cache_dir, config.data.glue_dir = str(root / "cache"), str(root / "glue")
    config.data.glue_buckets = (32, 64)
    config.init_from = str(root / "pre")
    config.train.update(dict(batch_size=8, eval_batch_size=8, log_every=8, learning_rate=1e-3, steps=2,
                             predict_test=False))
    config.checkpoint.async_save = False
    config.sweep.learning_rates, config.sweep.seeds = (1e-3,), (0,)
    config.sweep.update(sweep)
    return config


@pytest.mark.parametrize("tasks", [" , ", ","])
def test_a_sweep_of_no_task_is_refused(env, tasks):
    """`sweep.tasks=' , '` wrote an empty sweep.json and a broken table, exit 0."""
    with pytest.raises(UserError, match="sweep.tasks = .* names no task"):
        ft_validate.validate(make_config(env, tasks=tasks), 8)


def test_a_task_without_files_stops_the_sweep_before_the_first_sub_run(env, tmp_path):
    """QNLI without train.tsv was found when its first sub-run started, after every RTE sub-run had trained."""
    glue = tmp_path / "glue"
    shutil.copytree(env / "glue", glue)
    os.remove(glue / DIRS["qnli"] / "train.tsv")
    config = make_config(env, tasks="rte,qnli")
    config.data.glue_dir = str(glue)
    with pytest.raises(UserError, match=r"no train and dev files of GLUE task 'qnli' in data.glue_dir .*, "
                                        r"--config.sweep.tasks"):
        ft_sweep.sweep(config, str(tmp_path / "sweep"))
    assert not (tmp_path / "sweep").exists()


@pytest.mark.parametrize("task,edit,needle", [
    ("wnli", lambda d: (d / "dev.tsv").write_text((d / "dev.tsv").read_text().replace("\t0\n", "\t3\n", 1)),
     r"GLUE label '3' is not one of \['0', '1'\], .*WNLI/dev.tsv:\d+"),
    ("mnli", lambda d: os.remove(d / "dev_mismatched.tsv"), r"split 'validation_mismatched' is not available"),
])
def test_a_task_whose_files_do_not_read_stops_the_sweep_before_the_first_sub_run(env, tmp_path, task, edit, needle):
    """Only the files' presence was checked: RTE's sub-runs trained before a bad label in WNLI's dev file, or MNLI's
    missing mismatched dev set, stopped the sweep."""
    glue = tmp_path / "glue"
    shutil.copytree(env / "glue", glue)
    edit(glue / DIRS[task])
    config = make_config(env, tasks=f"rte,{task}")
    config.data.glue_dir = str(glue)
    with pytest.raises(UserError, match=needle):
        ft_sweep.sweep(config, str(tmp_path / "sweep"))
    assert not (tmp_path / "sweep").exists()


def test_finetune_and_glue_sweep_refuse_each_others_folders(env, tmp_path):
    """A fine-tune wrote checkpoints beside a sweep's sweep.json; a sweep built sub-runs inside a fine-tune."""
    config = make_config(env)
    for folder, marker in (("sweep", "sweep.json"), ("run", "results.json")):
        (tmp_path / folder).mkdir()
        workdir_lib.write_config(str(tmp_path / folder), config)
        (tmp_path / folder / marker).write_text("{}")
    with pytest.raises(UserError, match=r"sweep holds a glue-sweep folder; this command makes a fine-tuning run"):
        workdir_lib.check_config(str(tmp_path / "sweep"), config, kind="finetune")
    with pytest.raises(UserError, match=r"run holds a fine-tuning run; this command makes a glue-sweep folder"):
        workdir_lib.check_config(str(tmp_path / "run"), config, kind="glue-sweep")
    workdir_lib.check_config(str(tmp_path / "sweep"), config, kind="glue-sweep")   # each its own: as before
    workdir_lib.check_config(str(tmp_path / "run"), config, kind="finetune")


@pytest.mark.parametrize("row,needle", [("3\tonly one", r"has 2 columns, expected 3"),
                                        ("x\ta\tb", r"GLUE id 'x' is not an integer")])
def test_a_bad_diagnostic_row_stops_an_mnli_fine_tune_before_training(env, tmp_path, row, needle):
    """A short row or a bad index in diagnostic/diagnostic.tsv was an IndexError/ValueError after training (and
    the failed command removed the run); a BOM made the header unreadable."""
    glue = tmp_path / "glue"
    shutil.copytree(env / "glue", glue)
    diag = glue / "diagnostic" / "diagnostic.tsv"
    good = diag.read_text()
    diag.write_text(good + row + "\n")
    config = make_config(env, "mnli")
    config.data.glue_dir, config.train.predict_test = str(glue), True
    with pytest.raises(UserError, match=needle + r", .*diagnostic.tsv:9"):
        ft_runner.Runner(config, str(tmp_path / "ft"))
    sweep = make_config(env, tasks="rte,mnli")     # a sweep reads it before its first sub-run (RTE's) trains
    sweep.data.glue_dir, sweep.train.predict_test = str(glue), True
    with pytest.raises(UserError, match=needle + r", .*diagnostic.tsv:9"):
        ft_sweep.sweep(sweep, str(tmp_path / "sweep"))
    assert not (tmp_path / "sweep").exists()
    diag.write_bytes(b"\xef\xbb\xbf" + good.encode())
    assert [e["idx"] for e in ft_runner.Runner(config, str(tmp_path / "ft2")).diagnostic] == list(range(7))


@pytest.mark.slow   # two 2-step fine-tunes
def test_finished_sub_runs_made_otherwise_are_refused_before_anything_trains(env, tmp_path):
    pre, glue = tmp_path / "pre", tmp_path / "glue"
    shutil.copytree(env / "pre", pre)
    shutil.copytree(env / "glue", glue)
    config = make_config(env)
    config.init_from, config.data.glue_dir, config.train.steps = str(pre), str(glue), 3
    sweep = tmp_path / "sweep"
    ft_sweep.sweep(config, str(sweep))
    assert json.loads((sweep / "sweep.json").read_text())["init"] == {"workdir": str(pre), "step": 10}
    results = json.loads((sweep / "rte" / "lr=0.001" / "seed=0" / "results.json").read_text())
    assert (results["steps"], results["steps_per_epoch"], results["epochs"]) == (3, 2, 1.5)   # epochs trained

    def refused(cfg, needle):
        before = tree(str(sweep))
        with pytest.raises(UserError, match=needle):
            ft_sweep.sweep(cfg, str(sweep))
        assert tree(str(sweep)) == before          # nothing trained, nothing rewritten

    more = make_config(env, learning_rates=(1e-3, 2e-3))      # one more lr: the finished one must still fit
    more.init_from, more.data.glue_dir, more.train.steps = str(pre), str(glue), 3
    longer = more.copy_and_resolve_references()
    longer.train.steps = 4
    refused(longer, r"the finished sub-run .*seed=0 was made otherwise: train.steps/epochs 3/.* -> 4/")
    make_pretrained(tmp_path / "pre20", tmp_path / "cache20", steps=(20,))
    shutil.copytree(tmp_path / "pre20" / "checkpoints" / "20", pre / "checkpoints" / "20")   # the run trained on
    refused(more, r"the finished sub-run .* started from .*pre step 10, this sweep's new ones from .*pre step 20, "
                  r"--config.init_step, give --config.init_step=10")
    done = sweep / "rte" / "lr=0.001" / "seed=0" / "results.json"
    kept = done.read_bytes()
    done.unlink()                                  # as if preempted after its last checkpoint: its progress says
    refused(more, r"the started sub-run .* started from .*pre step 10, this sweep's new ones from .*pre step 20")
    done.write_bytes(kept)
    dev = glue / DIRS["rte"] / "dev.tsv"
    rows = dev.read_text()
    dev.write_text("\n".join(rows.splitlines()[:-1]) + "\n")
    more.init_step = 10
    refused(more, r"the rte examples differ from those the finished sub-run .* was scored on")
    dev.write_text(rows)
    summary = ft_sweep.sweep(more, str(sweep))       # the same settings, step and files: reused, one more lr trained
    assert sorted(summary["tasks"]["rte"]["lrs"]) == ["0.001", "0.002"] and summary["init"]["step"] == 10


def test_a_diagnostic_file_that_does_not_read_is_one_line(env, tmp_path, monkeypatch):
    """An I/O error skipped the hosts' agreement (the others waited in it until JAX's timeout) and was a traceback."""
    def failing(path):
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(ft_runner.glue_tsv, "parse_diagnostic", failing)
    config = make_config(env, "mnli")
    config.train.predict_test = True
    needle = r"cannot read .*diagnostic.tsv \(Input/output error\), .*diagnostic.tsv, check the file, or move it aside"
    with pytest.raises(UserError, match=needle):
        ft_runner.Runner(config, str(tmp_path / "ft"))
    sweep = make_config(env, tasks="rte,mnli")      # the sweep's early read: the same line (it was a traceback)
    sweep.train.predict_test = True
    with pytest.raises(UserError, match=needle):
        ft_sweep.sweep(sweep, str(tmp_path / "sweep"))


def test_diagnostic_rows_cut_to_max_len_are_counted_aloud(env, tmp_path, capsys):
    """Every split said how many examples it cut to max_len; MNLI's diagnostic set (AX) was cut without a word."""
    glue = tmp_path / "glue"
    shutil.copytree(env / "glue", glue)
    path = glue / "diagnostic" / "diagnostic.tsv"
    path.write_text(path.read_text() + "7\t" + " ".join(["cat"] * 300) + "\tdog .\n")
    config = make_config(env, "mnli")
    config.data.glue_dir, config.train.predict_test = str(glue), True
    runner = ft_runner.Runner(config, str(tmp_path / "ft"))
    runner._write_ax(runner.init_state()["params"], str(tmp_path / "out"))  # pylint: disable=protected-access
    assert "data: mnli diagnostic (AX): 1 of 8 examples cut to max_len 64 tokens" in capsys.readouterr().out
