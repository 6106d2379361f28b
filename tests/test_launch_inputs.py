"""The launcher's inputs beyond the one-line errors of the catalogue: `~` in path flags, the multi-process flags JAX
would refuse late, a warning printed once, a finished run left as it is, a cudnn run read off a GPU, and an export
into a folder that does not exist yet."""
import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

import launch
from glue_fixtures import load_config_module, make_pretrained
from tests import xla_flags
from tupe_jax import workdir as workdir_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRETRAIN = "--config=" + os.path.join(ROOT, "configs", "pretrain.py") + ":pe=tupe_r,size=tiny"
TINY = ["--config.model.num_layers=2", "--config.model.hidden_size=32", "--config.model.num_heads=2",
        "--config.model.mlp_dim=64", "--config.model.vocab_size=512", "--config.model.max_len=32",
        "--config.train.batch_size=16", "--config.checkpoint.async_save=false"]


def _tree(path) -> dict:
    return {os.path.relpath(os.path.join(r, n), path): hashlib.sha1(open(os.path.join(r, n), "rb").read()).hexdigest()
            for r, _, names in os.walk(path) for n in names}


def test_a_tilde_in_workdir_is_the_home_folder(tmp_path, monkeypatch, capsys):
    """bash leaves `--workdir=~/x` as it is: the launcher expands it as it does for --out, --from and data paths
    (before, a pretraining run went to a folder named `~` in the current directory)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert launch.main(["evaluate", "--workdir=~/nothing"]) == 2
    assert f"{tmp_path}/home/nothing/config.json does not exist" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "~")


def test_num_processes_without_a_coordinator_is_one_line_before_the_folder_is_touched(tmp_path):
    """jax.distributed.initialize's own ValueError (no cluster to detect) was an 'unexpected' crash with a log
    written into the workdir; in a fresh process (JAX not started) it is one line and the folder is unchanged."""
    (tmp_path / "run").mkdir()
    env = dict(os.environ, XLA_FLAGS=xla_flags.devices(8), JAX_PLATFORMS="cpu")
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "TPU_WORKER_HOSTNAMES"):
        env.pop(name, None)
    result = subprocess.run([sys.executable, "-m", "launch", "pretrain", PRETRAIN, f"--workdir={tmp_path / 'run'}",
                             "--num_processes=2", "--process_id=0"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 2, result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("error: jax.distributed.initialize:") and "--coordinator_address" in lines[-1]
    assert os.listdir(tmp_path / "run") == []


def test_the_warmup_warning_is_printed_once_per_process(capsys):
    """The launcher, the loop and a suite each validate the same config: one warning, not two or three."""
    from configs import pretrain as pretrain_config  # pylint: disable=import-outside-toplevel
    from tupe_jax.pretrain.validate import validate  # pylint: disable=import-outside-toplevel
    config = pretrain_config.get_config("pe=tupe_r,size=tiny")
    config.train.steps, config.train.warmup_steps = 7, 123   # a warning no other test prints first
    for _ in range(3):
        validate(config, 8)
    assert capsys.readouterr().out.count("train.warmup_steps = 123 is longer") == 1


def test_rerunning_a_finished_run_writes_nothing(tmp_path, capsys):
    """It said 'resumed', appended a 'resumed' row to metrics.jsonl and made a new TensorBoard file; now it says
    there is nothing to train and leaves every file but the provenance log as it was."""
    argv = ["pretrain", PRETRAIN, f"--workdir={tmp_path / 'run'}", "--config.train.steps=2",
            f"--config.data.cache_dir={tmp_path / 'cache'}", *TINY]
    assert launch.main(argv) == 0
    before = _tree(tmp_path / "run")
    capsys.readouterr()
    assert launch.main(argv) == 0
    assert "is at step 2 (train.steps = 2): nothing to train" in capsys.readouterr().out
    after = _tree(tmp_path / "run")
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    assert changed == ["provenance.jsonl"], changed


def test_a_cudnn_run_is_read_with_xla_off_a_gpu(tmp_path, capsys):
    """A run trained with attention_backend=cudnn on a GPU: evaluate/export/the analyses elsewhere read it with the
    xla implementation (the same maths) and say so, instead of failing in jax ('cuDNN is not detected')."""
    make_pretrained(tmp_path / "run", tmp_path / "cache", pe="alibi")
    path = tmp_path / "run" / "config.json"
    config = json.loads(path.read_text())
    config["model"]["attention_backend"] = "cudnn"
    path.write_text(json.dumps(config, indent=2))
    run = workdir_lib.load_run(str(tmp_path / "run"))
    assert run.model_cfg.attention_backend == "xla"
    assert "attention_backend=cudnn needs a GPU; reading it with xla" in capsys.readouterr().out
    assert launch.main(["evaluate", f"--workdir={tmp_path / 'run'}"]) == 0


def test_export_makes_the_parent_folder_and_its_readme_names_the_export(tmp_path):
    """README's `export --out=exports/x` failed in a checkout without exports/; the export's README gave import-hf
    the folder's name as if it were its path."""
    make_pretrained(tmp_path / "run", tmp_path / "cache", pe="tupe_r")
    out = tmp_path / "exports" / "deeper" / "x"
    assert launch.main(["export", f"--workdir={tmp_path / 'run'}", f"--out={out}"]) == 0
    assert "import-hf --from=DIR --workdir=runs/x     # DIR: this folder" in (out / "README.md").read_text()
    assert launch.main(["import-hf", f"--from={out}", f"--workdir={tmp_path / 'back'}"]) == 0
    rows = [json.loads(r) for r in (tmp_path / "back" / "provenance.jsonl").read_text().splitlines()]
    assert len(rows) == 1   # the import is recorded as every command that makes a run folder
    shutil.rmtree(tmp_path / "exports")
    (tmp_path / "exports").write_text("a file")   # where a parent folder would go: one line, nothing written
    assert launch.main(["export", f"--workdir={tmp_path / 'run'}", f"--out={tmp_path / 'exports' / 'a' / 'x'}"]) == 2
    assert (tmp_path / "exports").read_text() == "a file"


