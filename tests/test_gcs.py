"""Run folders in a bucket (`--workdir=gs://...`) against a real GCS endpoint (the emulator of gcs_fixtures)."""
import glob
import importlib
import json
import os
import time

import jax
import numpy as np
import pytest

from tests import xla_flags
from tests.gcs_fixtures import BUCKET, gcs  # noqa: F401  (the fixture)
from tupe_jax import config as config_lib
from tupe_jax import files
from tupe_jax import workdir as workdir_lib
from tupe_jax.errors import UserError
from tupe_jax.metrics import read_metrics
from tupe_jax.pretrain import loop as pretrain_loop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {"model.hidden_size": "32", "model.num_layers": "1", "model.num_heads": "2", "model.mlp_dim": "64",
        "model.vocab_size": "512", "model.max_len": "32", "train.steps": "6", "train.batch_size": "8",
        "train.log_every": "1", "train.eval_every": "0", "train.eval_steps": "1", "checkpoint.every": "3",
        "checkpoint.async_save": "false"}


def tiny(cache, **extra):
    config = config_lib.load_config(os.path.join(ROOT, "configs", "pretrain.py") + ":pe=tupe_r")
    config_lib.apply_overrides(config, {**TINY, **{k: str(v) for k, v in extra.items()}})
    with config.unlocked():
        config.data.cache_dir = str(cache)
    return config


def params_of(workdir):
    return jax.tree_util.tree_map(np.asarray, workdir_lib.load_run(workdir).params)


def test_a_bucket_run_matches_a_local_run_and_resumes(gcs, tmp_path, monkeypatch, capsys):  # noqa: F811
    """pretrain into gs://, stopped after 3 steps (as preempted) and resumed from the bucket: losses and final
    parameters equal an uninterrupted local run bitwise; nothing is written to a local `gs:` folder."""
    monkeypatch.chdir(tmp_path)
    remote = f"gs://{BUCKET}/run"
    pretrain_loop.pretrain(tiny(tmp_path / "cache"), str(tmp_path / "local"), devices=jax.devices()[:1])
    pretrain_loop.pretrain(tiny(tmp_path / "cache"), remote, stop_after=3, devices=jax.devices()[:1])
    assert workdir_lib.checkpoint_steps(remote) == [3]
    resumed = tiny(tmp_path / "cache", **{"train.profile_steps": "5,5"})   # and a trace of step 5 into the bucket
    pretrain_loop.pretrain(resumed, remote, devices=jax.devices()[:1])
    assert workdir_lib.checkpoint_steps(remote) == [3, 6]
    traces = files.mirror(remote + "/profile", str(tmp_path / "profile"))     # staged locally, uploaded by gcsfs
    assert glob.glob(os.path.join(traces, "plugins", "profile", "*", "*.xplane.pb"))
    local, bucket = params_of(str(tmp_path / "local")), params_of(remote)
    for a, b in zip(jax.tree_util.tree_leaves(local), jax.tree_util.tree_leaves(bucket)):
        np.testing.assert_array_equal(a, b)
    assert [r["loss"] for r in read_metrics(remote) if "loss" in r] == \
        [r["loss"] for r in read_metrics(str(tmp_path / "local")) if "loss" in r]
    assert {"config.json", "metrics.jsonl", "checkpoints", "tokenizer", "tensorboard"} <= set(files.listdir(remote))
    assert not os.path.exists(tmp_path / "gs:") and not files.exists(remote + "/.lock")

    # the run in the bucket is read by evaluate, a fine-tune's init_from and the analyses (outputs to the bucket)
    from tupe_jax.analysis import extrapolate, probe  # pylint: disable=import-outside-toplevel
    from tupe_jax.finetune import loop as ft_loop  # pylint: disable=import-outside-toplevel
    from tupe_jax.pretrain.evaluate import evaluate  # pylint: disable=import-outside-toplevel
    metrics_before = files.read_text(remote + "/metrics.jsonl")
    files.write_text(remote + "/.lock", json.dumps({"pid": 7, "host": "h", "started": "s", "command": "c",
                                                   "heartbeat": time.time()}))     # a run live in the folder
    assert evaluate(remote)["eval_loss"] > 0
    assert files.read_text(remote + "/metrics.jsonl") == metrics_before
    assert f"{remote}: this row is not added to metrics.jsonl: {remote} is in use by process 7 on h" in \
        capsys.readouterr().out
    files.remove(remote + "/.lock")
    assert evaluate(remote)["eval_loss"] > 0
    assert [r.get("split") for r in read_metrics(remote)][-1] == "validation"
    glue = config_lib.load_config(os.path.join(ROOT, "configs", "glue.py") + ":task=wordorder,pe=tupe_r")
    config_lib.apply_overrides(glue, {**{k: v for k, v in TINY.items() if k.startswith("model.")},
                                      "train.steps": "2", "train.batch_size": "8", "train.eval_batch_size": "8",
                                      "train.predict_test": "false", "checkpoint.async_save": "false"})
    with glue.unlocked():
        glue.data.cache_dir, glue.init_from = str(tmp_path / "cache"), remote
    result = ft_loop.finetune(glue, f"gs://{BUCKET}/ft", devices=jax.devices()[:1])
    assert result["init_from"] == remote and files.isfile(f"gs://{BUCKET}/ft/results.json")
    assert files.read_text(f"gs://{BUCKET}/ft/tokenizer/vocab.txt") == files.read_text(remote + "/tokenizer/vocab.txt")
    extrapolate.run(remote, [16, 32])
    probe.run(remote, steps=2)
    assert {"extrapolation.json", "extrapolation.png", "probe.json", "probe.png"} <= set(files.listdir(remote +
                                                                                                  "/analysis"))
    assert not os.path.exists(tmp_path / "gs:")


