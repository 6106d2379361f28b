"""The run-folder gate: what may change on resume (recorded), what is refused (naming key and values, nothing
written), the checkpoint checks, claim's clean-up and provenance (one run per folder: test_lock.py; several processes:
test_workdir_processes.py)."""
import importlib.metadata
import json
import os
import platform
import subprocess
import sys

import jax
import pytest

from tupe_jax import allocator
from tupe_jax import config as config_lib
from tupe_jax import host
from tupe_jax import workdir as workdir_lib
from tupe_jax import xla_options
from tupe_jax.errors import UserError
from tests.workdir_fixtures import ROOT, fake_checkpoint, load_config, tree
from tests import xla_flags


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


def test_a_smaller_checkpoint_keep_says_older_steps_go(tmp_path, capsys):
    wd = str(tmp_path / "run")
    workdir_lib.write_config(wd, load_config(**{"checkpoint.keep": 3}))
    workdir_lib.write_config(wd, load_config(**{"checkpoint.keep": 1}))
    assert "only the newest 1 checkpoints are kept: older steps are deleted" in capsys.readouterr().out


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
    with pytest.raises(UserError, match="holds a pretraining run; this command makes a fine-tuning run"):
        workdir_lib.write_config(wd2, glue)


def test_a_tokenizer_left_in_a_folder_without_config_is_no_new_runs(tmp_path):
    """A new run in a folder holding another's tokenizer/vocab.txt trained on that vocabulary, over data.vocab_file
    or the one its corpus gives; a prepare's folder keeps its own rule (its vocabulary records its text)."""
    wd = tmp_path / "run"
    (wd / "tokenizer").mkdir(parents=True)
    (wd / "tokenizer" / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nfoo\n")
    before = tree(str(wd))
    with pytest.raises(UserError, match=r"holds tokenizer/vocab.txt but no config.json.*, --workdir, use a fresh"):
        workdir_lib.write_config(str(wd), load_config())
    assert tree(str(wd)) == before
    workdir_lib.check_config(str(wd), config_lib.load_config(os.path.join(ROOT, "configs", "prepare.py")))


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
    with pytest.raises(RuntimeError):             # a new run's folder and the ones made above it for it: removed
        with workdir_lib.claim(str(tmp_path / "new" / "deep" / "run"), load_config()):
            raise RuntimeError("boom")
    assert not (tmp_path / "new").exists()
    with pytest.raises(RuntimeError):             # written with `..`: mkdir -p made n1 as well as n2
        with workdir_lib.claim(str(tmp_path / "n1" / ".." / "n2" / "run"), load_config()):
            raise RuntimeError("boom")
    assert sorted(os.listdir(tmp_path)) == sorted(set(os.listdir(tmp_path)) - {"n1", "n2"})
    assert not (tmp_path / "n1").exists() and not (tmp_path / "n2").exists()


def test_a_command_refused_inside_the_claim_leaves_the_run_byte_identical(tmp_path):
    """A resume refused after the claim (by a check that needs the restored state: the data iterator's settings, a
    prepared corpus's tokenizer) puts back config.json, config_history.jsonl and provenance.jsonl and removes the
    tensorboard file it opened; one that saved a checkpoint first keeps them all (they describe that step)."""
    wd = str(tmp_path / "run")
    with workdir_lib.claim(wd, load_config(**{"train.log_every": 3})):
        fake_checkpoint(wd, load_config(**{"train.log_every": 3}), 3)
        os.makedirs(os.path.join(wd, "tensorboard"))
        (tmp_path / "run" / "tensorboard" / "events.1").write_text("old")
    before = tree(wd)
    assert "config_history.jsonl" not in before and "provenance.jsonl" in before
    for _ in range(2):       # the first refusal creates config_history.jsonl, the second finds one to append to
        with pytest.raises(UserError, match="belongs to different data settings"):
            with workdir_lib.claim(wd, load_config(**{"train.log_every": 5})):
                assert workdir_lib.read_config(wd).train.log_every == 5
                (tmp_path / "run" / "tensorboard" / "events.2").write_text("new")
                raise UserError("the saved data-iterator state belongs to different data settings")
        assert tree(wd) == before
        (tmp_path / "run" / "config_history.jsonl").write_text('{"changes": {}}\n')
        before = tree(wd)
    with pytest.raises(UserError):
        with workdir_lib.claim(wd, load_config(**{"train.log_every": 5})):
            fake_checkpoint(wd, load_config(**{"train.log_every": 5}), 4)
            raise UserError("a later failure")
    assert workdir_lib.read_config(wd).train.log_every == 5 and os.path.isdir(os.path.join(wd, "checkpoints", "4"))
    assert len(open(os.path.join(wd, "provenance.jsonl")).read().splitlines()) == 2
    assert open(os.path.join(wd, "config_history.jsonl")).read().count("\n") == 2


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
    for name in allocator.SETTINGS_ENV:
        env.pop(name, None)                     # the launcher chooses its malloc itself (allocator.py)
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Downloading" not in proc.stdout + proc.stderr and "data: preparing embedded" in proc.stdout
    chosen = allocator.choose(env, platform.libc_ver(), allocator.thp_mode(), allocator.tbbmalloc_libs(),
                              allocator.accelerator_plugin())
    row = json.loads(open(wd / "provenance.jsonl").readline())
    assert row["allocator"] == (chosen or "system")
    assert row["glibc_tunables"] == ("glibc.malloc.hugetlb=1" if chosen == "hugepages" else "")
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
    onednn = os.environ.get("TUPE_JAX_ONEDNN", "")
    assert row["dot_library"] == ("onednn" if onednn != "0" and platform.machine().lower() in xla_options.X86 and
                                  (onednn == "1" or xla_options.cpu_has_avx512() is not False) else "xla")
    assert row["allocator"] == allocator.active()       # this pytest process: what the Makefile set for it
    assert row["packages"].get("tbb") == (importlib.metadata.version("tbb") if allocator.tbbmalloc_libs() else None)


@pytest.mark.slow
def test_profile_steps_write_a_trace_tensorboard_lists(tmp_path, capsys):
    """`train.profile_steps=2,3` leaves an xplane trace where TensorBoard's profile plugin looks for runs; a resume
    at step 4 with 3,6 traces steps 5-6."""
    from tupe_jax.pretrain import loop  # pylint: disable=import-outside-toplevel
    config = load_config(**{"model.hidden_size": 32, "model.num_layers": 1, "model.num_heads": 2, "model.mlp_dim": 64,
                      "model.vocab_size": 512, "model.max_len": 32, "train.steps": 4, "train.batch_size": 8,
                      "train.eval_every": 0, "checkpoint.async_save": "false", "train.profile_steps": "2,3",
                      "data.cache_dir": str(tmp_path / "cache")})
    loop.pretrain(config, str(tmp_path / "run"), devices=jax.devices()[:1])
    traces = list((tmp_path / "run" / "profile" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    # a resume inside the range traces the rest of it (it crashed at the range's end: no trace had started)
    config.train.update({"steps": 8, "decay_steps": 4, "profile_steps": "3,6"})
    capsys.readouterr()
    loop.pretrain(config, str(tmp_path / "run"), devices=jax.devices()[:1])
    assert "profile: steps 5-6 traced to" in capsys.readouterr().out
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


def test_a_whole_file_write_that_fails_keeps_the_earlier_file_and_leaves_no_temporary_one(tmp_path):
    """`files.write_text` (config.json, results, exports): a write that fails part way (here a character UTF-8 cannot
    encode; a full disk alike) leaves the earlier file byte-identical and nothing else in the folder."""
    from tupe_jax import files  # pylint: disable=import-outside-toplevel
    path = tmp_path / "config.json"
    files.write_json(str(path), {"a": 1})
    before = path.read_bytes()
    with pytest.raises(UnicodeEncodeError):
        files.write_text(str(path), "x" * 100_000 + "\udc80")
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["config.json"]


def test_a_run_whose_position_table_has_fewer_than_8_rows_loads(tmp_path):
    """load_run (evaluate, export, the analyses) built the model's shapes from 8 tokens, which a bert_a table of
    4 rows refuses (`launch pretrain` trains such a run, `import-hf` imports one)."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    from tests.glue_fixtures import make_pretrained  # pylint: disable=import-outside-toplevel
    params = make_pretrained(tmp_path / "run", tmp_path / "cache", pe="bert_a", max_len=4)
    run = workdir_lib.load_run(str(tmp_path / "run"))
    assert run.model_cfg.max_len == 4 and run.step == 10
    for a, b in zip(jax.tree_util.tree_leaves(run.params), jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_resume_that_would_change_the_learning_rate_schedule_is_refused(tmp_path):
    """train.steps sets where the decay reaches 0 (decay_steps=0): a resume with more steps would train its next
    steps on another schedule, matching neither run. Pinning decay_steps to the run's keeps the schedule."""
    wd = str(tmp_path / "run")
    config = load_config(**{"train.steps": 6})
    workdir_lib.write_config(wd, config)
    fake_checkpoint(wd, config, 4)
    before = tree(wd)
    with pytest.raises(UserError, match=r"train.steps 6 -> 12 would change this run's learning-rate schedule .*, "
                                        r"--config.train.steps, .*--config.train.decay_steps=6 "):
        workdir_lib.write_config(wd, load_config(**{"train.steps": 12}))
    with pytest.raises(UserError, match="train.decay_steps=0 .this command: 9."):   # another schedule: refused
        workdir_lib.write_config(wd, load_config(**{"train.steps": 12, "train.decay_steps": 9}))
    assert tree(wd) == before
    workdir_lib.write_config(wd, load_config(**{"train.steps": 12, "train.decay_steps": 6}))
    history = [json.loads(line) for line in open(os.path.join(wd, "config_history.jsonl"))]
    assert history[-1]["changes"] == {"train.decay_steps": [0, 6], "train.steps": [6, 12]}
    workdir_lib.write_config(wd, load_config(**{"train.steps": 20, "train.decay_steps": 6}))   # schedule unchanged
