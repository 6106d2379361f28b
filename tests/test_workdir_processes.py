"""The run-folder gate across processes (simulated: process count, barrier and gather patched): a claim writes only
once every process passed the checks; a check, a lock or a lease lost on one process stops all of them with its
line; processes that see the folder differently are refused with nothing written (one process: test_workdir.py)."""
import importlib
import os
import threading
import time

import pytest

from tupe_jax import workdir as workdir_lib
from tupe_jax.errors import UserError
from tests.workdir_fixtures import fake_checkpoint, load_config, tree


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
                                                                       ("gate", "", None), ("lock", "", None),
                                                                       ("shared", "", None)]
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
    assert [(g["stage"], g["error"]) for g in gathered] == [("checks", None), ("gate", None), ("lock", line)]
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
    assert [g["stage"] for g in gathered] == ["checks", "gate", "lock", "shared"]
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


def test_processes_given_different_configs_are_refused_naming_the_key(tmp_path, monkeypatch):
    """Each process trained with its own config (process 1 at another learning rate): both exited 0."""
    wd = str(tmp_path / "run")
    as_process_0_of_2(monkeypatch, never, lambda row: {**row, "same": {
        **row["same"], "--config.train.learning_rate": "0.3"}})
    config = load_config(**{"train.learning_rate": 3.0})
    assert refused(wd, config) == (
        "error: the processes of this run were given different values of --config.train.learning_rate (3.0 on "
        "process 0, 0.3 on process 1), --config.train.learning_rate, run the same command line on every process "
        "(host)")
    assert not os.path.exists(wd)


def test_a_validator_that_failed_on_one_process_stops_the_other(tmp_path, monkeypatch):
    """The launcher's validator ran before the claim: a prepared directory missing on one host stopped that process
    alone, and the other waited in the claim's agreement until JAX's timeout."""
    wd = str(tmp_path / "run")
    as_process_1_of_2(monkeypatch, lambda stage: ["the data is missing", "--config.data.path", "copy it"]
                      if stage == "checks" else None)
    with pytest.raises(UserError, match=r"the data is missing \(found by process 0; this is process 1\)"):
        with workdir_lib.claim(wd, load_config(), validate=lambda: None):
            pytest.fail("the command ran")

    def bad():
        raise UserError("a bad key", "--config.x", "fix it")
    gathered = as_process_0_of_2(monkeypatch, never)
    assert refused_with(wd, load_config(), bad) == "error: a bad key, --config.x, fix it"
    assert [(g["stage"], g["error"]) for g in gathered] == [("checks", ["a bad key", "--config.x", "fix it"])]
    assert not os.path.exists(wd)


def test_a_gate_refusal_on_one_process_stops_the_other(tmp_path, monkeypatch):
    """check_config ran outside any agreement: a process that refused the resume left the other at the barrier."""
    wd = str(tmp_path / "run")
    workdir_lib.write_config(wd, load_config())
    before = tree(wd)
    as_process_1_of_2(monkeypatch, lambda stage: ["holds a run with x", "--workdir", "resume"]
                      if stage == "gate" else None)
    with pytest.raises(UserError, match=r"holds a run with x \(found by process 0; this is process 1\)"):
        with workdir_lib.claim(wd, load_config()):
            pytest.fail("the command ran")
    assert tree(wd) == before


def refused_with(wd, config, validate):
    with pytest.raises(UserError) as info:
        with workdir_lib.claim(wd, config, validate=validate):
            pytest.fail("the command ran")
    return str(info.value)
