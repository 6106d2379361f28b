"""Run folders in a bucket (`--workdir=gs://...`) against a real GCS endpoint (the emulator of gcs_fixtures); the
bucket lease: test_gcs_lease.py."""
import glob
import json
import os
import tempfile
import time

import jax
import numpy as np
import pytest

from tests import xla_flags
from tests.gcs_fixtures import BUCKET, ROOT, TINY, tiny
from tupe_jax import config as config_lib
from tupe_jax import files
from tupe_jax import workdir as workdir_lib
from tupe_jax.errors import UserError
from tupe_jax.metrics import read_metrics
from tupe_jax.pretrain import loop as pretrain_loop


def params_of(workdir):
    return jax.tree_util.tree_map(np.asarray, workdir_lib.load_run(workdir).params)


def test_a_bucket_run_matches_a_local_run_and_resumes(gcs, tmp_path, monkeypatch, capsys):
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


def test_bucket_errors_are_one_line_before_compute(gcs, tmp_path):
    with pytest.raises(UserError, match=r"bucket gs://no-such-bucket does not exist"):
        workdir_lib.check_folder("gs://no-such-bucket/run")
    saved = os.environ["STORAGE_EMULATOR_HOST"]
    os.environ["STORAGE_EMULATOR_HOST"] = "http://127.0.0.1:9"      # nothing listens there
    try:
        with pytest.raises(UserError, match=r"cannot reach the storage of gs://"):
            workdir_lib.check_folder(f"gs://{BUCKET}/other")
        from tupe_jax.interop.export import export  # pylint: disable=import-outside-toplevel
        with pytest.raises(UserError, match=r"cannot reach the storage of gs://.*, --workdir"):   # an unexpected
            export(f"gs://{BUCKET}/other", str(tmp_path / "out"))      # DNS error after 50 s of retries before
    finally:
        os.environ["STORAGE_EMULATOR_HOST"] = saved


@pytest.mark.slow
def test_kill_9_in_a_bucket_then_a_damaged_latest_checkpoint_falls_back_and_resumes_bitwise(gcs, tmp_path):
    """`launch pretrain --workdir=gs://...` killed with SIGKILL mid-run; its newest checkpoint is then damaged (an
    object of its state removed). The same command warns, restores the previous good step from the bucket and
    ends bitwise equal to an uninterrupted local run. The killed process's local staging folder of TensorBoard
    events is removed by the resumed one (tupe_jax/local_staging.py)."""
    import signal  # pylint: disable=import-outside-toplevel
    import subprocess  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel
    remote = f"gs://{BUCKET}/killed"
    flags = [f"--config.{k}={v}" for k, v in {**TINY, "train.steps": "12"}.items()] + \
        [f"--config.data.cache_dir={tmp_path / 'cache'}"]
    argv = [sys.executable, "-m", "launch", "pretrain", "--config=configs/pretrain.py:pe=tupe_r", *flags]
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "XLA_FLAGS": xla_flags.devices(1), "TUPE_JAX_LEASE_SECONDS": "4", "TMPDIR": str(tmp)}
    staged = lambda: sorted(n for n in os.listdir(tmp) if n.startswith("tupe-jax-"))  # noqa: E731
    child = subprocess.Popen(argv + [f"--workdir={remote}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        for line in child.stdout:
            if line.startswith("step 8/"):
                break
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    killed_at = time.time()
    left = staged()
    assert len(left) == 2 and left[0].startswith("tupe-jax-tb-") and left[1] == left[0] + ".owner", left
    steps = workdir_lib.checkpoint_steps(remote)
    assert steps[-1] >= 6, steps
    state = f"{remote}/checkpoints/{steps[-1]}/state"
    for name in files.listdir(state):                 # the array data and index of the state: unrestorable
        if name.startswith(("ocdbt", "manifest", "d")):
            files.rmtree(f"{state}/{name}") if files.isdir(f"{state}/{name}") else files.remove(f"{state}/{name}")
    # the uninterrupted local run, made while the killed run's lease (4 s in this test) runs out
    subprocess.run(argv + [f"--workdir={tmp_path / 'local'}"], cwd=ROOT, env=env, check=True, capture_output=True,
                   timeout=600)
    time.sleep(max(0.0, 5 - (time.time() - killed_at)))
    resumed = subprocess.run(argv + [f"--workdir={remote}"], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"checkpoint step {steps[-1]}" in resumed.stderr and "trying the previous one" in resumed.stderr, \
        resumed.stderr[-3000:]
    assert "taking over the lease" in resumed.stderr
    assert staged() == []
    local, bucket = params_of(str(tmp_path / "local")), params_of(remote)
    for a, b in zip(jax.tree_util.tree_leaves(local), jax.tree_util.tree_leaves(bucket)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_two_processes_write_one_run_to_the_bucket(gcs, tmp_path):
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


def test_text_files_and_glue_tsvs_can_live_in_a_bucket(gcs, tmp_path):
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


def test_export_to_a_bucket_folder_writes_the_local_exports_files(gcs, tmp_path, monkeypatch):
    """`export --out=gs://...`: the files of a local export of the same run; an existing bucket folder
    and a missing bucket are refused in one line; an upload that fails leaves no folder in the bucket and no local
    copy behind."""
    from etils import epath  # pylint: disable=import-outside-toplevel
    from tests.glue_fixtures import make_pretrained  # pylint: disable=import-outside-toplevel
    from tupe_jax.interop import export as export_lib  # pylint: disable=import-outside-toplevel
    run = tmp_path / "run"
    make_pretrained(str(run), str(tmp_path / "cache"))
    (tmp_path / "local").mkdir()
    local = export_lib.export(str(run), str(tmp_path / "local" / "model"))
    remote = export_lib.export(str(run), f"gs://{BUCKET}/exports/model/")
    assert remote == f"gs://{BUCKET}/exports/model"
    assert sorted(files.listdir(remote)) == sorted(os.listdir(local))
    for name in os.listdir(local):        # byte for byte (the safetensors header too: its metadata has one key)
        ours, theirs = epath.Path(f"{remote}/{name}").read_bytes(), (tmp_path / "local" / "model" / name).read_bytes()
        assert ours == theirs, name
    with pytest.raises(UserError, match=f"^error: {remote} already exists, --out, give a new folder"):
        export_lib.export(str(run), remote)
    with pytest.raises(UserError, match="^error: bucket gs://no-such-bucket does not exist .*, --out, "):
        export_lib.export(str(run), "gs://no-such-bucket/model")

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))      # where the local copy is staged
    (tmp_path / "tmp").mkdir()
    upload, sent = files.upload, []

    def fails_third(src, dst):
        if len(sent) == 2:
            raise OSError("connection reset")
        sent.append(dst)
        upload(src, dst)
    monkeypatch.setattr(files, "upload", fails_third)
    with pytest.raises(OSError, match="connection reset"):
        export_lib.export(str(run), f"gs://{BUCKET}/exports/broken")
    assert len(sent) == 2 and not any(s.endswith("config.json") for s in sent)   # config.json goes last
    assert not files.exists(f"gs://{BUCKET}/exports/broken") and os.listdir(tmp_path / "tmp") == []


@pytest.mark.parametrize("where,needle", [("gs://no-such-bucket/run", "bucket gs://no-such-bucket does not exist"),
                                          ("unreachable", "cannot reach the storage of gs://tupe-test")])
def test_bucket_errors_through_the_launcher_are_one_line(gcs, tmp_path, where, needle):
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
