"""The run-folder gate: what may change on resume (recorded), what is refused (naming key and values, nothing
written), the checkpoint checks, claim's clean-up and provenance (one run per folder: test_lock.py)."""
import importlib
import json
import os
import platform
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import pytest

from tupe_jax import allocator
from tupe_jax import checkpoint as ckpt
from tupe_jax import config as config_lib
from tupe_jax import host
from tupe_jax import workdir as workdir_lib
from tupe_jax import xla_options
from tupe_jax.errors import UserError
from tests.workdir_fixtures import ROOT, load_config, tree
from tests import xla_flags


def fake_checkpoint(workdir, config, step):
    """A committed checkpoint of `config` at `step` (tiny params; the gate reads only its meta)."""
    params = {"w": jnp.ones((2,))}
    with ckpt.Checkpointer(workdir, async_=False) as c:
        c.save(step, {"step": jnp.int32(step), "params": params}, {}, workdir_lib.make_meta(config, params),
               force=True)


def test_allowed_changes_are_recorded_and_an_unchanged_config_is_not_rewritten(tmp_path):
    wd = str(tmp_path / "run")
    workdir_lib.write_config(wd, load_config())
    before = os.stat(os.path.join(wd, "config.json")).st_mtime_ns
    workdir_lib.write_config(wd, load_config())                                   # same config: nothing written
    assert os.stat(os.path.join(wd, "config.json")).st_mtime_ns == before
    assert not os.path.exists(os.path.join(wd, "config_history.jsonl"))
    workdir_lib.write_config(wd, load_config(**{"train.steps": 2000, "checkpoint.every": 50, "mesh.fsdp": 2}))
    history = [json.loads(line) for line in open(os.path.join(wd, "config_history.jsonl"))]
    assert history[-1]["changes"] == {"checkpoint.every": [1000, 50], "mesh.fsdp": [1, 2], "train.steps": [1000, 2000]}
    assert workdir_lib.read_config(wd).train.steps == 2000                  # config.json: what the run is now


@pytest.mark.parametrize("key,value", [("train.batch_size", 16), ("train.learning_rate", 0.01), ("train.seed", 3),
                                       ("model.pe", "rope"), ("data.mask_prob", 0.2), ("train.adam_b2", 0.98)])
def test_every_other_difference_is_refused_naming_the_key_and_both_values(tmp_path, key, value):
    wd = str(tmp_path / "run")
    config = load_config()
    workdir_lib.write_config(wd, config)
    fake_checkpoint(wd, config, 20)
    before = tree(wd)
    section, name = key.split(".")
    with pytest.raises(UserError) as info:
        workdir_lib.write_config(wd, load_config(**{key: value}))
    message = str(info.value)
    assert f"{key}={config[section][name]!r} (this command: {value!r})" in message and "\n" not in message
    assert "--overwrite_config" not in message          # a trained run is never overwritten
    assert tree(wd) == before


def test_steps_below_the_checkpoint_and_overwrite_of_a_trained_run_are_refused(tmp_path):
    wd = str(tmp_path / "run")
    config = load_config()
    workdir_lib.write_config(wd, config)
    fake_checkpoint(wd, config, 20)
    before = tree(wd)
    with pytest.raises(UserError, match=r"is at step 20; train.steps=10 would end before it, --config.train.steps"):
        workdir_lib.write_config(wd, load_config(**{"train.steps": 10}))
    with pytest.raises(UserError, match="--overwrite_config would misrepresent"):
        workdir_lib.write_config(wd, load_config("pe=rope"), overwrite=True)
    assert tree(wd) == before
    workdir_lib.write_config(wd, load_config(**{"train.steps": 20}))             # finishing where it is: fine