def test_an_output_folder_a_suite_report_embeds_is_refused_and_its_runs_folders_are_not(tmp_path):
    """`--out` into a suite's seed<k>/ replaced the files its REPORT.md shows; the first version of the check also
    refused the suite's own run folders (the default place of their analyses) and any folder beside them."""
    import pytest  # pylint: disable=import-outside-toplevel
    from tupe_jax.errors import UserError  # pylint: disable=import-outside-toplevel
    from tupe_jax.workdir.gate import refuse_inside_suite  # pylint: disable=import-outside-toplevel
    suite = tmp_path / "suite"
    (suite / "alibi-clm-s0").mkdir(parents=True)
    (suite / "config.json").write_text(json.dumps({"suite": "extrapolation"}))
    (suite / "alibi-clm-s0" / "config.json").write_text(json.dumps({"model": {}}))
    for owned in ("", "seed0", "glue", "glue/alibi-clm-s0"):
        with pytest.raises(UserError, match=r"the compare suite folder .*suite, whose report embeds the files there"):
            refuse_inside_suite(str(suite / owned), "--out")
    for free in ("alibi-clm-s0/analysis", "my-analysis", "alibi-clm-s0/x/y", "seed0x"):
        refuse_inside_suite(str(suite / free), "--out")


def _flags(**given):
    import argparse  # pylint: disable=import-outside-toplevel
    return argparse.Namespace(**{"distributed": "auto", "num_processes": None, "process_id": None,
                                 "coordinator_address": None, **given})


def test_auto_starts_jax_distributed_on_a_cloud_tpu_vm_and_nowhere_else(monkeypatch):
    """A pod slice made with `gcloud compute tpus tpu-vm create` sets no TPU_WORKER_HOSTNAMES (JAX reads the workers
    from the VM's metadata server), so `--distributed=auto` never started jax.distributed there."""
    import jax  # pylint: disable=import-outside-toplevel
    from launch import cluster  # pylint: disable=import-outside-toplevel
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: calls.append(kwargs))
    monkeypatch.delenv("TPU_WORKER_HOSTNAMES", raising=False)
    for chips, distributed, started in [(0, "auto", False), (4, "auto", True), (4, "off", False), (0, "on", True)]:
        calls.clear()
        monkeypatch.setattr(cluster, "tpu_chips", lambda chips=chips: chips)
        cluster.maybe_initialize_distributed(_flags(distributed=distributed))
        assert calls == ([{}] if started else []), (chips, distributed)


def test_tpu_chips_count_where_jax_would_take_the_machine_for_a_tpu_vm(monkeypatch):
    import importlib.util  # pylint: disable=import-outside-toplevel
    from jax._src import hardware_utils  # pylint: disable=import-outside-toplevel
    from launch import cluster  # pylint: disable=import-outside-toplevel
    assert cluster.tpu_chips() == hardware_utils.num_available_tpu_chips_and_device_id()[0] == 0   # a CPU machine
    monkeypatch.setattr(hardware_utils, "num_available_tpu_chips_and_device_id", lambda: (4, "v4"))
    real = importlib.util.find_spec
    for name in ("TPU_SKIP_MDS_QUERY", "TPU_VISIBLE_CHIPS", "TPU_PROCESS_BOUNDS"):
        monkeypatch.delenv(name, raising=False)
    assert cluster.tpu_chips() == 0 or real("libtpu") is not None            # chips, but no libtpu: not a TPU VM
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "libtpu" else real(name, *a))
    assert cluster.tpu_chips() == 4
    monkeypatch.setenv("TPU_VISIBLE_CHIPS", "0,1")        # one of several processes sharing the VM's chips
    assert cluster.tpu_chips() == 0


