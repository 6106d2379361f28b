"""grain pretraining pipelines: MLM/CLM batch layout, resume from saved state, process sharding."""
import json
import re

import ml_collections
import numpy as np
import pytest

from tupe_jax import data as D
from tupe_jax.errors import UserError


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipe")
    c = ml_collections.ConfigDict({"data": D.default_data_config(),
                                   "model": {"vocab_size": 500, "max_len": 32, "objective": "mlm"}})
    c.data.cache_dir = str(tmp / "cache")
    c.data.prefetch = 2
    tok = D.get_tokenizer(c, tmp / "run")
    return c, tok


def it(c, tok, **kw):
    args = dict(split="validation", global_batch_size=8, seed=7, process_index=0, process_count=1)
    args.update(kw)
    return D.pretrain_iterator(c, tok, **args)


def assert_same(a, b):
    a, b = a.present(), b.present()
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_mlm_batch_layout(setup):
    c, tok = setup
    b = next(it(c, tok))
    shapes = {k: (v.shape, v.dtype.name) for k, v in b.present().items()}
    assert shapes == {"inputs": ((8, 32), "int32"), "input_mask": ((8, 32), "int32"), "targets": ((8, 32), "int32"),
                      "weights": ((8, 32), "float32"), "mlm_positions": ((8, 5), "int32"),
                      "mlm_labels": ((8, 5), "int32"), "mlm_weights": ((8, 5), "float32")}
    assert (b.inputs[:, 0] == tok.cls_id).all() and (b.targets[:, 0] == tok.cls_id).all()
    assert (b.weights[:, 0] == 0).all()
    assert (b.targets[b.input_mask == 0] == tok.pad_id).all()
    assert (b.targets[:, 1:] != tok.cls_id).all()


def test_resume_gives_identical_batches(setup):
    c, tok = setup
    first = it(c, tok, split="train")
    for _ in range(5):
        next(first)
    state = json.loads(json.dumps(first.get_state()))  # what the checkpoint stores
    expected = [next(first) for _ in range(4)]
    fresh = it(c, tok, split="train")
    fresh.set_state(state)
    for e in expected:
        assert_same(next(fresh), e)
    other = it(c, tok, split="train", seed=8)
    with pytest.raises(UserError, match="different data settings"):
        other.set_state(state)


