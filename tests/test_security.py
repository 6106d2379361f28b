"""Security (issue #8): no unpickling anywhere in the package, config files run only from the path given, and the
demo pipeline (pretrain from scratch, then evaluate) with sockets disabled. (Restoring and reading data with
pickle disabled: test_reliability.py.)
"""
from __future__ import annotations

import glob
import io
import json
import os
import re
import subprocess
import sys
import tokenize

import pytest

from tests import xla_flags
from tests.reliability_fixtures import ROOT, committed
from tupe_jax import config as config_lib
from tupe_jax import workdir as workdir_lib
from tupe_jax.errors import UserError


def pickle_uses(source: str) -> list[int]:
    """Lines of `source` whose CODE (not strings or comments) names an unpickling module or call."""
    names = {"pickle", "cPickle", "cloudpickle", "dill", "joblib", "marshal", "shelve", "eval"}
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
              if t.type not in (tokenize.STRING, tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE)]
    hits = set()
    for i, tok in enumerate(tokens):
        text = " ".join(t.string for t in tokens[i:i + 4])
        attribute = i > 0 and tokens[i - 1].string == "."          # config.eval.lengths is not eval()
        named = tok.string in names and not attribute and (tok.string != "eval" or text.startswith("eval ("))
        call = " ".join(t.string for t in tokens[i:i + 40]).split(")")[0]     # up to the call's first ')'
        weights_only = re.match(r"torch \. load\b", text) and "weights_only = True" in call
        if tok.type == tokenize.NAME and not weights_only and (named or re.match(r"(torch|yaml) \. load\b", text)
                                                               or re.match(r"allow_pickle = True", text)):
            hits.add(tok.start[0])
    return sorted(hits)


def test_no_pickle_in_the_package():
    """Checkpoints, data and configs never go through pickle (or anything that unpickles); words in messages and
    docstrings (e.g. refusing a pickle by name) are fine. The one exception is PyTorch's restricted unpickler,
    `torch.load(..., weights_only=True)` (tensors, containers and an explicit allowlist; import-fairseq reads the
    authors' .pt with it and tests/test_interop_fairseq.py proves a crafted pickle is refused unrun)."""
    offenders = []
    for folder in ("tupe_jax", "launch", "configs"):
        for path in glob.glob(os.path.join(ROOT, folder, "**", "*.py"), recursive=True):
            with open(path, encoding="utf-8") as f:
                offenders += [f"{os.path.relpath(path, ROOT)}:{n}" for n in pickle_uses(f.read())]
    assert not offenders, offenders
    # the scanner sees code and only code
    assert pickle_uses("import pickle\nx = torch.load(f)\nnp.load(p, allow_pickle=True)\ny = eval(s)\n") == [1, 2, 3, 4]
    assert pickle_uses("n = config.eval.lengths\n") == []
    assert pickle_uses("obj = torch.load(path, map_location='cpu', weights_only=True)\n") == []
    assert pickle_uses("obj = torch.load(path, weights_only=False)\nz = torch.load(open(p), map_location=f(x))\n") \
        == [1, 2]
    assert pickle_uses('"""refuses a pickle"""\nmsg = "pytorch_model.bin is a pickle"  # not pickle.load\n') == []


def test_config_files_run_only_from_the_path_given(tmp_path, monkeypatch):
    """load_config executes exactly the file passed; a run's workdir config is JSON (never executed)."""
    marker = tmp_path / "executed"
    code = f"open({str(marker)!r}, 'w').write('x')\nraise SystemExit('must not run')\n"
    # a config.py in the cwd, on sys.path and inside the workdir: none of them is ever executed
    (tmp_path / "config.py").write_text(code)
    wd = tmp_path / "run"
    wd.mkdir()
    (wd / "config.py").write_text(code)
    (wd / "config.json").write_text(json.dumps({"model": {}}))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match="does not exist"):
        config_lib.load_config("configs/pretrain.py:pe=rope")           # relative to the cwd, no search path
    assert workdir_lib.read_config(str(wd)).to_dict() == {"model": {}}
    assert not marker.exists()
    good = tmp_path / "mine.py"
    good.write_text("import ml_collections\ndef get_config(arg):\n    return ml_collections.ConfigDict({'a': 1})\n")
    assert config_lib.load_config(f"{good}:x").a == 1


NO_NETWORK = '''
import socket
def _refuse(*args, **kwargs):
    raise OSError("network access attempted at run time (sockets are disabled in this test)")
socket.socket.connect = _refuse
socket.socket.connect_ex = _refuse
socket.socket.sendto = _refuse
socket.create_connection = _refuse
socket.getaddrinfo = _refuse
socket.gethostbyname = _refuse
'''


@pytest.mark.slow
def test_demo_pipeline_runs_without_network(tmp_path):
    """pretrain (building the embedded corpus and the tokenizer from scratch) + evaluate, with sockets disabled."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NO_NETWORK)
    wd, cache = tmp_path / "run", tmp_path / "fresh_cache"
    overrides = ["--config.model.hidden_size=32", "--config.model.num_layers=2", "--config.model.num_heads=2",
                 "--config.model.mlp_dim=64", "--config.model.vocab_size=512", "--config.model.max_len=32",
                 "--config.train.steps=4", "--config.train.batch_size=16", "--config.train.eval_every=0",
                 "--config.checkpoint.every=2", "--config.train.log_every=1"]
    code = ("import socket, sys, launch\n"
            "try:\n    socket.getaddrinfo('example.com', 80)\nexcept OSError:\n    pass\n"
            "else:\n    sys.exit('sockets are not disabled')\n"
            f"rc = launch.main(['pretrain', '--config=configs/pretrain.py:pe=tupe_r', '--workdir={wd}'] + {overrides!r})"
            f"\nrc = rc or launch.main(['evaluate', '--workdir={wd}'])\nsys.exit(rc)\n")
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{ROOT}", TUPE_JAX_CACHE=str(cache),
               XLA_FLAGS=xla_flags.devices(1), NO_PROXY="*")
    for key in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        env.pop(key, None)
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "network access attempted" not in result.stderr
    assert committed(wd) == [2, 4]
    assert "eval_loss" in result.stdout