def test_a_tpu_vm_whose_slice_jax_cannot_read_runs_as_one_process_with_a_warning(monkeypatch, capsys):
    import jax  # pylint: disable=import-outside-toplevel
    from launch import cluster  # pylint: disable=import-outside-toplevel
    from tupe_jax.errors import UserError  # pylint: disable=import-outside-toplevel

    def no_metadata(**kwargs):
        raise OSError("metadata.google.internal: Name or service not known")

    monkeypatch.setattr(jax.distributed, "initialize", no_metadata)
    monkeypatch.delenv("TPU_WORKER_HOSTNAMES", raising=False)
    monkeypatch.setattr(cluster, "tpu_chips", lambda: 4)
    cluster.maybe_initialize_distributed(_flags())
    assert capsys.readouterr().out.startswith("warning: jax.distributed did not start on this TPU VM (metadata")
    with pytest.raises(UserError, match=r"^error: jax.distributed.initialize: metadata"):     # asked for: stop
        cluster.maybe_initialize_distributed(_flags(distributed="on"))


def test_several_processes_without_jax_distributed_are_refused(monkeypatch):
    """Each process would decide a preemption save, a checkpoint's fallback and the lock alone."""
    import jax  # pylint: disable=import-outside-toplevel
    from launch import cluster  # pylint: disable=import-outside-toplevel
    from tupe_jax.errors import UserError  # pylint: disable=import-outside-toplevel
    cluster.refuse_undistributed_processes()                # one process: nothing to refuse
    monkeypatch.setattr(jax, "process_count", lambda: 4)
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    with pytest.raises(UserError, match=r"^error: 4 processes without jax.distributed, --distributed, run with "
                                        r"--distributed=on \(or auto\) on every host$"):
        cluster.refuse_undistributed_processes()
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
    cluster.refuse_undistributed_processes()


@pytest.mark.parametrize("key,value", [("data.mask_prob", "0.2"), ("data.max_predictions", "10"),
                                       ("data.packing", "contiguous")])
def test_an_mlm_key_given_to_a_causal_run_is_refused_not_ignored(tmp_path, capsys, key, value):
    """A causal LM reads none of them: the run trained as if they were not given, exit 0."""
    clm = PRETRAIN.replace("size=tiny", "size=tiny,objective=clm")
    assert launch.main(["pretrain", clm, f"--workdir={tmp_path / 'run'}", f"--config.{key}={value}"] + TINY) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {key} is read by MLM") and f", --config.{key}, drop it" in err
    assert not (tmp_path / "run").exists()
    mlm = ["pretrain", PRETRAIN, f"--workdir={tmp_path / 'mlm'}", f"--config.{key}={value}", "--config.train.steps=0"]
    assert launch.main(mlm + TINY) == 2 and "train.steps" in capsys.readouterr().err   # an MLM reads it: not this refusal
    from tupe_jax.pretrain import validate  # pylint: disable=import-outside-toplevel
    (tmp_path / "old").mkdir()       # a causal run made with the key before this check: it resumes with its keys
    (tmp_path / "old" / "config.json").write_text("{}")
    config = load_config_module("pretrain").get_config("pe=rope,objective=clm")
    assert validate.refuse_unread_keys(config, frozenset(), frozenset({key}), workdir=str(tmp_path / "old")) == []


@pytest.mark.parametrize("value,expected", [("--2", None), ("-+2", None), ("2-", None), (" 3 ", 3), ("-1", -1)])
def test_a_process_count_variable_is_an_int_or_one_line(monkeypatch, value, expected):
    """`JAX_NUM_PROCESSES=--2` read as -2 past the check (every leading dash was stripped) and crashed in int()."""
    from launch import cluster  # pylint: disable=import-outside-toplevel
    from tupe_jax.errors import UserError  # pylint: disable=import-outside-toplevel
    monkeypatch.setenv("JAX_NUM_PROCESSES", value)
    if expected is None:
        with pytest.raises(UserError, match=r"JAX_NUM_PROCESSES=.* is not an int, JAX_NUM_PROCESSES, unset it"):
            cluster.env_int("JAX_NUM_PROCESSES")
    else:
        assert cluster.env_int("JAX_NUM_PROCESSES") == expected
