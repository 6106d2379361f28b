"""`evaluate`, `extrapolate`, `probe` and `correlations` on another corpus than the run's own (`--config.data.*`):
the numbers equal those of the same checkpoint whose config.json names that corpus, the run's folder is left as it
was, and what the commands do not read is refused in one line."""
import json
import shutil

import pytest

import launch
from tests.test_data_prepare import prepare_args, write_corpus
from tests.workdir_fixtures import tree
from tupe_jax import checkpoint as ckpt_lib
from tupe_jax import workdir as workdir_lib

COMMANDS = {"extrapolate": ["--lengths=16,32"], "probe": ["--probe_steps=3"], "correlations": []}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A tiny MLM run on the embedded corpus (`own`), a text corpus, and `named`: a copy of the run whose config.json
    names that corpus (what the overrides must amount to)."""
    root = tmp_path_factory.mktemp("corpus_runs")
    corpus = write_corpus(root / "corpus")
    own, named = root / "own", root / "named"
    assert launch.main(["pretrain", "--config=configs/pretrain.py:pe=bert_a,size=tiny", f"--workdir={own}",
                        "--config.model.max_len=32", "--config.model.vocab_size=200", "--config.train.steps=3",
                        "--config.train.batch_size=8", "--config.train.eval_every=0", "--config.checkpoint.every=3",
                        "--config.checkpoint.async_save=false", f"--config.data.cache_dir={root / 'cache'}"]) == 0
    shutil.copytree(own, named)
    config = json.loads((named / "config.json").read_text())
    config["data"].update(name="text_files", path=str(corpus))
    (named / "config.json").write_text(json.dumps(config, indent=2))
    return own, named, corpus


def flags(corpus, *extra):
    return ["--config.data.name=text_files", f"--config.data.path={corpus}", *extra]


def results(path):
    """An analysis JSON without what names the run (its folder, the corpus it was told)."""
    report = json.loads(path.read_text())
    for r in report["runs"]:
        for key in ("name", "workdir", "corpus"):
            r.pop(key, None)
    return report


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_an_analysis_on_another_corpus_is_that_of_a_run_naming_it(runs, tmp_path, command, capsys):
    own, named, corpus = runs
    before = tree(str(own))
    given, reference, default = tmp_path / "given", tmp_path / "reference", tmp_path / "default"
    assert launch.main([command, f"--workdir={own}", *COMMANDS[command], f"--out={given}", *flags(corpus)]) == 0
    assert launch.main([command, f"--workdir={named}", *COMMANDS[command], f"--out={reference}"]) == 0
    capsys.readouterr()
    name = f"{command.replace('extrapolate', 'extrapolation')}.json"
    report = json.loads((given / name).read_text())
    assert report["runs"][0]["corpus"] == {"data.name": "text_files", "data.path": str(corpus)}
    assert results(given / name) == results(reference / name)
    assert tree(str(own)) == before                        # nothing written into the run: not even analysis/
    if command == "extrapolate":                           # and it is another text than the run's own
        assert launch.main([command, f"--workdir={own}", *COMMANDS[command], f"--out={default}"]) == 0
        assert results(default / name) != results(given / name)


def test_evaluate_on_another_corpus_prints_and_leaves_the_run_as_it_was(runs, capsys):
    own, named, corpus = runs
    before = tree(str(own))
    assert launch.main(["evaluate", f"--workdir={own}", *flags(corpus)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert launch.main(["evaluate", f"--workdir={named}"]) == 0
    capsys.readouterr()
    row = json.loads((named / "metrics.jsonl").read_text().splitlines()[-1])
    assert f"{own} step 3 on --config.data.name=text_files --config.data.path={corpus}: " in printed
    assert f"eval_loss {row['eval_loss']:.4f}" in printed and "not added to the run's metrics.jsonl" in printed
    assert tree(str(own)) == before


def one_line(capsys, argv):
    assert launch.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


@pytest.mark.parametrize("argv,says", [
    (["extrapolate", "--config.model.num_layers=1"], "takes --config.data.* only"),
    (["probe", "--config.data.vocab_file=v.txt"], "the run's own tokenizer"),
    (["correlations", "--config.data.mask_prob=0.2"], "does not read data.mask_prob"),
    (["probe", "--config.data.packing=contiguous"], "does not read data.packing"),
    (["evaluate", "--config.data.glue_dir=g"], "does not read data.glue_dir"),
    (["shuffle-attention", "--config.data.name=text_files"], "'shuffle-attention' reads the run's config from --workdir; drop"),
    (["extrapolate", "--config.data.holdout=many"], "--config.data.holdout"),
    (["extrapolate", "--config.data.nmae=text_files"], "does not read data.nmae"),
    (["evaluate", "--config.data.mask_prob=0"], "data.mask_prob = 0.0 is outside (0, 1)"),
    (["evaluate", "--config.data.max_predictions=-3"], "data.max_predictions = -3 is outside [0, model.max_len]"),
    (["evaluate", "--config.data.prefetch=-1"], "data.prefetch = -1 is negative"),
    (["evaluate", "--config.data.holdout=0"], "data.holdout does nothing for data.name='embedded'"),
    (["probe", "--config.data.name=text_files", "--config.data.path=CORPUS", "--config.data.tfds_text_key=t"],
     "data.tfds_text_key does nothing for data.name='text_files'"),
    (["probe", "--config.data.name=text_files", "--config.data.path=NOWHERE"], "NOWHERE does not exist"),
    (["probe", "--config.data.name=text_files", "--config.data.path=CORPUS", "--config.data.cache_dir=RUN/cache"],
     "RUN/cache is inside the run"),
])
def test_what_the_command_does_not_read_is_refused(runs, tmp_path, capsys, argv, says):
    own, _, corpus = runs
    before = tree(str(own))

    def real(text):
        return text.replace("CORPUS", str(corpus)).replace("NOWHERE", str(tmp_path / "nowhere")).replace("RUN", str(own))
    argv = [real(a) for a in argv]
    err = one_line(capsys, [argv[0], f"--workdir={own}", f"--out={tmp_path / 'out'}", *argv[1:]]
                   if argv[0] != "evaluate" else [argv[0], f"--workdir={own}", *argv[1:]])
    assert real(says) in err
    assert tree(str(own)) == before and not (tmp_path / "out").exists()


def test_another_corpus_needs_out_and_a_readable_source(runs, tmp_path, capsys, monkeypatch):
    """Refused before the checkpoint is read (a restore would fail the command as unexpected here)."""
    own, _, corpus = runs
    before = tree(str(own))
    monkeypatch.setattr(ckpt_lib, "restore_params", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("read")))
    err = one_line(capsys, ["probe", f"--workdir={own}", *flags(corpus)])
    assert "would replace the run's own" in err and "--out=DIR" in err
    err = one_line(capsys, ["extrapolate", f"--workdir={own}", "--lengths=16", f"--out={tmp_path / 'out'}",
                            "--config.data.path=/some/text"])
    assert "data.name='embedded' does not read it" in err
    err = one_line(capsys, ["correlations", f"--workdir={own}", f"--out={tmp_path / 'out'}",
                            "--config.data.holdout=-1"])
    assert "data.holdout = -1 is negative" in err
    assert tree(str(own)) == before and not (tmp_path / "out").exists()
    monkeypatch.undo()
    err = one_line(capsys, ["evaluate", f"--workdir={own}", *flags(tmp_path / "missing")])
    assert str(tmp_path / "missing") in err and tree(str(own)) == before


def test_the_outputs_go_elsewhere_than_the_runs_own_and_name_the_corpus_by_absolute_paths(runs, tmp_path, capsys,
                                                                                         monkeypatch):
    own, _, corpus = runs
    before = tree(str(own))
    for out in (own, own / "analysis", f"{own}/analysis/"):
        err = one_line(capsys, ["correlations", f"--workdir={own}", f"--out={out}", *flags(corpus)])
        assert "is a run's own folder or its analysis/" in err
    assert tree(str(own)) == before
    monkeypatch.chdir(corpus.parent)                # relative paths, as typed in a shell
    assert launch.main(["correlations", f"--workdir={own}", "--out=by_name", "--config.data.name=text_files",
                        f"--config.data.path={corpus.name}", "--config.data.cache_dir=cache"]) == 0
    row = json.loads((corpus.parent / "by_name" / "correlations.json").read_text())["runs"][0]
    assert row["corpus"] == {"data.name": "text_files", "data.path": str(corpus),
                             "data.cache_dir": str(corpus.parent / "cache")}


def test_evaluate_names_why_another_corpus_cannot_be_read(runs, tmp_path, capsys):
    """A corpus without a validation split (or a dataset that cannot be opened) was reported as "no validation
    split", with a hint about pretraining."""
    own, _, _ = runs
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "train.txt").write_text("alpha beta gamma\n\ndelta epsilon\n" * 50)
    err = one_line(capsys, ["evaluate", f"--workdir={own}", "--config.data.name=text_files",
                            f"--config.data.path={tmp_path / 'text'}", "--config.data.holdout=0"])
    assert "split 'validation' is not available (have ['train'])" in err and "when pretraining" not in err