def test_processes_are_disjoint_and_union_is_global_batch(setup):
    c, tok = setup
    whole = it(c, tok, split="train", global_batch_size=8)
    hosts = [it(c, tok, split="train", global_batch_size=8, process_index=p, process_count=2) for p in range(2)]
    assert hosts[0].per_host_batch_size == 4
    n = whole.num_examples
    steps = n // 8 + 2  # cross an epoch boundary
    for _ in range(steps):
        g, h0, h1 = (x.present() for x in (next(whole), next(hosts[0]), next(hosts[1])))
        for k in g:  # global row i is host i % 2, row i // 2
            np.testing.assert_array_equal(np.stack([h0[k], h1[k]], 1).reshape(g[k].shape), g[k], err_msg=k)
    # example identities: disjoint, union = the global batch, each example once per epoch
    b = [hosts[p].batcher for p in range(2)]
    ids = [np.concatenate([b[p].examples(s)[0] for s in range(n // 8)]) for p in range(2)]
    assert not set(ids[0]) & set(ids[1])
    both = np.concatenate(ids)
    assert len(np.unique(both)) == len(both) == n // 8 * 8 and both.min() >= 0 and both.max() < n


def test_one_pass_evaluation_sees_every_example_once(setup):
    c, tok = setup
    ev = it(c, tok, shuffle=False, repeat=False, global_batch_size=6)
    batches = list(ev)
    assert len(batches) == ev.num_steps == -(-ev.num_examples // 6)
    real = sum(int((x.input_mask.sum(1) > 0).sum()) for x in batches)
    assert real == ev.num_examples
    last = batches[-1]
    pad_rows = last.input_mask.sum(1) == 0
    assert (last.weights[pad_rows] == 0).all() and (last.mlm_weights[pad_rows] == 0).all()


def test_clm_stream(setup):
    c, tok = setup
    c = ml_collections.ConfigDict(c.to_dict())
    c.model.objective = "clm"
    batches = list(it(c, tok, shuffle=False, repeat=False, global_batch_size=4))
    b = batches[0]
    assert set(b.present()) == {"inputs", "targets", "weights"} and b.inputs.shape == (4, 32)
    np.testing.assert_array_equal(b.inputs[:, 1:], b.targets[:, :-1])
    np.testing.assert_array_equal(b.targets[0, -1], b.inputs[1, 0])  # windows overlap by one token
    assert (b.inputs != tok.cls_id).all() and (b.inputs == tok.sep_id).any()
    # every token after the first is a weighted target exactly once
    targets = np.concatenate([x.targets[x.weights > 0] for x in batches])
    docs = D.load_documents(c, "validation")
    stream = []
    for d in docs:
        for ids in tok.encode_batch(d.split("\n")):
            stream += ids
        stream.append(tok.sep_id)
    np.testing.assert_array_equal(targets, stream[1:])


def _mlm_blocks(c, tok):
    """The real tokens (after [CLS]) of every MLM block of the validation split, in stream order."""
    out = []
    for x in it(c, tok, shuffle=False, repeat=False):
        for row, m in zip(x.targets, x.input_mask):
            if m.sum():
                assert row[0] == tok.cls_id
                out.append(row[1:][m[1:] > 0])
    return out


def _line_violations(blocks, units, cap):
    """Units of <= cap tokens that a block boundary cuts, plus boundaries inside a longer unit at an offset
    that is not a multiple of cap (the only allowed split). Also checks nothing is lost or reordered."""
    np.testing.assert_array_equal(np.concatenate(blocks), np.concatenate(units))
    unit_start = np.cumsum([0] + [len(u) for u in units])  # unit i spans [unit_start[i], unit_start[i+1])
    cuts = np.cumsum([0] + [len(b) for b in blocks])[1:-1]  # block boundaries, as stream offsets
    bad = []
    for cut in cuts:
        i = int(np.searchsorted(unit_start, cut, side="right")) - 1  # the unit the boundary falls in
        off = cut - unit_start[i]
        if off and (len(units[i]) <= cap or off % cap):
            bad.append((int(cut), i, len(units[i])))
    return bad


def test_full_sentences_packing_keeps_lines_whole(setup):
    c, tok = setup
    cap = c.model.max_len - 1  # [CLS] takes one position
    # the packing units, built independently: every non-empty line of a document, [SEP] after its last line
    units = []
    for d in D.load_documents(c, "validation"):
        lines = [ln for ln in d.split("\n") if ln.strip()]
        units += [tok.encode(ln) + ([tok.sep_id] if j == len(lines) - 1 else []) for j, ln in enumerate(lines)]
    lens = np.array([len(u) for u in units])
    # the fixture exercises every case: short lines (packed, several per block) and lines longer than a block
    assert (lens <= cap).sum() >= 20 and (lens > cap).sum() >= 20
    blocks = _mlm_blocks(c, tok)
    assert all(len(b) <= cap for b in blocks)
    assert _line_violations(blocks, units, cap) == []
    # blocks that start at a line boundary are greedy: the line after a block would not have fitted in it
    unit_start = np.cumsum([0] + list(lens))
    pos, packed = 0, 0
    for b, nxt in zip(blocks, blocks[1:]):
        pos += len(b)
        i = int(np.searchsorted(unit_start, pos))
        if i < len(units) and unit_start[i] == pos and lens[i] <= cap:
            assert len(b) + lens[i] > cap, (pos, len(b), lens[i])
        packed += int(((unit_start > pos - len(b)) & (unit_start < pos)).sum() > 0)  # a line starts inside b
    assert packed >= 10  # many blocks hold more than one line
    # negative control: the checker does catch split lines (contiguous packing cuts lines anywhere)
    cc = ml_collections.ConfigDict(c.to_dict())
    cc.data.packing = "contiguous"
    assert len(_line_violations(_mlm_blocks(cc, tok), units, cap)) > 5


def test_bad_batch_size(setup):
    c, tok = setup
    with pytest.raises(UserError, match="multiple of 3"):
        it(c, tok, global_batch_size=8, process_count=3)


def test_grain_orbax_handler_round_trip(setup, tmp_path):
    import grain
    from etils import epath
    c, tok = setup
    a = it(c, tok, split="train")
    next(a), next(a)
    handler = grain.checkpoint.CheckpointHandler()
    handler.save(epath.Path(tmp_path), item=a)
    expected = next(a)
    b = handler.restore(epath.Path(tmp_path), item=it(c, tok, split="train"))
    assert_same(next(b), expected)


def _text_corpus(folder, text):
    folder.mkdir(parents=True, exist_ok=True)
    for split in ("train", "valid"):
        (folder / f"{split}.txt").write_text(text)
    return folder


def test_a_run_over_text_whose_lines_are_now_cut_differently_is_refused_saying_so(tmp_path, monkeypatch):
    """A state saved when U+2028 and the like still cut lines (their files stamped as other files) is refused with a
    line that says so, not as edited text; the same files read the old way would have resumed."""
    from tupe_jax.data import builders, pipeline, sources, stamps  # pylint: disable=import-outside-toplevel
    folder = _text_corpus(tmp_path / "c", "\n\n".join(f"doc {i}\u2028with a line separator" for i in range(50)) + "\n")
    c = ml_collections.ConfigDict({"data": D.default_data_config(),
                                   "model": {"vocab_size": 300, "max_len": 32, "objective": "mlm"}})
    c.data.name, c.data.path, c.data.holdout, c.data.cache_dir = "text_files", str(folder), 0, str(tmp_path / "cache")
    with monkeypatch.context() as m:           # the key as earlier versions stamped these files
        m.setattr(sources, "OTHER_BREAKS", ())
        m.setattr(stamps, "_SHA256", {})
        old = builders.resume_key(c, "train")
        pipeline.check_saved_text(c, {"corpus": old})
    monkeypatch.setattr(stamps, "_SHA256", {})
    assert builders.key_before_newline_only(c) == old != builders.resume_key(c, "train")
    with pytest.raises(UserError, match=r"^error: the text's lines are not the ones this run trained on: files under "
                                        r"data.path hold line breaks other than newlines .*, data.path=.*, start a "
                                        r"new workdir, or finish this run with the version it started with$"):
        pipeline.check_saved_text(c, {"corpus": old})
    (folder / "train.txt").write_text((folder / "train.txt").read_text() + "\nan edit\n")   # and edited since
    with pytest.raises(UserError, match=r"^error: the text read is not the one this run trained on"):
        pipeline.check_saved_text(c, {"corpus": old})


def test_a_copied_corpus_with_new_mtimes_resumes_and_an_edited_one_does_not(tmp_path):
    """The corpus is keyed by its files' content: a copy elsewhere, with other mtimes (a fresh VM, a re-mirrored
    bucket), gives the same fingerprint and takes the saved state; one changed byte of the same size does not.
    A state saved under data format 1's key (path, size, mtime) is still taken while the files are untouched."""
    import os  # pylint: disable=import-outside-toplevel
    from tupe_jax.data import builders  # pylint: disable=import-outside-toplevel
    text = "\n\n".join(f"document {i} has some words in it and then some more words {i * 7}" for i in range(300))
    configs = {}
    for name in ("a", "b", "c"):
        folder = _text_corpus(tmp_path / name, text if name != "c" else text.replace("document 5 ", "document 6 "))
        os.utime(folder / "train.txt", ns=(10 ** 18 if name == "b" else 10 ** 17,) * 2)
        c = ml_collections.ConfigDict({"data": D.default_data_config(),
                                       "model": {"vocab_size": 300, "max_len": 32, "objective": "mlm"}})
        c.data.name, c.data.path, c.data.holdout = "text_files", str(folder), 0
        c.data.cache_dir, c.data.prefetch = str(tmp_path / "cache"), 0
        configs[name] = c
    tok = D.get_tokenizer(configs["a"], tmp_path / "run")
    first = it(configs["a"], tok, split="train")
    next(first)
    state = first.get_state()
    expected = next(first)
    assert builders.corpus_fingerprint(configs["a"], "train") == builders.corpus_fingerprint(configs["b"], "train")
    copy = it(configs["b"], tok, split="train")
    copy.set_state(state)
    assert_same(next(copy), expected)
    edited = it(configs["c"], tok, split="train")
    with pytest.raises(UserError, match=r"^error: the text read is not the one this run trained on \(its content "
                                        rf"key differs .*\), data.path={re.escape(str(tmp_path / 'c'))}, point data"):
        edited.set_state(state)
    with pytest.raises(UserError, match="different data settings"):      # a state saved before it kept the key
        edited.set_state({k: v for k, v in state.items() if k != "corpus"})
    with pytest.raises(UserError, match="different data settings"):      # other text and other settings
        it(configs["c"], tok, split="train", seed=8).set_state(state)
    legacy = builders.digest([builders.legacy_corpus_key(configs["a"]), "train", tok.fingerprint, "mlm", 32, 8, 1, 7,
                              True, True, 0.15, 5, "full_sentences"])
    again = it(configs["a"], tok, split="train")
    again.set_state({**state, "fingerprint": legacy})             # saved by the previous data format
    assert_same(next(again), expected)
    with pytest.raises(UserError, match="different data settings"):  # the same files touched since: refused
        it(configs["b"], tok, split="train").set_state({**state, "fingerprint": legacy})


def test_mlm_batches_use_the_vocabularys_own_special_ids(setup):
    """A vocabulary in BERT's layout ([PAD] 0, [unused0..98] 1..99, [UNK] [CLS] [SEP] [MASK] 100..103, then the
    words): [CLS] 101 opens each row, [PAD] 0 fills it, [SEP] 102 ends documents, masked inputs are [MASK] 103 or
    ordinary words, and neither our own layout's special ids (1..4, reserved tokens here) nor any special id is
    ever a label."""
    c, tok = setup
    words = [t for t in tok.vocab if not (t.startswith("[") and t.endswith("]"))]
    bert = D.Tokenizer(["[PAD]"] + [f"[unused{i}]" for i in range(99)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
                       + words)
    assert (bert.pad_id, bert.unk_id, bert.cls_id, bert.sep_id, bert.mask_id) == (0, 100, 101, 102, 103)
    cfg = ml_collections.ConfigDict(c.to_dict())
    cfg.model.vocab_size = bert.vocab_size
    batches = [next(it(cfg, bert, split="train")) for _ in range(2)]
    inputs = np.concatenate([b.inputs for b in batches])
    mask = np.concatenate([b.input_mask for b in batches]) > 0
    labels = np.concatenate([b.mlm_labels[b.mlm_weights > 0] for b in batches])
    assert (inputs[:, 0] == 101).all() and (inputs[~mask] == 0).all() and (inputs[mask] != 0).all()
    assert (inputs == 102).any() and (inputs == 103).any()
    assert not np.isin(inputs, np.arange(1, 100)).any()
    assert labels.size and not np.isin(labels, bert.special_ids).any()


def _rows(batches):
    """The rows of a step's process batches, each as bytes of all its fields, sorted: the step's examples."""
    fields = [b.present() for b in batches]
    return sorted(b"".join(np.ascontiguousarray(f[k][i]).tobytes() for k in sorted(f))
                  for f in fields for i in range(len(next(iter(f.values())))))


@pytest.mark.parametrize("saved,now,legacy", [(2, 1, False), (1, 2, False), (2, 4, False), (3, 1, True)])
def test_a_state_of_another_process_count_goes_on_with_the_same_examples(setup, saved, now, legacy, caplog):
    """A run resumed on another number of processes (hosts) reads, at each step, the examples that step would have
    read on the old count (only their rows in the global batch move). It was refused. A state saved before it
    recorded its count (`legacy`) is known by its key, which the count went into."""
    c, tok = setup
    old = [it(c, tok, split="train", process_index=p, process_count=saved, global_batch_size=12 if legacy else 8)
           for p in range(saved)]
    for _ in range(3):
        for x in old:
            next(x)
    state = json.loads(json.dumps(old[0].get_state()))
    if legacy:
        del state["process_count"]
    new = [it(c, tok, split="train", process_index=p, process_count=now, global_batch_size=12 if legacy else 8)
           for p in range(now)]
    for x in new:
        x.set_state(state)
    assert f"saved by {saved} process{'' if saved == 1 else 'es'}, this run has {now} process" in caplog.text
    assert new[0].saved_process_count == saved               # the loop's `resumed` row names it
    steps = old[0].num_examples // (12 if legacy else 8) + 2   # past an epoch boundary
    for _ in range(steps):
        assert _rows([next(x) for x in new]) == _rows([next(x) for x in old])


def test_a_state_of_other_settings_names_the_process_counts(setup):
    c, tok = setup
    two = it(c, tok, process_count=2)
    next(two)
    state = json.loads(json.dumps(two.get_state()))
    with pytest.raises(UserError, match=r"the saved data-iterator state is of a run with 2 processes and other data "
                                        r"settings; this one has 1 process"):
        it(c, tok, seed=8).set_state(state)
    with pytest.raises(UserError, match=r"different data settings, .*, resume with the same data/tokenizer/"):
        it(c, tok, seed=8).set_state({k: v for k, v in state.items() if k != "process_count"})   # before the key
    it(c, tok, process_count=2).set_state(state)
