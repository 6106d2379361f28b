"""`python -m launch demo` around its training run: a SIGTERM during training stops it with one line (it scored the
half-trained model and exited 0 as if done), a finished run's evaluation is read, not made again (two identical
rows), a `loss.png` of someone else's is not overwritten, and Ctrl-C in a loop closes its metrics writer (its
TensorBoard thread printed a traceback under the one-line error)."""
import json

import pytest

import launch
from launch import demo as demo_lib
from tests.workdir_fixtures import tree
from tupe_jax import workdir as workdir_lib


def never(*args, **kwargs):
    raise AssertionError("the demo evaluated again")


def test_a_demo_stopped_by_sigterm_says_so_and_scores_nothing(tmp_path, monkeypatch, capsys):
    wd = tmp_path / "demo"
    monkeypatch.setattr(demo_lib, "pretrain", lambda config, workdir: {"step": 152, "loss": 4.6})
    monkeypatch.setattr(demo_lib, "evaluate", never)
    assert demo_lib.demo(str(wd)) == {}
    out = capsys.readouterr().out
    assert "demo: stopped at step 152 of 500 (SIGTERM); rerun `make demo`" in out and "validation loss" not in out
    assert not (wd / "loss.png").exists()


ROWS = [{"step": 25, "loss": 6.9}, {"step": 500, "loss": 4.0}, {"step": 500, "eval_loss": 4.75,
                                                                 "eval_mlm_accuracy": 0.21}]


def finished_demo(tmp_path):
    """A demo folder whose metrics.jsonl holds its last step and final evaluation (`ROWS`)."""
    wd = tmp_path / "demo"
    wd.mkdir()
    workdir_lib.write_config(str(wd), demo_lib.demo_config())
    (wd / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return wd


def test_a_finished_demo_reads_the_loops_evaluation(tmp_path, monkeypatch, capsys):
    wd = finished_demo(tmp_path)
    monkeypatch.setattr(demo_lib, "pretrain", lambda config, workdir: {"step": 500})
    monkeypatch.setattr(demo_lib, "evaluate", never)
    assert demo_lib.demo(str(wd)) == ROWS[2]
    assert "validation loss 4.750, MLM accuracy 0.210" in capsys.readouterr().out and (wd / "loss.png").is_file()


def test_a_finished_demo_is_not_handed_to_the_loop(tmp_path, monkeypatch, capsys):
    """The loop told a rerun of a finished demo to "give a larger train.steps", a key the demo does not take."""
    wd = finished_demo(tmp_path)
    monkeypatch.setattr(demo_lib.workdir_lib, "checkpoint_steps", lambda workdir: [100, 500])
    monkeypatch.setattr(demo_lib, "pretrain", never)
    monkeypatch.setattr(demo_lib, "evaluate", never)
    assert demo_lib.demo(str(wd)) == ROWS[2]
    out = capsys.readouterr().out
    assert f"demo: {wd} finished its 500 steps before" in out and "tiny TUPE-R" not in out


def test_a_folder_of_another_run_is_refused_before_the_banner(tmp_path, capsys):
    """The demo printed its banner, then the loop's refusal, whose fix named settings the demo does not take."""
    from tests.glue_fixtures import load_config_module
    wd = tmp_path / "other"
    wd.mkdir()
    workdir_lib.write_config(str(wd), load_config_module("pretrain").get_config("pe=rope,size=tiny,objective=clm"))
    before = tree(str(wd))
    assert launch.main(["demo", f"--workdir={wd}"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "give the demo a folder of its own" in captured.err
    assert tree(str(wd)) == before


@pytest.mark.parametrize("argv", [["demo", "--bogus"], ["pretrain", "--bogus"], ["probe", "--out=x", "--bogus=1"]])
def test_an_unknown_flag_is_named_before_a_missing_one(argv, capsys):
    """`demo --bogus` said only that --workdir is required."""
    assert launch.main(argv) == 2
    assert capsys.readouterr().err.startswith(f"error: unrecognized arguments: {argv[-1]}, see `python -m launch "
                                              f"{argv[0]} --help`")


def test_a_loss_png_of_another_is_not_overwritten(tmp_path, capsys):
    wd = tmp_path / "mine"
    wd.mkdir()
    (wd / "loss.png").write_bytes(b"my plot")
    before = tree(str(wd))
    assert launch.main(["demo", f"--workdir={wd}"]) == 2
    assert capsys.readouterr().err.startswith(f"error: {wd} holds loss.png but no config.json")
    assert tree(str(wd)) == before


def test_ctrl_c_in_the_loop_closes_the_metrics_writer(tmp_path, monkeypatch):
    from tests.glue_fixtures import load_config_module, tiny_model_overrides
    from tupe_jax import metrics as metrics_lib
    from tupe_jax import trainer as trainer_lib
    from tupe_jax.pretrain.loop import pretrain
    closed = []
    real_close = metrics_lib.MetricsWriter.close
    monkeypatch.setattr(metrics_lib.MetricsWriter, "close", lambda self: closed.append(1) or real_close(self))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(trainer_lib.Trainer, "fit", interrupted)
    config = tiny_model_overrides(load_config_module("pretrain").get_config("pe=tupe_r,size=tiny"))
    config.data.cache_dir, config.train.steps, config.train.batch_size = str(tmp_path / "cache"), 2, 8
    with pytest.raises(KeyboardInterrupt):
        pretrain(config, str(tmp_path / "run"))
    assert closed == [1]