def test_bucket_errors_are_one_line_before_compute(gcs, tmp_path):  # noqa: F811
    with pytest.raises(UserError, match=r"bucket gs://no-such-bucket does not exist"):
        workdir_lib.check_folder("gs://no-such-bucket/run")
    saved = os.environ["STORAGE_EMULATOR_HOST"]
    os.environ["STORAGE_EMULATOR_HOST"] = "http://127.0.0.1:9"      # nothing listens there
    try:
        with pytest.raises(UserError, match=r"cannot reach the storage of gs://"):
            workdir_lib.check_folder(f"gs://{BUCKET}/other")
    finally:
        os.environ["STORAGE_EMULATOR_HOST"] = saved


LEASER = r'''
import sys, time
from tupe_jax.workdir import RunLock
with RunLock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(600)
'''


def test_the_bucket_lease_refuses_a_second_process_and_a_stale_lease_is_taken_over(gcs):  # noqa: F811
    import json  # pylint: disable=import-outside-toplevel
    import subprocess  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel
    import time  # pylint: disable=import-outside-toplevel
    folder = f"gs://{BUCKET}/leased"
    holder = subprocess.Popen([sys.executable, "-c", LEASER, folder], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(UserError) as info:
            with workdir_lib.RunLock(folder):
                pass
        assert f"is in use by process {holder.pid}" in str(info.value) and "heartbeat" in str(info.value)
        with pytest.raises(UserError, match=f"is in use by process {holder.pid}.*heartbeat"):
            workdir_lib.refuse_if_held(folder)         # the read-only check before the gate
    finally:
        holder.kill()                                  # a hard kill leaves a fresh-looking lease behind
        holder.wait()
    lease = json.loads(files.read_text(folder + "/.lock"))
    lease["heartbeat"] = time.time() - 301             # ... until it is older than LEASE_SECONDS
    files.write_text(folder + "/.lock", json.dumps(lease))
    workdir_lib.refuse_if_held(folder)                 # a stale lease is no refusal ...
    assert json.loads(files.read_text(folder + "/.lock")) == lease      # ... and the check writes nothing
    with workdir_lib.RunLock(folder) as lock:
        assert lock.taken_over and str(holder.pid) in lock.taken_over
        assert json.loads(files.read_text(folder + "/.lock"))["pid"] == os.getpid()
    assert not files.exists(folder + "/.lock")


def test_of_two_commands_that_both_saw_a_bucket_folder_free_only_one_gets_the_lease(gcs, monkeypatch):  # noqa: F811
    folder = f"gs://{BUCKET}/raced"
    other = {"pid": 7, "host": "h", "started": "s", "command": "c", "heartbeat": time.time()}
    lock_module = importlib.import_module("tupe_jax.workdir.lock")
    saw_it_free = lock_module._stale_lease          # pylint: disable=protected-access

    def then_the_other_took_it(workdir, path):      # our check found no lease; the other command writes one now
        found = saw_it_free(workdir, path)
        files.write_text(path, json.dumps(other))
        return found
    monkeypatch.setattr(lock_module, "_stale_lease", then_the_other_took_it)
    with pytest.raises(UserError, match=f"^error: {folder} is in use by process 7 on h .*heartbeat"):
        with workdir_lib.RunLock(folder):
            pytest.fail("both commands hold the folder")
    assert json.loads(files.read_text(folder + "/.lock")) == other       # the other's lease is untouched


def test_of_two_commands_that_both_saw_the_same_stale_lease_only_one_takes_it_over(gcs, monkeypatch):  # noqa: F811
    folder = f"gs://{BUCKET}/raced-stale"
    dead = {"pid": 5, "host": "gone", "started": "s", "command": "c", "heartbeat": time.time() - 3600}
    other = {"pid": 7, "host": "h", "started": "s", "command": "c", "heartbeat": time.time()}
    files.write_text(folder + "/.lock", json.dumps(dead))
    lock_module = importlib.import_module("tupe_jax.workdir.lock")
    saw_it_stale = lock_module._stale_lease         # pylint: disable=protected-access

    def then_the_other_took_it_over(workdir, path):  # we found the dead run's lease; the other command takes it now
        found = saw_it_stale(workdir, path)
        files.write_text(path, json.dumps(other))
        return found
    monkeypatch.setattr(lock_module, "_stale_lease", then_the_other_took_it_over)
    with pytest.raises(UserError, match=f"^error: {folder} is in use by process 7 on h .*heartbeat"):
        with workdir_lib.RunLock(folder):
            pytest.fail("both commands took the dead run's folder over")
    assert json.loads(files.read_text(folder + "/.lock")) == other       # the winner's lease is untouched


def test_a_holder_taken_for_dead_stops_its_heartbeat_and_leaves_the_new_lease(gcs, monkeypatch, capsys):  # noqa: F811
    """A run that went LEASE_SECONDS without a heartbeat (a stalled VM) and was taken over: its next heartbeat is
    refused, it says so, and neither a heartbeat nor its release overwrites or deletes the new holder's lease."""
    folder = f"gs://{BUCKET}/taken-from-a-live-run"
    lock_module = importlib.import_module("tupe_jax.workdir.lock")
    monkeypatch.setattr(lock_module, "LEASE_SECONDS", 0.4)          # a heartbeat every 0.1 s
    other = {"pid": 7, "host": "h", "started": "s", "command": "c", "heartbeat": time.time()}
    with workdir_lib.RunLock(folder):
        time.sleep(0.3)                                             # our heartbeats land
        assert json.loads(files.read_text(folder + "/.lock"))["pid"] == os.getpid()
        files.write_text(folder + "/.lock", json.dumps(other))      # another command takes the folder over
        time.sleep(0.5)                                             # our next heartbeats find the lease changed
        assert json.loads(files.read_text(folder + "/.lock")) == other
    assert json.loads(files.read_text(folder + "/.lock")) == other  # the release left it alone
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "lease was taken over by process 7 on h" in lines[0], lines


def test_a_run_whose_lease_was_taken_over_stops_before_its_next_checkpoint(gcs, tmp_path, monkeypatch):  # noqa: F811
    """A run taken for dead (a stalled VM) that trains on: before its next checkpoint it reads the lease, finds it
    another's (long before its heartbeat thread would look) and stops with one line. It writes no checkpoint after
    the takeover, leaves the new holder's lease alone and removes nothing from the folder, now the other's."""
    from tupe_jax import metrics as metrics_lib  # pylint: disable=import-outside-toplevel
    monkeypatch.chdir(tmp_path)
    remote = f"gs://{BUCKET}/taken-mid-run"
    other = {"pid": 7, "host": "h", "started": "s", "command": "c", "heartbeat": time.time()}
    write = metrics_lib.MetricsWriter.write

    def taken_over_after_step_2(self, step, values):
        write(self, step, values)
        if step == 2:                                        # another command takes the folder over mid-run
            files.write_text(remote + "/.lock", json.dumps(other))
    monkeypatch.setattr(metrics_lib.MetricsWriter, "write", taken_over_after_step_2)
    with pytest.raises(workdir_lib.LeaseLost) as caught:
        pretrain_loop.pretrain(tiny(tmp_path / "cache"), remote, devices=jax.devices()[:1])
    assert str(caught.value).startswith(f"error: this run's lease on {remote} was taken over by process 7 on h")
    assert "\n" not in str(caught.value)
    assert workdir_lib.checkpoint_steps(remote) == []               # step 3's checkpoint was not written
    assert json.loads(files.read_text(remote + "/.lock")) == other  # the release left the new lease alone
    assert {"config.json", "tokenizer"} <= set(files.listdir(remote))   # a failed run's cleanup did not run


def test_metrics_stop_reaching_a_bucket_folder_the_run_no_longer_holds(gcs, capsys):  # noqa: F811
    """A bucket's metrics.jsonl is rewritten whole at each flush: once the run's lease is another launch's
    (`owns_folder` False), the writer drops its rows with one line and neither rewrites that launch's metrics nor
    uploads TensorBoard events."""
    from tupe_jax.metrics import MetricsWriter  # pylint: disable=import-outside-toplevel
    folder = f"gs://{BUCKET}/metrics-after-takeover"
    ours = [True]
    writer = MetricsWriter(folder, enabled=True, flush_secs=0, owns_folder=lambda: ours[0])
    writer.write(1, {"loss": 1.0})
    assert [r["step"] for r in read_metrics(folder)] == [1]
    theirs = json.dumps({"step": 9, "loss": 0.5}) + "\n"
    files.write_text(folder + "/metrics.jsonl", theirs)               # the new holder's metrics
    ours[0] = False
    writer.write(2, {"loss": 0.9})
    writer.flush()
    writer.write(3, {"loss": 0.8})
    writer.close()
    assert files.read_text(folder + "/metrics.jsonl") == theirs
    assert not files.exists(folder + "/tensorboard")
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "this run no longer holds its folder" in lines[0], lines


def test_a_heartbeat_that_meets_a_storage_error_tries_again(gcs, monkeypatch, capsys):  # noqa: F811
    """A renewal that fails (the endpoint unreachable past the client's retries) is reported and retried at the
    next beat: a heartbeat thread that died would let the lease expire under a live run."""
    folder = f"gs://{BUCKET}/flaky-endpoint"
    lock_module = importlib.import_module("tupe_jax.workdir.lock")
    monkeypatch.setattr(lock_module, "LEASE_SECONDS", 0.4)
    write_object, calls = files.write_object, []

    def second_write_fails(path, text, generation):
        calls.append(text)
        if len(calls) == 2:
            raise ConnectionError("connection reset by peer")
        return write_object(path, text, generation)
    monkeypatch.setattr(files, "write_object", second_write_fails)
    with workdir_lib.RunLock(folder):
        time.sleep(0.5)
        assert len(calls) >= 4                                      # it went on renewing after the failure
        assert json.loads(files.read_text(folder + "/.lock"))["pid"] == os.getpid()
    assert not files.exists(folder + "/.lock")
    err = capsys.readouterr().err
    assert "renewing the lease failed (ConnectionError: connection reset by peer)" in err and "error:" not in err


def test_a_heartbeat_whose_reply_was_lost_keeps_the_lease(gcs, monkeypatch, capsys):  # noqa: F811
    """A heartbeat upload that landed but whose reply was lost is retried by the client and refused (the lease is
    no longer at the generation it was conditioned on): the holder finds its own text there and keeps beating."""
    folder = f"gs://{BUCKET}/lost-reply"
    lock_module = importlib.import_module("tupe_jax.workdir.lock")
    monkeypatch.setattr(lock_module, "LEASE_SECONDS", 0.4)
    write_object, calls = files.write_object, []

    def first_heartbeat_loses_its_reply(path, text, generation):
        calls.append(text)
        new = write_object(path, text, generation)
        if len(calls) == 2:                                         # the lease's creation is call 1
            raise FileExistsError(path)
        return new
    monkeypatch.setattr(files, "write_object", first_heartbeat_loses_its_reply)
    with workdir_lib.RunLock(folder):
        time.sleep(0.5)
        assert len(calls) >= 4                                      # it kept beating after the lost reply
        assert json.loads(files.read_text(folder + "/.lock"))["pid"] == os.getpid()
    assert not files.exists(folder + "/.lock")                      # and released its own lease
    assert "error:" not in capsys.readouterr().err


@pytest.mark.slow
def test_kill_9_in_a_bucket_then_a_damaged_latest_checkpoint_falls_back_and_resumes_bitwise(gcs, tmp_path):  # noqa: F811
    """`launch pretrain --workdir=gs://...` killed with SIGKILL mid-run; its newest checkpoint is then damaged (an
    object of its state removed). The same command warns, restores the previous good step from the bucket and
    ends bitwise equal to an uninterrupted local run."""
    import signal  # pylint: disable=import-outside-toplevel
    import subprocess  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel
    remote = f"gs://{BUCKET}/killed"
    flags = [f"--config.{k}={v}" for k, v in {**TINY, "train.steps": "12"}.items()] + \
        [f"--config.data.cache_dir={tmp_path / 'cache'}"]
    argv = [sys.executable, "-m", "launch", "pretrain", "--config=configs/pretrain.py:pe=tupe_r", *flags]
    env = {**os.environ, "XLA_FLAGS": xla_flags.devices(1), "TUPE_JAX_LEASE_SECONDS": "4"}
    subprocess.run(argv + [f"--workdir={tmp_path / 'local'}"], cwd=ROOT, env=env, check=True, capture_output=True,
                   timeout=600)
    child = subprocess.Popen(argv + [f"--workdir={remote}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        for line in child.stdout:
            if line.startswith("step 8/"):
                break
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    steps = workdir_lib.checkpoint_steps(remote)
    assert steps[-1] >= 6, steps
    state = f"{remote}/checkpoints/{steps[-1]}/state"
    for name in files.listdir(state):                 # the array data and index of the state: unrestorable
        if name.startswith(("ocdbt", "manifest", "d")):
            files.rmtree(f"{state}/{name}") if files.isdir(f"{state}/{name}") else files.remove(f"{state}/{name}")
    import time  # pylint: disable=import-outside-toplevel
    time.sleep(5)                                     # the killed run's lease (4 s in this test) runs out
    resumed = subprocess.run(argv + [f"--workdir={remote}"], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"checkpoint step {steps[-1]}" in resumed.stderr and "trying the previous one" in resumed.stderr, \
        resumed.stderr[-3000:]
    assert "taking over the lease" in resumed.stderr
    local, bucket = params_of(str(tmp_path / "local")), params_of(remote)
    for a, b in zip(jax.tree_util.tree_leaves(local), jax.tree_util.tree_leaves(bucket)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_two_processes_write_one_run_to_the_bucket(gcs, tmp_path):  # noqa: F811
    """Two jax.distributed processes (gloo) on one gs:// folder: one config.json, one metrics stream with each
    step once, one checkpoint directory per saved step; the losses are the one-process run's."""
    import subprocess  # pylint: disable=import-outside-toplevel
    from tests import test_multiprocess as mp  # pylint: disable=import-outside-toplevel
    remote = f"gs://{BUCKET}/two"
    extra = ["--config.checkpoint.every=2"]
    single = subprocess.run(mp.command(tmp_path / "single", tmp_path / "cache", extra), cwd=ROOT, env=mp.env(4),
                            capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr[-3000:]
    port = mp.free_port()
    procs = [subprocess.Popen(mp.command(remote, tmp_path / "cache", extra + [
        f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", f"--process_id={i}"]),
        cwd=ROOT, env=mp.env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    rows = read_metrics(remote, raw=True)
    steps = [r["step"] for r in rows if "loss" in r]
    assert steps == [1, 2, 3, 4, 5]
    one = [m["loss"] for m in read_metrics(str(tmp_path / "single")) if "loss" in m]
    np.testing.assert_allclose([r["loss"] for r in rows if "loss" in r], one, atol=1e-5, rtol=0)
    assert workdir_lib.checkpoint_steps(remote) == [2, 4, 5]
    assert sorted(files.listdir(remote + "/checkpoints")) == ["2", "4", "5"]
    assert [n for n in files.listdir(remote) if n.startswith("config")] == ["config.json"]


def test_text_files_and_glue_tsvs_can_live_in_a_bucket(gcs, tmp_path):  # noqa: F811
    """data.path and data.glue_dir accept gs://: the same documents and examples as from the local copy."""
    from tests.glue_fixtures import write_glue_dir  # pylint: disable=import-outside-toplevel
    from tupe_jax import data as data_lib  # pylint: disable=import-outside-toplevel
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "train.txt").write_text("the cat sat on the mat\nit was warm\n\nthe dog ran away\n")
    (corpus / "valid.txt").write_text("a bird sang\n\nthe end\n")
    write_glue_dir(str(tmp_path / "glue"))
    for local in [*corpus.iterdir(), *(tmp_path / "glue").rglob("*.tsv")]:
        files.upload(str(local), f"gs://{BUCKET}/inputs/{local.relative_to(tmp_path)}")

    def documents(path, cache):
        config = tiny(cache, **{"data.name": "text_files", "data.path": path})
        return [data_lib.load_documents(config, split) for split in ("train", "validation")]

    def examples(glue_dir, cache):
        config = config_lib.load_config(os.path.join(ROOT, "configs", "glue.py") + ":task=rte")
        with config.unlocked():
            config.data.glue_dir, config.data.cache_dir = glue_dir, str(cache)
        return [data_lib.glue_examples(config, "rte", split) for split in ("train", "validation", "test")]

    assert documents(f"gs://{BUCKET}/inputs/corpus", tmp_path / "c1") == documents(str(corpus), tmp_path / "c2")
    assert examples(f"gs://{BUCKET}/inputs/glue", tmp_path / "c1") == examples(str(tmp_path / "glue"), tmp_path / "c2")
    with pytest.raises(UserError, match=r"nothing at gs://tupe-test/nope, --config.data.path"):
        documents(f"gs://{BUCKET}/nope", tmp_path / "c1")


@pytest.mark.parametrize("where,needle", [("gs://no-such-bucket/run", "bucket gs://no-such-bucket does not exist"),
                                          ("unreachable", "cannot reach the storage of gs://tupe-test")])
def test_bucket_errors_through_the_launcher_are_one_line(gcs, tmp_path, where, needle):  # noqa: F811
    import subprocess  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel
    env = dict(os.environ)
    workdir = where
    if where == "unreachable":
        env["STORAGE_EMULATOR_HOST"], workdir = "http://127.0.0.1:9", f"gs://{BUCKET}/run"
    proc = subprocess.run([sys.executable, "-m", "launch", "pretrain", "--config=configs/pretrain.py:pe=tupe_r",
                           f"--workdir={workdir}", f"--config.data.cache_dir={tmp_path / 'cache'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], \
        proc.stderr[-2000:]
    assert not (tmp_path / "cache").exists()            # refused before any data was touched