def test_a_prepared_corpus_must_be_made_with_the_runs_tokenizer(runs, tmp_path, capsys):
    own, named, corpus = runs
    mine, other = tmp_path / "mine", tmp_path / "other"
    vocab = workdir_lib.tokenizer_path(str(own))
    assert launch.main(prepare_args(corpus, mine, f"--config.data.vocab_file={vocab}")) == 0
    assert launch.main(prepare_args(corpus, other)) == 0            # its own vocabulary, learned from the corpus
    capsys.readouterr()
    err = one_line(capsys, ["extrapolate", f"--workdir={own}", "--lengths=16,32", f"--out={tmp_path / 'x'}",
                            "--config.data.name=prepared", f"--config.data.path={other}"])
    assert "prepared with another tokenizer than the run's" in err and vocab in err
    longer = tmp_path / "longer"
    assert launch.main(prepare_args(corpus, longer, f"--config.data.vocab_file={vocab}", max_len=64)) == 0
    capsys.readouterr()
    err = one_line(capsys, ["evaluate", f"--workdir={own}", "--config.data.name=prepared",
                            f"--config.data.path={longer}"])
    assert "was prepared with model.max_len=64 (this run: 32), --config.data.path, prepare the corpus for this run" \
        in err
    assert launch.main(["extrapolate", f"--workdir={own}", "--lengths=16,32", f"--out={tmp_path / 'p'}",
                        "--config.data.name=prepared", f"--config.data.path={mine}"]) == 0
    assert launch.main(["extrapolate", f"--workdir={named}", "--lengths=16,32", f"--out={tmp_path / 'r'}"]) == 0
    # the records read back are the text tokenized: the same scores as the raw corpus
    assert results(tmp_path / "p" / "extrapolation.json") == results(tmp_path / "r" / "extrapolation.json")


