"""Run folders in a bucket (`--workdir=gs://...`) against a real GCS endpoint (the emulator of gcs_fixtures)."""
import os

import jax
import numpy as np
import pytest

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


def test_a_bucket_run_matches_a_local_run_and_resumes(gcs, tmp_path, monkeypatch):  # noqa: F811
    """pretrain into gs://, stopped after 3 steps (as preempted) and resumed from the bucket: losses and final
    parameters equal an uninterrupted local run bitwise; nothing is written to a local `gs:` folder."""
    monkeypatch.chdir(tmp_path)
    remote = f"gs://{BUCKET}/run"
    pretrain_loop.pretrain(tiny(tmp_path / "cache"), str(tmp_path / "local"), devices=jax.devices()[:1])
    pretrain_loop.pretrain(tiny(tmp_path / "cache"), remote, stop_after=3, devices=jax.devices()[:1])
    assert workdir_lib.checkpoint_steps(remote) == [3]
    pretrain_loop.pretrain(tiny(tmp_path / "cache"), remote, devices=jax.devices()[:1])
    assert workdir_lib.checkpoint_steps(remote) == [3, 6]
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
    assert evaluate(remote)["eval_loss"] > 0
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
    finally:
        holder.kill()                                  # a hard kill leaves a fresh-looking lease behind
        holder.wait()
    lease = json.loads(files.read_text(folder + "/.lock"))
    lease["heartbeat"] = time.time() - 301             # ... until it is older than LEASE_SECONDS
    files.write_text(folder + "/.lock", json.dumps(lease))
    with workdir_lib.RunLock(folder) as lock:
        assert lock.taken_over and str(holder.pid) in lock.taken_over
        assert json.loads(files.read_text(folder + "/.lock"))["pid"] == os.getpid()
    assert not files.exists(folder + "/.lock")
