"""End to end: tiny pretraining runs through the launcher, then every analysis command on their workdirs."""
import json
import math

import pytest

import launch


def pretrain(workdir, pe, objective, cache):
    overrides = {"model.hidden_size": 32, "model.num_layers": 2, "model.num_heads": 2, "model.mlp_dim": 64,
                 "model.vocab_size": 512, "model.max_len": 32, "train.steps": 30, "train.batch_size": 8,
                 "train.warmup_steps": 5, "train.learning_rate": "3e-3", "train.eval_every": 0,
                 "checkpoint.every": 30, "checkpoint.async_save": "false", "data.cache_dir": cache}
    argv = ["pretrain", f"--config=configs/pretrain.py:pe={pe},size=tiny,objective={objective}",
            f"--workdir={workdir}"] + [f"--config.{k}={v}" for k, v in overrides.items()]
    assert launch.main(argv) == 0


@pytest.mark.slow
def test_analysis_commands_on_pretrained_runs(tmp_path, monkeypatch, capsys):
    cache = str(tmp_path / "cache")
    monkeypatch.setenv("TUPE_JAX_CACHE", cache)
    rope, table = str(tmp_path / "rope"), str(tmp_path / "bert_a")
    pretrain(rope, "rope", "clm", cache)
    pretrain(table, "bert_a", "mlm", cache)
    out = tmp_path / "out"

    assert launch.main(["extrapolate", f"--workdir={rope}", f"--workdir={table}", "--lengths=16,32,64",
                        f"--out={out}"]) == 0
    report = json.loads((out / "extrapolation.json").read_text())
    by = {r["pe"]: r for r in report["runs"]}
    assert all(x["defined"] and math.isfinite(x["perplexity"]) for x in by["rope"]["results"])
    assert by["rope"]["results"][1]["perplexity"] < 400        # trained: well below the 512-token vocabulary
    assert [x["defined"] for x in by["bert_a"]["results"]] == [True, True, False]
    assert by["bert_a"]["metric"] == "mlm_loss" and by["rope"]["step"] == 30
    assert (out / "extrapolation.png").is_file()

    assert launch.main(["extrapolate", f"--workdir={rope}", "--lengths=64", "--mode=sliding", "--stride=16"]) == 0
    sliding = json.loads((tmp_path / "rope" / "analysis" / "extrapolation.json").read_text())
    assert sliding["protocol"]["mode"] == "sliding" and sliding["runs"][0]["results"][0]["stride"] == 16

    assert launch.main(["probe", f"--workdir={rope}", f"--workdir={table}", "--probe_steps=40",
                        "--probe_tokens=1000", f"--out={out}"]) == 0
    probe = json.loads((out / "probe.json").read_text())
    assert [len(r["layers"]) for r in probe["runs"]] == [3, 3]
    assert probe["settings"]["steps"] == 40 and probe["settings"]["train_tokens"] == 1000
    assert [r["train_tokens"] for r in probe["runs"]] == [1024, 992]    # 32 windows of 32; MLM: 31 positions each

    assert launch.main(["correlations", f"--workdir={table}", f"--out={out}"]) == 0
    corr = json.loads((out / "correlations.json").read_text())["runs"][0]
    assert corr["kind"] == "additive" and corr["max_abs_error_vs_model"] < 1e-5

    assert launch.main(["shuffle-attention", f"--workdir={rope}", "--text=the cat sat on the mat", "--layer=1",
                        f"--out={out}"]) == 0
    assert (out / "shuffle_attention_layer1.png").is_file() and (out / "shuffle_attention_layer1.json").is_file()
    assert launch.main(["correlations", f"--workdir={table}", "--layer=7"]) == 2
    assert "out of range" in capsys.readouterr().err
