"""Hugging Face imports meeting what users hand them: a segment table trained in transformers after our export, an
import or export aimed into a run's checkpoints/ (also through a linked workdir), and config files of the wrong JSON
type. The round trips themselves are tests/test_interop.py's."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("transformers", reason="the hf extra (pip install -e '.[test]') brings transformers")

import launch  # noqa: E402
from tests import hf_fixtures as F  # noqa: E402
from tests.glue_fixtures import make_pretrained  # noqa: E402
from tests.test_interop import TOL, VOCAB, max_diff, one_line_error, pair_segments  # noqa: E402
from tupe_jax import workdir as workdir_lib  # noqa: E402
from tupe_jax.errors import UserError  # noqa: E402
from tupe_jax.model import TransformerLM  # noqa: E402


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A random tiny FlaxBertForMaskedLM saved by transformers."""
    folder = tmp_path_factory.mktemp("hf") / "bert"
    F.save_hf_bert(folder, VOCAB)
    return folder


@pytest.mark.slow
def test_a_segment_table_trained_after_export_is_imported_whole(tmp_path, capsys):
    """A bert_a run without segment embeddings exports a zero token-type table (its segment-0 row folded into the
    positions), and a sentence-pair fine-tune in transformers then trains that table. The export's own config
    section (kept by transformers' save_pretrained) said type_vocab_size 0, and the import folded row 0 back and
    dropped row 1 without a word: pairs differed from transformers by logits of ~2."""
    import transformers
    from safetensors.numpy import load_file, save_file
    make_pretrained(tmp_path / "run", tmp_path / "cache", pe="bert_a")
    assert launch.main(["export", f"--workdir={tmp_path / 'run'}", f"--out={tmp_path / 'out'}"]) == 0
    weights = tmp_path / "out" / "model.safetensors"
    tensors = load_file(str(weights))
    key = next(k for k in tensors if k.endswith("token_type_embeddings.weight"))
    assert not tensors[key].any()                     # the export's zero table
    tensors[key] = np.random.default_rng(7).normal(0, 0.02, tensors[key].shape).astype(np.float32)   # "trained"
    save_file(tensors, str(weights), metadata={"format": "pt"})
    capsys.readouterr()
    assert launch.main(["import-hf", f"--from={tmp_path / 'out'}", f"--workdir={tmp_path / 'back'}"]) == 0
    assert "the token-type table was trained since this run's export: imported whole" in capsys.readouterr().out
    back = workdir_lib.load_run(str(tmp_path / "back"))
    assert back.model_cfg.type_vocab_size == 2
    np.testing.assert_array_equal(back.params["encoder"]["token_type"]["embedding"], tensors[key])
    model = transformers.FlaxBertForMaskedLM.from_pretrained(str(tmp_path / "out"))
    ids, mask = F.padded_batch(back.tokenizer.vocab_size, seed=3)
    types = pair_segments(mask)
    theirs = model(ids, attention_mask=mask, token_type_ids=types, train=False).logits
    ours = TransformerLM(back.model_cfg).apply({"params": back.params}, jnp.asarray(ids), jnp.asarray(mask),
                                               segments=jnp.asarray(types))["logits"]
    assert max_diff(theirs, ours) <= TOL


def test_outputs_inside_a_runs_checkpoints_are_refused_through_links_and_for_imports(hf_folder, tmp_path, capsys):
    """A linked --workdir got an export past the check (`--workdir=LINK --out=RUN/checkpoints/20`), and import-hf
    had none: either wrote a folder named like a step into checkpoints/, and every later read of the newest step
    failed on it."""
    run = tmp_path / "run"
    (run / "checkpoints" / "10").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    (run / "provenance.jsonl").write_text("{}\n")
    os.symlink(run, tmp_path / "link")
    with pytest.raises(UserError, match=r"checkpoints/20 is inside the checkpoints of .*link, --out"):
        workdir_lib.refuse_in_checkpoints(str(run / "checkpoints" / "20"), str(tmp_path / "link"), "--out")
    workdir_lib.refuse_in_checkpoints(str(run / "exports" / "x"), str(tmp_path / "link"), "--out")
    before = sorted(os.listdir(run / "checkpoints"))
    err = one_line_error(capsys, ["import-hf", f"--from={hf_folder}",
                                  f"--workdir={run / 'checkpoints' / '30'}"])
    assert err == f"error: {run / 'checkpoints' / '30'} is inside the checkpoints of {run}, --workdir, give a folder " \
                  "outside checkpoints/"
    assert sorted(os.listdir(run / "checkpoints")) == before


