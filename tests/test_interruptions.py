"""Runs stopped at awkward moments: after the last checkpoint and before the final evaluation, a fine-tune killed
between checkpoints, an unfinished save at a step the run never saves again, a second Ctrl-C while the first one's
save commits, a SIGTERM during a process's first step, a preempted `compare`, and `evaluate` beside a live local run."""
import json
import os
import shutil
import signal
import subprocess
import sys

import jax

import launch
from glue_fixtures import load_config_module, make_pretrained, tiny_model_overrides, write_glue_dir
from tests.reliability_fixtures import ROOT, tiny_config
from tupe_jax import checkpoint as ckpt
from tupe_jax import trainer as trainer_lib
from tupe_jax.finetune import loop as ft_loop
from tupe_jax.metrics import read_metrics
from tupe_jax.pretrain import loop as pretrain_loop
from tupe_jax.pretrain.evaluate import evaluate


def _untimed(rows):
    return [{k: v for k, v in r.items() if k not in ("step_time_s", "tokens_per_sec", "model_tflops", "mfu")}
            for r in rows]


def test_a_run_stopped_after_its_last_checkpoint_writes_its_final_evaluation_on_rerun(tmp_path, capsys):
    """Preempted at the last step (or killed once its last checkpoint committed), a run skipped its final
    evaluation and a rerun said 'nothing to train': the history lacked the row an uninterrupted run has."""
    devices = jax.devices()[:1]
    config = tiny_config(tmp_path / "cache", 4, **{"checkpoint.async_save": "false"})
    pretrain_loop.pretrain(config, str(tmp_path / "ref"), devices=devices)
    pretrain_loop.pretrain(config, str(tmp_path / "run"), devices=devices, stop_after=4)   # "preempted" at step 4
    assert not [r for r in read_metrics(str(tmp_path / "run")) if "eval_loss" in r]
    capsys.readouterr()
    pretrain_loop.pretrain(config, str(tmp_path / "run"), devices=devices)
    assert "writing the final evaluation its run stopped before" in capsys.readouterr().out
    assert _untimed(read_metrics(str(tmp_path / "run"))) == _untimed(read_metrics(str(tmp_path / "ref")))
    before = (tmp_path / "run" / "metrics.jsonl").read_bytes()
    pretrain_loop.pretrain(config, str(tmp_path / "run"), devices=devices)       # now complete: nothing written
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == before


def sigterm(monkeypatch, when):
    """The SIGTERM flag set `when` = "before" the loop's first step (the setup, the restore) or "during" it (its
    compile: set as its batch is placed); `monkeypatch.undo()` clears it."""
    if when == "before":
        monkeypatch.setitem(ckpt._STOP, "requested", True)   # pylint: disable=protected-access
        return
    real = trainer_lib.sharding_lib.global_batch

    def global_batch(*a, **k):
        monkeypatch.setitem(ckpt._STOP, "requested", True)   # pylint: disable=protected-access
        return real(*a, **k)
    monkeypatch.setattr(trainer_lib.sharding_lib, "global_batch", global_batch)


def test_a_preemption_before_or_during_a_process_first_step_saves_nothing_and_the_rerun_is_the_uninterrupted_run(
        tmp_path, monkeypatch, capsys):
    """SIGTERM while a process's first step compiles (minutes for a big model; no signal cuts that short): the run
    used to finish the step and save it, spending the notice's seconds to spare a rerun one step. It stops without
    saving, and the rerun's history and checkpoints are the uninterrupted run's. A SIGTERM before that step (the
    setup, the restore) stops it before the compile."""
    devices = jax.devices()[:1]
    config = tiny_config(tmp_path / "cache", 4, **{"checkpoint.async_save": "false", "checkpoint.every": "2"})
    pretrain_loop.pretrain(config, str(tmp_path / "ref"), devices=devices)
    stopped = tmp_path / "stopped2"             # a run stopped after step 2; each case below starts from a copy
    pretrain_loop.pretrain(config, str(stopped), devices=devices, stop_after=2)
    for when, stopped_at, resumes_from in (("during", 0, "the beginning"), ("during", 2, "step 2"),
                                           ("before", 0, "the beginning"), ("before", 2, "step 2")):
        run = tmp_path / f"run-{when}{stopped_at}"
        if stopped_at:
            shutil.copytree(stopped, run)
        before = ckpt.Checkpointer(str(run), read_only=True).all_steps() if stopped_at else []
        sigterm(monkeypatch, when)
        capsys.readouterr()
        pretrain_loop.pretrain(config, str(run), devices=devices)
        monkeypatch.undo()
        out = capsys.readouterr().out
        assert f"preemption {when} this process's first step: nothing saved; a rerun starts from {resumes_from}" \
            in out and "saved step" not in out, out
        assert ckpt.Checkpointer(str(run), read_only=True).all_steps() == before
        pretrain_loop.pretrain(config, str(run), devices=devices)
        assert _untimed(read_metrics(str(run))) == _untimed(read_metrics(str(tmp_path / "ref")))
        assert ckpt.Checkpointer(str(run), read_only=True).all_steps() == [2, 4]
    run = tmp_path / "run-last"                 # a first step that is the run's last is saved: the run is done
    pretrain_loop.pretrain(config, str(run), devices=devices, stop_after=3)
    sigterm(monkeypatch, "during")
    capsys.readouterr()
    pretrain_loop.pretrain(config, str(run), devices=devices)
    monkeypatch.undo()
    assert "preemption: saved step 4" in capsys.readouterr().out
    assert ckpt.Checkpointer(str(run), read_only=True).all_steps()[-1] == 4


