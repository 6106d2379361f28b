"""Two real JAX processes given different command lines, or stopped by SIGTERM in a command that does not train:
they stop together, each with one line (a process that stopped alone left the other waiting at the next collective
call; processes given different learning rates trained, each with its own, and exited 0)."""
import signal
import subprocess
import sys
import time

import pytest

from tests.glue_fixtures import make_pretrained
from tests.test_multiprocess import ROOT, command, env, free_port, two_processes


def last_lines(outs):
    return [err.strip().splitlines()[-1] for _, err in outs]


@pytest.mark.slow
def test_processes_given_different_configs_stop_together_before_anything_is_written(tmp_path):
    argv = [a for a in command(tmp_path / "run", tmp_path / "cache")[3:] if "learning_rate" not in a]
    outs = two_processes(argv, env(2), code=2,
                         each=lambda i: [f"--config.train.learning_rate=3e-{i}"])
    assert last_lines(outs) == ["error: the processes of this run were given different values of "
                                "--config.train.learning_rate (3.0 on process 0, 0.3 on process 1), "
                                "--config.train.learning_rate, run the same command line on every process (host)"] * 2
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_command_given_different_flags_stops_every_process(tmp_path):
    """`evaluate --step` of process 1 was replaced by process 0's without a word; so is another corpus."""
    make_pretrained(tmp_path / "run", tmp_path / "cache", steps=(10, 20))
    outs = two_processes(["evaluate", f"--workdir={tmp_path / 'run'}"],
                         {**env(2), "TUPE_JAX_CACHE": str(tmp_path / "cache")}, code=2,
                         each=lambda i: [f"--step={10 * (i + 1)}"])
    assert all(line.startswith("error: the processes of this run were given different values of --step (10 on "
                               "process 0, 20 on process 1), --step,") for line in last_lines(outs))
    outs = two_processes(["evaluate", f"--workdir={tmp_path / 'run'}", "--config.data.name=text_files"],
                         {**env(2), "TUPE_JAX_CACHE": str(tmp_path / "cache")}, code=2,
                         each=lambda i: [f"--config.data.path={tmp_path}"] if i else [])   # another corpus: one
    assert all(line.startswith("error: the processes of this run were given different values of --config.data.path "
                               f"(none on process 0, '{tmp_path}' on process 1), --config.data.path,")
               for line in last_lines(outs))


@pytest.mark.slow
def test_sigterm_ends_an_analysis_on_every_process(tmp_path):
    """jax.distributed's preemption notifier took SIGTERM, which only the training loops act on: the analysis ran
    to its end and wrote its outputs."""
    make_pretrained(tmp_path / "run", tmp_path / "cache")
    port = free_port()
    lengths = ",".join(str(8 * k) for k in range(1, 60))
    procs = [subprocess.Popen([sys.executable, "-m", "launch", "extrapolate", f"--workdir={tmp_path / 'run'}",
                               f"--lengths={lengths}", f"--out={tmp_path / 'out'}",
                               f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", f"--process_id={i}"],
                              cwd=ROOT, env={**env(2), "TUPE_JAX_CACHE": str(tmp_path / "cache")},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        seen = []
        for line in procs[0].stdout:           # the analysis is under way: past jax.distributed's start
            seen.append(line)
            if "extrapolate run L=" in line:
                break
        assert any("L=" in s for s in seen), "".join(seen)[-2000:]
        for p in procs:
            p.send_signal(signal.SIGTERM)
        start = time.monotonic()
        codes = [p.wait(timeout=60) for p in procs]
        assert codes == [-signal.SIGTERM] * 2 and time.monotonic() - start < 30
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.slow
def test_an_init_from_one_process_cannot_read_stops_every_process(tmp_path):
    """The adopt hook (init_from's model keys) ran before the claim's agreement: the process that could not read
    init_from stopped alone and the other waited at the next collective call. Both are given the same relative
    init_from; only process 0's working folder holds it (as one host's disk would)."""
    make_pretrained(tmp_path / "a" / "source", tmp_path / "cache")
    (tmp_path / "b").mkdir()
    argv = [a for a in command(tmp_path / "run", tmp_path / "cache")[5:] if not a.startswith("--config.model.")]
    outs = two_processes(["pretrain", f"--config={ROOT}/configs/pretrain.py", *argv, "--config.init_from=source"],
                         {**env(2), "PYTHONPATH": ROOT}, timeout=120, code=2, cwd=lambda i: tmp_path / "ab"[i])
    assert last_lines(outs) == [f"error: init_from {tmp_path / 'b' / 'source'} does not exist (found by process 1; "
                                "this is process 0), --config.init_from, point it at a `launch pretrain` workdir (or "
                                "an import's), or leave it empty to train from scratch",
                                f"error: init_from {tmp_path / 'b' / 'source'} does not exist, --config.init_from, "
                                "point it at a `launch pretrain` workdir (or an import's), or leave it empty to train "
                                "from scratch"]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_another_corpus_one_process_cannot_read_stops_every_process(tmp_path):
    """A corpus for `evaluate` (`--config.data.*`) that one host lacks: that process stopped with its line and the
    other waited at the next collective call. Both are given the same relative path; only process 0's working
    folder holds it (as one host's disk would)."""
    make_pretrained(tmp_path / "run", tmp_path / "cache")
    (tmp_path / "a" / "text").mkdir(parents=True)
    (tmp_path / "a" / "text" / "train.txt").write_text("alpha beta\n\ngamma delta\n" * 20)
    (tmp_path / "b").mkdir()
    outs = two_processes(["evaluate", f"--workdir={tmp_path / 'run'}", "--config.data.name=text_files",
                          "--config.data.path=text"], {**env(2), "PYTHONPATH": ROOT}, timeout=120, code=2,
                         cwd=lambda i: tmp_path / "ab"[i])
    assert all(f"{tmp_path / 'b' / 'text'} does not exist" in line for line in last_lines(outs)), outs