@pytest.mark.parametrize("name,text,expected", [
    ("config.json", "[1, 2]", "config.json holds a JSON list, not an object"),
    ("config.json", None, "its 'tupe_jax' section is not an object with a 'model' object"),
    ("tokenizer_config.json", "[]", "tokenizer_config.json holds a JSON list, not an object")])
def test_config_files_of_the_wrong_json_type_are_one_line(hf_folder, tmp_path, capsys, name, text, expected):
    """They crashed as 'unexpected AttributeError' with a log."""
    src = tmp_path / "hf"
    src.mkdir()
    for child in os.listdir(hf_folder):
        (src / child).write_bytes((hf_folder / child).read_bytes())
    if text is None:
        (src / name).write_text(json.dumps({**json.loads((src / name).read_text()), "tupe_jax": "oops"}))
    else:
        (src / name).write_text(text)
    err = one_line_error(capsys, ["import-hf", f"--from={src}", f"--workdir={tmp_path / 'run'}"])
    assert err.startswith("error: ") and expected in err, err
    assert not (tmp_path / "run").exists()


def test_a_killed_import_leaves_no_half_run_and_its_leftover_goes_at_the_next(hf_folder, tmp_path, capsys):
    """A kill -9 during import-hf left config.json and tokenizer/ without a checkpoint in --workdir: the rerun was
    refused ('not empty') and evaluate offered to pretrain it. The run is now written under a hidden name and
    renamed when whole; what a killed import left there is removed by the next one."""
    import socket
    import subprocess
    import sys
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    pid = int(gone.stdout)                            # a process that has exited
    leftover = tmp_path / f".run.{socket.gethostname()}.{pid}.tmp"
    (leftover / "tokenizer").mkdir(parents=True)
    (leftover / "config.json").write_text("{")         # what a kill -9 midway leaves
    other_host = tmp_path / f".run.another-host.{pid}.tmp"
    other_host.mkdir()
    assert launch.main(["import-hf", f"--from={hf_folder}", f"--workdir={tmp_path / 'run'}"]) == 0
    assert f"removed {leftover}, the unfinished import of a stopped process" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path)) == [other_host.name, "run"]     # another host's may still be writing
    assert workdir_lib.load_run(str(tmp_path / "run")).step == 0


def test_a_dangling_link_as_the_output_is_refused_before_any_work(hf_folder, tmp_path, capsys):
    """export wrote everything and then failed in the rename (NotADirectoryError), import-hf failed with
    FileExistsError: both 'unexpected', after the work."""
    os.symlink(tmp_path / "nowhere", tmp_path / "out")
    err = one_line_error(capsys, ["import-hf", f"--from={hf_folder}", f"--workdir={tmp_path / 'out'}"])
    assert err == f"error: {tmp_path / 'out'} is a link, --workdir, give a new folder for the imported run"
    assert launch.main(["import-hf", f"--from={hf_folder}", f"--workdir={tmp_path / 'run'}"]) == 0
    err = one_line_error(capsys, ["export", f"--workdir={tmp_path / 'run'}", f"--out={tmp_path / 'out'}"])
    assert err == f"error: {tmp_path / 'out'} already exists, --out, give a new folder (export never overwrites)"
    assert sorted(os.listdir(tmp_path)) == ["out", "run"] and not os.path.exists(tmp_path / "nowhere")