def test_a_corpus_without_a_train_file_is_scored_but_not_trained_on(runs, tmp_path, capsys):
    """A folder holding a lone valid.txt (held-out text to score) was refused for every command: "no training
    file". It is scored as the same file beside a train.txt; what learns from the train split refuses it."""
    own, _, corpus = runs
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(corpus / "valid.txt", lone / "valid.txt")
    printed = []
    for path in (corpus, lone):
        assert launch.main(["evaluate", f"--workdir={own}", *flags(path)]) == 0
        printed.append(capsys.readouterr().out.strip().splitlines()[-1].split(f"{path}: ", 1)[1])
        assert launch.main(["extrapolate", f"--workdir={own}", "--lengths=16,32", f"--out={tmp_path / path.name}",
                            *flags(path)]) == 0
    capsys.readouterr()
    assert printed[0] == printed[1] and "eval_loss" in printed[0]
    assert results(tmp_path / "lone" / "extrapolation.json") == results(tmp_path / corpus.name / "extrapolation.json")
    err = one_line(capsys, ["probe", f"--workdir={own}", f"--out={tmp_path / 'p'}", *flags(lone)])
    assert "split 'train' is not available (have ['validation'])" in err and "whose name contains 'train'" in err
    before = tree(str(lone))
    err = one_line(capsys, ["pretrain", "--config=configs/pretrain.py:pe=bert_a,size=tiny",
                            f"--workdir={tmp_path / 'new'}", *flags(lone)])
    assert f"data.path {lone} has no training file (a name containing 'train'; its files are for validation)" in err
    err = one_line(capsys, prepare_args(lone, tmp_path / "prep"))
    assert "has no training file" in err and "give --config.data.vocab_file to prepare the others" in err
    assert tree(str(lone)) == before and not (tmp_path / "new").exists() and not (tmp_path / "prep").exists()
    vocab = workdir_lib.tokenizer_path(str(own))
    assert launch.main(prepare_args(lone, tmp_path / "prep", f"--config.data.vocab_file={vocab}")) == 0
    capsys.readouterr()
    assert launch.main(["evaluate", f"--workdir={own}", "--config.data.name=prepared",
                        f"--config.data.path={tmp_path / 'prep'}"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith(printed[0])


def test_a_corpus_too_short_for_one_window_leaves_no_output_folder(runs, tmp_path, capsys):
    """`correlations` made its --out folder before it read the text, and left it empty when the text was refused."""
    own, _, _ = runs
    (tmp_path / "short").mkdir()
    (tmp_path / "short" / "valid.txt").write_text("alpha beta\n")
    for command in ("correlations", "extrapolate", "probe"):
        err = one_line(capsys, [command, f"--workdir={own}", f"--out={tmp_path / 'out'}", *flags(tmp_path / "short"),
                                *(["--lengths=16"] if command == "extrapolate" else [])])
        assert ("fewer than one window" in err or "'train' is not available" in err) and not (tmp_path / "out").exists()