def test_a_finetune_killed_between_checkpoints_has_one_history(tmp_path):
    """A fine-tune wrote no 'resumed' marker, so the rows a killed process wrote past its checkpoint were read
    twice after the restart (steps 5 and 6 here; all six when it was killed before its first checkpoint)."""
    glue = tmp_path / "glue"
    write_glue_dir(str(glue))
    make_pretrained(tmp_path / "pre", tmp_path / "cache", pe="tupe_r")
    config = load_config_module("glue").get_config("task=rte,pe=tupe_r,size=tiny")
    tiny_model_overrides(config)
    config.data.cache_dir, config.data.glue_dir, config.init_from = str(tmp_path / "cache"), str(glue), str(
        tmp_path / "pre")
    config.train.update(dict(batch_size=16, eval_batch_size=16, log_every=1, steps=6, eval_every=3))
    config.checkpoint.update(dict(every=2, async_save=False))
    ft_loop.finetune(config, str(tmp_path / "ref"))
    for run, removed in ((tmp_path / "run", {"6"}), (tmp_path / "run-before-any", {"5", "6"})):
        shutil.copytree(tmp_path / "ref", run)
        assert sorted(os.listdir(run / "checkpoints")) == ["5", "6"]     # the two it keeps
        for step in removed:                   # as a kill -9 after step 6's rows, before its checkpoint committed
            shutil.rmtree(run / "checkpoints" / step)     # (or before the first one did)
        os.remove(run / "results.json")
        ft_loop.finetune(config, str(run))
        ours = _untimed(read_metrics(str(run)))
        assert [r["step"] for r in ours] == [r["step"] for r in _untimed(read_metrics(str(tmp_path / "ref")))]
        assert ours == _untimed(read_metrics(str(tmp_path / "ref")))


def test_an_unfinished_save_at_a_step_never_saved_again_is_removed(tmp_path, capsys):
    """A save stopped at an off-grid step (a preemption save killed at the end of its grace period) left
    `<step>.orbax-checkpoint-tmp` for good; a writer removes it, a reader leaves the folder as it is."""
    (tmp_path / "checkpoints" / "76.orbax-checkpoint-tmp" / "state").mkdir(parents=True)
    (tmp_path / "checkpoints" / "9.orbax-checkpoint-tmp-1234").mkdir()
    with ckpt.Checkpointer(str(tmp_path), read_only=True):
        pass
    assert len(os.listdir(tmp_path / "checkpoints")) == 2
    with ckpt.Checkpointer(str(tmp_path), async_=False):
        pass
    assert os.listdir(tmp_path / "checkpoints") == []
    assert "removed 76.orbax-checkpoint-tmp, a save that a stopped run did not finish" in capsys.readouterr().out


def test_a_second_ctrl_c_waits_for_the_save_of_the_first(capsys):
    """The second Ctrl-C raised KeyboardInterrupt inside Orbax's wait: the step's save never committed and ~100
    lines of tracebacks followed. Before that save begins it still stops at once."""
    # Python's own handler, as in a terminal: a suite started with SIGINT ignored (`cmd &` in a script) passes the
    # ignore on, and the trainer keeps an inherited ignore by design
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        stopped = _second_ctrl_c(capsys)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert stopped


def _second_ctrl_c(capsys) -> bool:
    with trainer_lib.ctrl_c_saves() as flag:
        os.kill(os.getpid(), signal.SIGINT)
        assert flag["set"]
        flag["saving"] = True
        os.kill(os.getpid(), signal.SIGINT)                      # ignored, said
        assert "is being committed; it stops in a moment" in capsys.readouterr().out
        flag["saving"] = False
        try:
            os.kill(os.getpid(), signal.SIGINT)
        except KeyboardInterrupt:
            stopped = True
        else:
            stopped = False
    return stopped


def test_a_preempted_compare_exits_0_like_pretrain(tmp_path, monkeypatch, capsys):
    """It exited 2 with `error:`, where pretrain and glue-sweep exit 0: a supervisor restarting on 0 saw a failure."""
    from tupe_jax.analysis import suite  # pylint: disable=import-outside-toplevel
    monkeypatch.setattr(suite, "pretrain", lambda config, path: {"step": 1})   # SIGTERM after step 1
    argv = ["compare", f"--config={ROOT}/configs/compare.py:suite=extrapolation", f"--workdir={tmp_path / 'cmp'}",
            "--config.schemes=alibi", "--config.train.steps=4", f"--config.data.cache_dir={tmp_path / 'cache'}"]
    assert launch.main(argv) == 0
    out = capsys.readouterr().out
    assert "pretraining alibi-clm-s0 stopped at step 1 of 4 (preempted); rerun the same command" in out
    assert not os.path.exists(tmp_path / "cmp" / "report.json")


def test_evaluate_beside_a_live_local_run_leaves_its_metrics_alone(tmp_path, capsys):
    """Its row landed in the middle of the live run's history, and that run's resume could drop it."""
    make_pretrained(tmp_path / "run", tmp_path / "cache", pe="alibi")
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 10, "loss": 1.0}\n')
    code = "import sys, time\nfrom tupe_jax.workdir import RunLock\nwith RunLock(sys.argv[1]):\n" \
           "    print('locked', flush=True)\n    time.sleep(600)\n"
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "run")], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert evaluate(str(tmp_path / "run"))["eval_loss"] > 0
        assert (tmp_path / "run" / "metrics.jsonl").read_text() == '{"step": 10, "loss": 1.0}\n'
        assert "this row is not added to metrics.jsonl" in capsys.readouterr().out
    finally:
        holder.kill()
        holder.wait()
    evaluate(str(tmp_path / "run"))
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])["split"] == "validation"
