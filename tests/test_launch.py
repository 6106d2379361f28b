"""The launcher: --help, one-line errors with exit 2 (subprocess), dispatch, workdir config guard."""
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import types

import pytest

import launch
from tests import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "--config=" + os.path.join(ROOT, "configs", "pretrain.py") + ":pe=tupe_r,size=tiny"


def _run(*args, timeout=120):
    env = dict(os.environ, XLA_FLAGS=xla_flags.devices(8), JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "launch", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def test_help_lists_every_command():
    result = _run("--help")
    assert result.returncode == 0
    for name in ("pretrain", "evaluate", "finetune", "glue-sweep", "extrapolate", "probe", "correlations",
                 "shuffle-attention", "compare", "demo"):
        assert name in result.stdout


@pytest.mark.parametrize("extra,needle", [
    (["--config.train.nope=1"], "train.nope"),
    (["--config.train.steps=abc"], "--config.train.steps"),
    (["--config.mesh.data=3"], "--config.mesh.data"),
    (["--bogus"], "--bogus"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, extra, needle):
    result = _run("pretrain", CONFIG, f"--workdir={tmp_path}", *extra)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert needle in lines[0] and "Traceback" not in result.stderr


@pytest.fixture
def fake_library(monkeypatch):
    """Point pretrain/evaluate at a fake module recording its calls."""
    calls = []
    module = types.ModuleType("fake_train_lib")
    module.pretrain = lambda config, workdir: calls.append(("pretrain", config, workdir))
    module.evaluate = lambda workdir, step, data: calls.append(("evaluate", workdir, step, data))
    monkeypatch.setitem(sys.modules, "fake_train_lib", module)
    for name in ("pretrain", "evaluate"):
        cmd = launch.COMMANDS[name]
        monkeypatch.setitem(launch.COMMANDS, name, dataclasses.replace(cmd, module="fake_train_lib"))
    return calls


def test_dispatch_validates_and_writes_config(tmp_path, fake_library):
    workdir = str(tmp_path / "run")
    assert launch.main(["pretrain", CONFIG, f"--workdir={workdir}", "--config.train.steps=5",
                        "--config.train.batch_size", "16"]) == 0
    (name, config, got_workdir), = fake_library
    assert name == "pretrain" and got_workdir == workdir
    assert config.train.steps == 5 and config.train.batch_size == 16
    assert os.path.isfile(os.path.join(workdir, "config.json"))
    assert launch.main(["evaluate", f"--workdir={workdir}", "--step=3"]) == 0
    assert fake_library[-1] == ("evaluate", workdir, 3, {})


def test_workdir_of_another_run_is_refused(tmp_path, fake_library, capsys):
    workdir = str(tmp_path / "run")
    assert launch.main(["pretrain", CONFIG, f"--workdir={workdir}"]) == 0
    other = CONFIG.replace("pe=tupe_r", "pe=rope")
    assert launch.main(["pretrain", other, f"--workdir={workdir}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "--overwrite_config" in err and "model.pe" in err
    assert len(fake_library) == 1
    assert launch.main(["pretrain", other, f"--workdir={workdir}", "--overwrite_config"]) == 0


def test_every_command_resolves_to_a_function_and_its_validator():
    """The command table names real functions; commands with --config name their own validator."""
    for name, cmd in launch.COMMANDS.items():
        assert callable(launch.resolve(f"{cmd.module}:{cmd.function}")), name
        if cmd.needs_config:
            assert callable(launch.resolve(cmd.validator)), name
    assert {n for n, c in launch.COMMANDS.items() if c.needs_config} >= {"pretrain", "finetune", "glue-sweep",
                                                                          "compare"}
    assert not {n for n, c in launch.COMMANDS.items() if c.needs_config} & {"evaluate", "probe", "extrapolate"}


def test_override_without_config_is_refused(capsys):
    assert launch.main(["evaluate", "--workdir=/tmp/x", "--config.train.steps=3"]) == 2
    assert "--config.train.steps" in capsys.readouterr().err


def test_lengths_parsing():
    assert launch.flags.lengths("128,256") == [128, 256]  # pylint: disable=protected-access
    with pytest.raises(launch.UserError, match="--lengths"):
        launch.flags.lengths("128,abc")  # pylint: disable=protected-access


def test_workdir_only_commands_take_no_config(capsys):
    assert launch.main(["evaluate", "--workdir=/tmp/x", CONFIG]) == 2
    assert capsys.readouterr().err.startswith("error: unrecognized arguments: --config")


def _fake_command(monkeypatch, name, fn):
    """Command `name` calls `fn` (from a fake module) instead of its own function."""
    command = launch.COMMANDS[name]
    module = types.ModuleType(f"fake_{name}_lib")
    setattr(module, command.function, fn)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(launch.COMMANDS, name, dataclasses.replace(command, module=module.__name__))


def test_an_unexpected_exception_is_one_line_pointing_at_a_log(tmp_path, monkeypatch, capsys):
    """The launcher's last resort: exit 1, one `error:` line naming the exception and a log file that holds the
    full traceback; the run's folder keeps exactly what it had (the log aside)."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "notes.txt").write_text("keep")

    def boom(workdir, step, data):
        raise RuntimeError("something nobody foresaw\nsecond line")

    _fake_command(monkeypatch, "evaluate", boom)
    assert launch.main(["evaluate", f"--workdir={workdir}"]) == 1
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: unexpected RuntimeError: something nobody foresaw, ")
    logs = list((workdir / "logs").iterdir())
    assert len(logs) == 1 and str(logs[0]) in lines[0]
    text = logs[0].read_text()
    assert "Traceback" in text and "second line" in text and "def boom" not in lines[0]
    assert sorted(p.name for p in workdir.iterdir()) == ["logs", "notes.txt"]
    assert (workdir / "notes.txt").read_text() == "keep"
    shutil.rmtree(workdir / "logs")     # scoring another corpus writes nothing into the run: not even the log
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))   # (not the machine's temp folder)
    (tmp_path / "tmp").mkdir()
    assert launch.main(["evaluate", f"--workdir={workdir}", "--config.data.name=wikitext", "--config.data.path=w"]) == 1
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    logs = list((tmp_path / "tmp").iterdir())
    assert len(lines) == 1 and len(logs) == 1 and str(logs[0]) in lines[0]
    assert sorted(p.name for p in workdir.iterdir()) == ["notes.txt"]


def test_a_failed_export_logs_outside_the_run_it_reads(tmp_path, monkeypatch, capsys):
    """`export` only reads --workdir: its crash log goes to the temp folder, and the source run is unchanged."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "notes.txt").write_text("keep")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()

    def boom(args):
        raise RuntimeError("export broke")

    _fake_command(monkeypatch, "export", boom)
    assert launch.main(["export", f"--workdir={workdir}", f"--out={tmp_path / 'out'}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: unexpected RuntimeError: export broke, ") and str(tmp_path / "tmp") in err
    assert sorted(p.name for p in workdir.iterdir()) == ["notes.txt"]
    assert len(list((tmp_path / "tmp").iterdir())) == 1


def test_a_run_goes_on_when_its_output_pipe_closes(tmp_path):
    """`python -m launch pretrain ... | head -1`: the first progress line after `head` left raised BrokenPipeError,
    which ended the run as an unexpected error and removed its folder (no checkpoint yet). It now trains to the end,
    saying once on stderr that it stopped printing."""
    env = dict(os.environ, XLA_FLAGS=xla_flags.devices(8), JAX_PLATFORMS="cpu")
    workdir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "launch", "pretrain", CONFIG, f"--workdir={workdir}",
                             "--config.train.steps=6", "--config.train.log_every=1", "--config.train.eval_every=0",
                             "--config.checkpoint.every=100", "--config.checkpoint.async_save=false",
                             f"--config.data.cache_dir={tmp_path / 'cache'}"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not proc.stdout.readline().startswith("step 1/6"):    # the reader takes one progress line and goes
            assert proc.poll() is None, proc.stderr.read()[-3000:]
        proc.stdout.close()
        err = proc.communicate(timeout=300)[1]
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert err.count("note: standard output was closed") == 1 and "Error" not in err, err[-3000:]
    assert os.listdir(workdir / "checkpoints") == ["6"]