def test_checkpoints_that_disagree_with_the_config_are_refused(tmp_path):
    """config.json edited by hand (or missing): the checkpoints' meta still knows what the run was."""
    wd = str(tmp_path / "run")
    fake_checkpoint(wd, load_config(**{"model.max_len": 64}), 20)
    with pytest.raises(UserError, match="were trained with other model/data settings"):
        workdir_lib.check_config(wd, load_config(**{"model.max_len": 128}))
    workdir_lib.check_config(wd, load_config(**{"model.max_len": 64}))
    with open(os.path.join(wd, "config.json"), "w") as f:                   # edited by hand to match the new one
        f.write(config_lib.to_json(load_config(**{"model.max_len": 128})))
    with pytest.raises(UserError, match="does not match its checkpoint step 20"):
        workdir_lib.check_config(wd, load_config(**{"model.max_len": 128}))


def test_a_truncated_config_and_a_run_of_another_kind(tmp_path):
    wd = tmp_path / "run"
    wd.mkdir()
    (wd / "config.json").write_text('{"model": {"pe": "tup')
    with pytest.raises(UserError, match="config.json is not valid JSON"):
        workdir_lib.write_config(str(wd), load_config())
    glue = config_lib.load_config(os.path.join(ROOT, "configs", "glue.py") + ":task=rte")
    wd2 = str(tmp_path / "pre")
    workdir_lib.write_config(wd2, load_config())
    with pytest.raises(UserError, match="holds a pretraining run; this command is a fine-tuning run"):
        workdir_lib.write_config(wd2, glue)


