"""A fine-tune from `init_from` takes the pretraining run's model keys (those that must match) unless the command
line gives them: `tupe_jax.finetune.init_from.adopt_model_keys`, `config.arg_keys` and the launcher's `adopt` hook.
The runs here are config.json files only (nothing is trained); the slow interop tests fine-tune imported runs
through the printed command, which gives no model keys."""
import json
import os

import pytest

import launch
from tests.glue_fixtures import ROOT, load_config_module
from tupe_jax import config as config_lib
from tupe_jax.errors import UserError
from tupe_jax.finetune import init_from as ft_init

GLUE = os.path.join(ROOT, "configs", "glue.py")
# A run unlike configs/glue.py's defaults (tupe_r, tiny) in every kind of key: scheme, size keys, others.
THEIRS = dict(pe="bert_a", num_layers=1, hidden_size=32, num_heads=2, mlp_dim=64, vocab_size=100, max_len=64,
              layer_norm_eps=1e-12, type_vocab_size=2)
SIZE = ("num_layers", "hidden_size", "num_heads", "mlp_dim", "vocab_size", "max_len")


@pytest.fixture
def run(tmp_path):
    """A pretraining run folder: config.json (configs/pretrain.py with THEIRS) and a checkpoint folder."""
    config = load_config_module("pretrain").get_config("pe=bert_a,size=tiny")
    config.model.update(THEIRS)
    os.makedirs(tmp_path / "run" / "checkpoints" / "10")
    (tmp_path / "run" / "config.json").write_text(config_lib.to_json(config))
    return str(tmp_path / "run")


def glue_config(arg: str, init_from: str):
    config = config_lib.load_config(f"{GLUE}:{arg}")
    config.init_from = init_from
    return config


def test_arg_keys_are_the_keys_written_in_the_config_arg():
    assert config_lib.arg_keys(f"{GLUE}:task=rte,pe=bert_a") == {"task", "pe"}
    assert config_lib.arg_keys(f"{GLUE}:rte") == set()          # a bare first value: the task
    assert config_lib.arg_keys(f"{GLUE}: size = base ,") == {"size"}
    assert config_lib.arg_keys(GLUE) == set()


def test_keys_left_to_the_presets_are_the_runs(run):
    config = glue_config("task=rte", run)
    preset = config.model.to_dict()
    adopted = ft_init.adopt_model_keys(config)
    assert sorted(adopted) == sorted(f"model.{k}={v!r}" for k, v in THEIRS.items() if preset[k] != v)
    assert "model.layer_norm_eps=1e-12" in adopted and "model.pe='bert_a'" in adopted
    assert {k: config.model[k] for k in THEIRS} == THEIRS
    others = {k: v for k, v in config.model.items() if k not in ft_init.MUST_MATCH}
    assert others == {k: v for k, v in preset.items() if k not in ft_init.MUST_MATCH}   # dtype, dropout: ours
    ft_init.check_model_keys(run, config)                          # nothing left to refuse
    at_step = glue_config("task=rte", os.path.join(run, "checkpoints", "10"))
    ft_init.adopt_model_keys(at_step)                              # init_from naming a step: the same run
    assert at_step.model.to_dict() == config.model.to_dict()


def test_keys_the_command_line_gives_are_kept_and_refused_when_they_differ(run):
    config = glue_config("task=rte,size=tiny", run)                # size= gives the six size keys
    tiny = config.model.to_dict()
    adopted = ft_init.adopt_model_keys(config, frozenset({"task", "size"}))
    assert {k: config.model[k] for k in SIZE} == {k: tiny[k] for k in SIZE}
    assert config.model.pe == "bert_a" and config.model.type_vocab_size == 2
    assert not any(a.split("=")[0][len("model."):] in SIZE for a in adopted)
    with pytest.raises(UserError, match=r"model\.num_layers=1, model\.hidden_size=32.* but this config has "
                                        r"model\.num_layers=2, model\.hidden_size=128.*, --config\.init_from, "):
        ft_init.check_model_keys(run, config)

    config = glue_config("task=rte,pe=tupe_r", run)               # pe= and --config.model.max_len=128
    config.model.max_len = 128
    ft_init.adopt_model_keys(config, frozenset({"task", "pe"}), frozenset({"model.max_len", "train.seed"}))
    assert (config.model.pe, config.model.max_len, config.model.hidden_size) == ("tupe_r", 128, 32)

    config = glue_config("task=rte,objective=clm", run)           # objective= gives untie_cls with it (pretrain.py)
    ft_init.adopt_model_keys(config, frozenset({"task", "objective"}))
    assert (config.model.objective, config.model.untie_cls, config.model.pe) == ("clm", False, "bert_a")


def test_nothing_is_adopted_without_a_run_to_adopt_from(run, tmp_path):
    config = glue_config("task=rte", "")                           # from scratch: the presets
    before = config.model.to_dict()
    assert ft_init.adopt_model_keys(config) == [] and config.model.to_dict() == before
    os.remove(os.path.join(run, "config.json"))                     # the encoder-shape check still guards this
    config = glue_config("task=rte", run)
    assert ft_init.adopt_model_keys(config) == [] and config.model.to_dict() == before
    with pytest.raises(UserError, match=r"nothing does not exist, --config\.init_from, "):
        ft_init.adopt_model_keys(glue_config("task=rte", str(tmp_path / "nothing")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"not a pretraining run .*, --config\.init_from, "):
        ft_init.adopt_model_keys(glue_config("task=rte", str(tmp_path / "empty")))


def test_the_launcher_prints_what_it_adopts_before_validating(run, tmp_path, capsys):
    """The config arg and overrides of the real command line reach the hook; the validator then sees the adopted
    config (here it refuses a batch that 8 devices do not divide, before the workdir is claimed)."""
    argv = ["finetune", f"--config={GLUE}:task=rte,size=tiny", f"--workdir={tmp_path / 'ft'}",
            f"--config.init_from={run}", "--config.model.layer_norm_eps=1e-6", "--config.train.batch_size=12"]
    assert launch.main(argv) == 2
    out, err = capsys.readouterr()
    assert out.splitlines() == [f"from {run}: model.pe='bert_a', model.type_vocab_size=2"]
    assert err.count("\n") == 1 and "train.batch_size" in err
    assert not (tmp_path / "ft").exists()
    assert json.loads((tmp_path / "run" / "config.json").read_text())["model"]["layer_norm_eps"] == 1e-12