def test_pretraining_an_imported_run_is_one_line_and_changes_nothing(hf_folder, tmp_path):
    """It failed blaming 'different data settings' (an import saves no data-iterator state, and its data and train
    keys are this project's defaults, not the model's)."""
    from tests.workdir_fixtures import tree  # pylint: disable=import-outside-toplevel
    from tupe_jax.pretrain.loop import pretrain  # pylint: disable=import-outside-toplevel
    run = tmp_path / "run"
    assert launch.main(["import-hf", f"--from={hf_folder}", f"--workdir={run}"]) == 0
    config = workdir_lib.read_config(str(run))
    with config.unlocked():
        config.data.cache_dir = str(tmp_path / "cache")
    before = tree(str(run))
    with pytest.raises(UserError, match=r"holds an imported model \(checkpoint 0 has no data-iterator state\): .*"
                                        rf"--workdir, continue it in a fresh workdir with --config.init_from={run}"):
        pretrain(config, str(run))
    assert tree(str(run)) == before


def test_an_import_continues_pretraining_in_a_fresh_run(hf_folder, tmp_path, capsys):
    """`pretrain --config.init_from=IMPORT`: the imported BERT's keys (segment table, LayerNorm eps, its max_len)
    and its tokenizer; at a learning rate of 0 for the first step its params are the import's bitwise."""
    from tests.workdir_fixtures import tree  # pylint: disable=import-outside-toplevel
    imported, run = tmp_path / "import", tmp_path / "run"
    assert launch.main(["import-hf", f"--from={hf_folder}", f"--workdir={imported}"]) == 0
    before = tree(str(imported))
    assert launch.main(["pretrain", "--config=configs/pretrain.py", f"--workdir={run}",
                        f"--config.init_from={imported}", f"--config.data.cache_dir={tmp_path / 'cache'}",
                        "--config.train.steps=1", "--config.train.warmup_steps=1", "--config.train.batch_size=8",
                        "--config.train.eval_every=0", "--config.checkpoint.async_save=False"]) == 0
    assert "model.type_vocab_size=2" in capsys.readouterr().out and tree(str(imported)) == before
    ours, theirs = workdir_lib.load_run(str(run)), workdir_lib.load_run(str(imported))
    assert ours.model_cfg == theirs.model_cfg and ours.tokenizer.vocab == theirs.tokenizer.vocab
    assert ours.tokenizer.cls_id == 101 and ours.step == 1
    pairs = zip(jax.tree_util.tree_leaves(ours.params), jax.tree_util.tree_leaves(theirs.params))
    assert all(np.array_equal(a, b) for a, b in pairs)


def test_an_import_is_scored_on_the_corpus_given(hf_folder, tmp_path, capsys):
    """An import's config names the built-in corpus; `--config.data.*` scores the text given instead, with the
    import's tokenizer (its words here), and the run is left as it was."""
    from tests.workdir_fixtures import tree  # pylint: disable=import-outside-toplevel
    imported, corpus = tmp_path / "import", tmp_path / "corpus"
    assert launch.main(["import-hf", f"--from={hf_folder}", f"--workdir={imported}"]) == 0
    rng = np.random.default_rng(0)
    corpus.mkdir()
    for name, docs in (("train.txt", 40), ("valid.txt", 20)):
        (corpus / name).write_text("\n\n".join(" ".join(f"w{i}" for i in rng.integers(0, 150, 40))
                                               for _ in range(docs)) + "\n")
    before = tree(str(imported))
    given = ["--config.data.name=text_files", f"--config.data.path={corpus}",
             f"--config.data.cache_dir={tmp_path / 'cache'}"]
    assert launch.main(["extrapolate", f"--workdir={imported}", "--lengths=16", f"--out={tmp_path / 'a'}", *given]) == 0
    capsys.readouterr()
    row = json.loads((tmp_path / "a" / "extrapolation.json").read_text())["runs"][0]
    assert row["corpus"]["data.path"] == str(corpus) and np.isfinite(row["results"][0]["mlm_loss"])
    stream = workdir_lib.load_run(str(imported), data=dict(a[len("--config."):].split("=", 1) for a in given))
    from tupe_jax import data as data_lib  # pylint: disable=import-outside-toplevel
    tokens = np.asarray(data_lib.token_stream(stream.config, stream.tokenizer, "validation"))
    words = {stream.tokenizer.vocab.index(f"w{i}") for i in range(150)}
    assert len(tokens) == 20 * 41 and set(tokens.tolist()) <= words | {stream.tokenizer.sep_id}
    assert tree(str(imported)) == before