def test_claim_cleans_up_after_a_failure_but_keeps_what_was_there(tmp_path):
    wd = str(tmp_path / "run")
    workdir_lib.write_config(wd, load_config())
    (tmp_path / "run" / "notes.txt").write_text("mine")
    before = tree(wd)
    with pytest.raises(RuntimeError):
        with workdir_lib.claim(wd, load_config(**{"train.steps": 5})):
            (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
            raise RuntimeError("boom")
    after = tree(wd)
    assert "metrics.jsonl" not in after and after["notes.txt"] == before["notes.txt"]
    assert not os.path.exists(os.path.join(wd, ".lock"))


def as_process_0_of_2(monkeypatch, barrier, process_1=lambda mine: mine):
    """claim in a (simulated) 2-process run whose cross-process barrier is `barrier(name)` and whose process 1
    contributes `process_1(process 0's row)` to the agreement; returns the rows process 0 gathered."""
    claim_module = importlib.import_module("tupe_jax.workdir.claim")   # the package exports the function
    monkeypatch.setattr(claim_module.jax, "process_count", lambda: 2)
    monkeypatch.setattr(claim_module.multihost_utils, "sync_global_devices", barrier)
    gathered = []

    def gather(mine):
        gathered.append(mine)
        return [mine, process_1(dict(mine))]
    monkeypatch.setattr(claim_module, "gather", gather)
    return gathered


def as_process_1_of_2(monkeypatch, error_of_process_0=lambda stage: None):
    """claim as process 1 of a (simulated) 2-process run whose barrier passes and whose process 0 contributes
    `error_of_process_0(stage)` to each agreement."""
    claim_module = importlib.import_module("tupe_jax.workdir.claim")
    monkeypatch.setattr(claim_module.jax, "process_count", lambda: 2)
    monkeypatch.setattr(claim_module.jax, "process_index", lambda: 1)
    monkeypatch.setattr(claim_module.multihost_utils, "sync_global_devices", lambda name: None)
    monkeypatch.setattr(claim_module, "gather", lambda mine: [{**mine, "error": error_of_process_0(mine["stage"])},
                                                              mine])


def test_a_multi_process_claim_writes_only_once_every_process_passed_the_checks(tmp_path, monkeypatch, capsys):
    wd = str(tmp_path / "run")
    workdir_lib.write_config(wd, load_config())
    before, at_barrier = tree(wd), []
    gathered = as_process_0_of_2(monkeypatch, lambda name: at_barrier.append((name, tree(wd))))
    with workdir_lib.claim(wd, load_config(**{"train.steps": 2000})):   # an allowed change: config.json is rewritten
        assert os.path.exists(os.path.join(wd, ".lock"))
    assert at_barrier == [(f"tupe_jax.claim {os.path.abspath(wd)}", before)]   # nothing written before it
    assert [(g["stage"], g["sees"], g["error"]) for g in gathered] == [("checks", "config.json, no checkpoints/", None),
                                                                       ("lock", "", None), ("shared", "", None)]
    assert "process 0 of 2 passed the workdir checks; waiting for the other processes" in capsys.readouterr().out
    assert tree(wd) != before


def refused(wd, config):
    with pytest.raises(UserError) as info:
        with workdir_lib.claim(wd, config):
            pytest.fail("the command ran")
    return str(info.value)


def never(name):
    raise AssertionError(f"reached the barrier {name}")


def test_processes_given_different_workdirs_are_refused_with_nothing_written(tmp_path, monkeypatch):
    wd = str(tmp_path / "run")
    workdir_lib.write_config(wd, load_config())
    before = tree(wd)
    as_process_0_of_2(monkeypatch, never, lambda row: {**row, "workdir": "0" * 64})
    assert refused(wd, load_config(**{"train.steps": 2000})) == (
        f"error: the processes of this run were given different workdirs ({os.path.abspath(wd)} on process 0), "
        "--workdir, give every process the same --workdir: a folder they share or a gs:// path")
    assert tree(wd) == before


def test_a_check_that_failed_on_another_process_stops_this_one_with_its_line(tmp_path, monkeypatch):
    wd = str(tmp_path / "run")
    workdir_lib.write_config(wd, load_config())
    before = tree(wd)
    as_process_0_of_2(monkeypatch, never, lambda row: {**row, "error": ["run folder x is locked", "--workdir", "wait"]})
    assert refused(wd, load_config()) == \
        "error: run folder x is locked (found by process 1; this is process 0), --workdir, wait"
    assert tree(wd) == before


def test_a_lease_taken_over_stops_every_process_before_the_checkpoint(monkeypatch):
    """`still_held` in a (simulated) 2-process run: process 0, which holds the bucket lease, finds it taken over,
    shares that and raises LeaseLost; process 1 (which holds nothing and must not read the lease) stops with process
    0's line; with the lease intact both go on."""
    claim_module = importlib.import_module("tupe_jax.workdir.claim")
    lost = workdir_lib.LeaseLost("this run's lease on gs://b/run was taken over by process 7 on h", "--workdir",
                                 "let it finish")

    def taken(workdir):
        raise lost
    monkeypatch.setattr(claim_module, "check_held", taken)
    gathered = as_process_0_of_2(monkeypatch, never)
    with pytest.raises(workdir_lib.LeaseLost) as info:
        workdir_lib.still_held("gs://b/run")
    assert info.value is lost
    assert gathered[-1]["stage"] == "lease" and gathered[-1]["error"] == [lost.what, "--workdir", "let it finish"]
    monkeypatch.setattr(claim_module, "check_held", lambda workdir: None)
    workdir_lib.still_held("gs://b/run")                         # an intact lease: process 0 goes on
    monkeypatch.setattr(claim_module, "check_held", never)       # process 1 never reads the lease
    as_process_1_of_2(monkeypatch, lambda stage: [lost.what, lost.where, lost.fix] if stage == "lease" else None)
    with pytest.raises(UserError) as info:
        workdir_lib.still_held("gs://b/run")
    assert str(info.value) == ("error: this run's lease on gs://b/run was taken over by process 7 on h (found by "
                               "process 0; this is process 1), --workdir, let it finish")
    as_process_1_of_2(monkeypatch)
    workdir_lib.still_held("gs://b/run")                         # no takeover: process 1 goes on


def test_a_check_of_process_0_alone_is_shared_with_the_others(tmp_path, monkeypatch):
    """The gate and the lock check are process 0's; what it finds reaches the gather, not just its own log."""
    wd = str(tmp_path / "run")
    workdir_lib.write_config(wd, load_config())
    before = tree(wd)
    gathered = as_process_0_of_2(monkeypatch, never)
    claim_module = importlib.import_module("tupe_jax.workdir.claim")

    def held(workdir):
        raise UserError(f"run folder {workdir} is in use by process 7 on h", "--workdir", "wait for it to finish")
    monkeypatch.setattr(claim_module, "refuse_if_held", held)
    assert refused(wd, load_config()) == f"error: run folder {wd} is in use by process 7 on h, --workdir, wait for " \
        "it to finish"
    assert gathered[0]["error"] == [f"run folder {wd} is in use by process 7 on h", "--workdir",
                                    "wait for it to finish"]
    assert tree(wd) == before


def test_a_lock_lost_on_process_0_is_shared_and_nothing_is_written(tmp_path, monkeypatch):
    """Another launch took the lock between process 0's `refuse_if_held` and its `RunLock`."""
    wd = str(tmp_path / "run")
    workdir_lib.write_config(wd, load_config())
    before = tree(wd)
    gathered = as_process_0_of_2(monkeypatch, lambda name: None)
    line = ["run folder x is in use by process 9 on h", "--workdir", "wait for it"]

    def lost(workdir):
        raise UserError(*line)
    monkeypatch.setattr(importlib.import_module("tupe_jax.workdir.claim"), "RunLock", lost)
    assert refused(wd, load_config()) == "error: run folder x is in use by process 9 on h, --workdir, wait for it"
    assert [(g["stage"], g["error"]) for g in gathered] == [("checks", None), ("lock", line)]
    assert tree(wd) == before


def test_a_lock_lost_on_process_0_stops_process_1_too(tmp_path, monkeypatch):
    wd = str(tmp_path / "run")
    workdir_lib.write_config(wd, load_config())
    before = tree(wd)
    line = ["run folder x is in use by process 9 on h", "--workdir", "wait for it"]
    as_process_1_of_2(monkeypatch, lambda stage: line if stage == "lock" else None)   # process 0's lock step failed
    assert refused(wd, load_config()) == ("error: run folder x is in use by process 9 on h (found by process 0; this "
                                          "is process 1), --workdir, wait for it")
    assert tree(wd) == before


def test_an_unexpected_error_in_process_0s_checks_is_shared_and_raised_as_itself(tmp_path, monkeypatch):
    """A transport failure (not a UserError) on process 0 alone used to leave the other processes waiting."""
    wd = str(tmp_path / "run")
    workdir_lib.write_config(wd, load_config())
    before = tree(wd)
    gathered = as_process_0_of_2(monkeypatch, never)

    def reset(workdir):
        raise ConnectionError("connection reset by peer\nmore detail")
    monkeypatch.setattr(importlib.import_module("tupe_jax.workdir.claim"), "refuse_if_held", reset)
    with pytest.raises(ConnectionError, match="^connection reset by peer"):
        with workdir_lib.claim(wd, load_config()):
            pytest.fail("the command ran")
    assert [(g["stage"], g["error"]) for g in gathered] == [
        ("checks", ["ConnectionError: connection reset by peer", "--workdir", "see the traceback of that process"])]
    assert tree(wd) == before


def test_an_unexpected_error_in_process_0s_lock_step_stops_process_1_with_its_line(tmp_path, monkeypatch):
    wd = str(tmp_path / "run")
    workdir_lib.write_config(wd, load_config())
    before = tree(wd)
    claim_module = importlib.import_module("tupe_jax.workdir.claim")
    gathered = as_process_0_of_2(monkeypatch, lambda name: None)

    def io_error(*args):
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(claim_module, "store_config", io_error)
    with pytest.raises(OSError, match="Input/output error"):
        with workdir_lib.claim(wd, load_config()):
            pytest.fail("the command ran")
    row = gathered[-1]
    assert (row["stage"], row["error"]) == ("lock", ["OSError: [Errno 5] Input/output error", "--workdir",
                                                     "see the traceback of that process"])
    assert tree(wd) == before
    as_process_1_of_2(monkeypatch, lambda stage: row["error"] if stage == "lock" else None)   # process 1 gets it
    assert refused(wd, load_config()) == ("error: OSError: [Errno 5] Input/output error (found by process 0; this is "
                                          "process 1), --workdir, see the traceback of that process")
    assert tree(wd) == before


def test_a_fresh_run_in_a_folder_process_1_cannot_see_is_refused_on_process_1(tmp_path, monkeypatch):
    """A local --workdir on a pod, fresh: every process's checks see "no folder" alike, but process 0 then writes
    config.json on its own disk only."""
    wd = str(tmp_path / "run")
    as_process_1_of_2(monkeypatch)
    monkeypatch.setattr(importlib.import_module("tupe_jax.workdir.claim"), "SHARED_WAIT_SECONDS", 0.3)
    assert refused(wd, load_config()) == (
        f"error: {wd}/config.json, written by process 0, is not visible on process 1 after 0 s (is {wd} a folder of "
        "this host's own?), --workdir, give every process one folder they share: a network file system mounted at "
        "the same path on every host, or a gs:// path")
    assert not os.path.exists(wd)


def test_a_folder_process_1_cannot_see_stops_process_0_and_leaves_nothing(tmp_path, monkeypatch):
    wd = str(tmp_path / "run")
    line = [f"{wd}/config.json, written by process 0, is not visible on process 1 after 90 s", "--workdir", "share"]
    gathered = as_process_0_of_2(monkeypatch, lambda name: None,
                                 lambda row: {**row, "error": line if row["stage"] == "shared" else None})
    assert refused(wd, load_config()) == f"error: {line[0]} (found by process 1; this is process 0), --workdir, share"
    assert [g["stage"] for g in gathered] == ["checks", "lock", "shared"]
    assert not os.path.exists(wd)       # process 0's config.json, provenance and lock are gone again


def test_process_1_waits_for_a_config_json_that_appears_late(tmp_path, monkeypatch):
    """An NFS client can hide another host's new file for a while: a late file is found, not refused."""
    wd = tmp_path / "run"
    wd.mkdir()
    claim_module = importlib.import_module("tupe_jax.workdir.claim")
    monkeypatch.setattr(claim_module, "SHARED_WAIT_SECONDS", 30.0)
    timer = threading.Timer(1.0, lambda: (wd / "config.json").write_text("{}"))
    timer.start()
    t0 = time.monotonic()
    claim_module.see_what_process_0_wrote(str(wd))
    timer.join()
    assert 0.9 < time.monotonic() - t0 < 10


def test_processes_that_see_the_folder_differently_are_refused(tmp_path, monkeypatch):
    """A local --workdir on a pod: each host has its own disk, so process 1 finds nothing where process 0 has a run."""
    wd = str(tmp_path / "run")
    workdir_lib.write_config(wd, load_config())
    fake_checkpoint(wd, load_config(), 40)
    before = tree(wd)
    as_process_0_of_2(monkeypatch, never, lambda row: {**row, "sees": "no folder"})
    message = refused(wd, load_config())
    assert message.startswith(f"error: the processes of this run see different contents in {os.path.abspath(wd)} "
                              "(process 0: config.json, checkpoints/ with 1 steps (newest 40); process 1: no folder)")
    assert message.endswith("--workdir, give every process one folder they share: a network file system mounted at "
                            "the same path on every host, or a gs:// path")
    assert tree(wd) == before


def test_gather_round_trips_a_row():
    claim_module = importlib.import_module("tupe_jax.workdir.claim")
    row = {"workdir": "ab" * 32, "sees": "no folder", "error": ["é \u0000 \"x\"", "--workdir", ""]}
    assert claim_module.gather(row) == [row]


def test_nothing_outside_the_workdir_and_no_downloading_line(tmp_path):
    """A first run on the embedded corpus: the prepared data goes to data.cache_dir, $TMPDIR stays empty, and
    nothing claims to be downloading (nothing is downloaded)."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    wd = tmp_path / "run"
    argv = [sys.executable, "-m", "launch", "pretrain", "--config=configs/pretrain.py:pe=nopos", f"--workdir={wd}",
            "--config.model.hidden_size=32", "--config.model.num_layers=1", "--config.model.num_heads=2",
            "--config.model.mlp_dim=64", "--config.model.vocab_size=512", "--config.model.max_len=32",
            "--config.train.steps=1", "--config.train.batch_size=8", "--config.train.eval_every=0",
            "--config.checkpoint.async_save=false", f"--config.data.cache_dir={tmp_path / 'cache'}"]
    env = {**os.environ, "TMPDIR": str(scratch), "XLA_FLAGS": xla_flags.devices(1)}
    env.pop("GLIBC_TUNABLES", None)             # the launcher sets the huge-page tunable itself (allocator.py)
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Downloading" not in proc.stdout + proc.stderr and "data: preparing embedded" in proc.stdout
    applies = allocator.tuned_environ(env, platform.libc_ver(), allocator.thp_mode()) is not None
    row = json.loads(open(wd / "provenance.jsonl").readline())
    assert row["glibc_tunables"] == ("glibc.malloc.hugetlb=1" if applies else "")
    assert sorted(os.listdir(scratch)) == []
    assert (tmp_path / "cache" / "tfds").is_dir() and not list((tmp_path / "cache" / "tfds").glob(".scratch-*"))


def test_a_folder_that_cannot_be_written_is_refused_before_anything(tmp_path, monkeypatch):
    """As root, permissions do not stop writes; a real write attempt does (read-only mounts): simulated here."""
    import tempfile  # pylint: disable=import-outside-toplevel

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Read-only file system")

    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)
    with pytest.raises(UserError, match=r"is not writable \(Read-only file system\), --workdir"):
        workdir_lib.check_folder(str(tmp_path / "new_run"))
    assert not os.path.exists(tmp_path / "new_run")


def test_every_claim_records_its_provenance(tmp_path):
    import jax  # pylint: disable=import-outside-toplevel
    wd = str(tmp_path / "run")
    with workdir_lib.claim(wd, load_config()):
        with workdir_lib.claim(wd, load_config()):          # the launcher's claim and the loop's: one row
            pass
    with workdir_lib.claim(str(tmp_path / "other"), load_config()):
        pass
    rows = [json.loads(line) for line in open(os.path.join(wd, "provenance.jsonl"))]
    assert len(rows) == 1
    row = rows[0]
    assert row["packages"]["jax"] == jax.__version__ and row["devices"]["count"] == jax.device_count()
    assert row["devices"]["kind"] == jax.devices()[0].device_kind and row["process_count"] == 1
    assert row["command"] == " ".join(sys.argv) and len(row["git_commit"]) >= 40
    assert row["cpu"] == host.cpu_description()
    assert row["dot_library"] == ("onednn" if os.environ.get("TUPE_JAX_ONEDNN") != "0" and
                                  platform.machine().lower() in xla_options.X86 else "xla")


@pytest.mark.slow
def test_profile_steps_write_a_trace_tensorboard_lists(tmp_path):
    """`train.profile_steps=2,3` leaves an xplane trace where TensorBoard's profile plugin looks for runs."""
    from tupe_jax.pretrain import loop  # pylint: disable=import-outside-toplevel
    config = load_config(**{"model.hidden_size": 32, "model.num_layers": 1, "model.num_heads": 2, "model.mlp_dim": 64,
                      "model.vocab_size": 512, "model.max_len": 32, "train.steps": 4, "train.batch_size": 8,
                      "train.eval_every": 0, "checkpoint.async_save": "false", "train.profile_steps": "2,3",
                      "data.cache_dir": str(tmp_path / "cache")})
    loop.pretrain(config, str(tmp_path / "run"), devices=jax.devices()[:1])
    traces = list((tmp_path / "run" / "profile" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    with pytest.raises(UserError, match=r"train.profile_steps = '3,2' is not START,END"):
        from tupe_jax.pretrain.validate import validate  # pylint: disable=import-outside-toplevel
        validate(load_config(**{"train.profile_steps": "3,2"}), 8)


def test_a_run_made_before_an_added_key_resumes_and_keeps_its_identity(tmp_path):
    """model.sinusoidal_style was added after runs existed: a stored config.json without it reads as 'scaled'
    (the behaviour those runs had), so the gate accepts the run and its identity hash is unchanged; another
    value is still refused."""
    import json as json_lib
    from tupe_jax import config as config_lib
    from tupe_jax.errors import UserError
    from tupe_jax.workdir import check_config, differing_keys
    from tupe_jax.workdir.meta import identity_hash
    config = config_lib.load_config(os.path.join(ROOT, "configs", "pretrain.py") + ":pe=sinusoidal,objective=clm")
    stored = json_lib.loads(config_lib.to_json(config))
    del stored["model"]["sinusoidal_style"]
    (tmp_path / "config.json").write_text(json_lib.dumps(stored))
    assert check_config(str(tmp_path), config) == []
    assert differing_keys(str(tmp_path), config, ("model", "data", "train")) == []
    assert identity_hash(stored) == identity_hash(config)
    other = config_lib.apply_overrides(
        config_lib.load_config(os.path.join(ROOT, "configs", "pretrain.py") + ":pe=sinusoidal,objective=clm"),
        {"model.sinusoidal_style": "fairseq"})
    assert identity_hash(other) != identity_hash(config)
    # model.type_vocab_size (segment embeddings) as well: a run without the key is a run without them
    no_segments = json_lib.loads(config_lib.to_json(config))
    del no_segments["model"]["type_vocab_size"]
    (tmp_path / "config.json").write_text(json_lib.dumps(no_segments))
    assert check_config(str(tmp_path), config) == [] and identity_hash(no_segments) == identity_hash(config)
    # a checkpoint whose meta hashed the key at its default (made between the key's addition and this rule) matches
    from tupe_jax.workdir.meta import HASHED_AT_DEFAULT, same_identity
    assert identity_hash(config, keep_added=HASHED_AT_DEFAULT) != identity_hash(config)
    assert same_identity(identity_hash(config, keep_added=HASHED_AT_DEFAULT), config)
    assert not same_identity(identity_hash(other, keep_added=HASHED_AT_DEFAULT), config)
    # model.dropout_bits came later, its default for new runs (16) differing from what older runs did (32): a run
    # made before the key (no key) is the 32-bit run and keeps its hash; today's default is another run
    thirty_two = config_lib.apply_overrides(
        config_lib.load_config(os.path.join(ROOT, "configs", "pretrain.py") + ":pe=sinusoidal,objective=clm"),
        {"model.dropout_bits": "32"})
    stored = json_lib.loads(config_lib.to_json(thirty_two))
    del stored["model"]["dropout_bits"], stored["model"]["sinusoidal_style"]
    (tmp_path / "config.json").write_text(json_lib.dumps(stored))
    assert check_config(str(tmp_path), thirty_two) == [] and identity_hash(stored) == identity_hash(thirty_two)
    assert int(config.model.dropout_bits) == 16 and identity_hash(config) != identity_hash(thirty_two)
    assert not same_identity(identity_hash(stored), config)
    with pytest.raises(UserError, match="dropout_bits"):
        check_config(str(tmp_path), config)
    (tmp_path / "config.json").write_text(json_lib.dumps({**stored, "model": {
        k: v for k, v in json_lib.loads(config_lib.to_json(config))["model"].items() if k != "sinusoidal_style"}}))
    with pytest.raises(UserError, match="sinusoidal_style"):
        check_config(str(tmp_path), other)
