"""grain pretraining pipelines: MLM/CLM batch layout, resume from saved state, process sharding."""
import json

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
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_mlm_batch_layout(setup):
    c, tok = setup
    b = next(it(c, tok))
    shapes = {k: (v.shape, v.dtype.name) for k, v in b.items()}
    assert shapes == {"inputs": ((8, 32), "int32"), "input_mask": ((8, 32), "int32"), "targets": ((8, 32), "int32"),
                      "weights": ((8, 32), "float32"), "mlm_positions": ((8, 5), "int32"),
                      "mlm_labels": ((8, 5), "int32"), "mlm_weights": ((8, 5), "float32")}
    assert (b["inputs"][:, 0] == tok.cls_id).all() and (b["targets"][:, 0] == tok.cls_id).all()
    assert (b["weights"][:, 0] == 0).all()
    assert (b["targets"][b["input_mask"] == 0] == tok.pad_id).all()
    assert (b["targets"][:, 1:] != tok.cls_id).all()


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
        g, h0, h1 = next(whole), next(hosts[0]), next(hosts[1])
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
    real = sum(int((x["input_mask"].sum(1) > 0).sum()) for x in batches)
    assert real == ev.num_examples
    last = batches[-1]
    pad_rows = last["input_mask"].sum(1) == 0
    assert (last["weights"][pad_rows] == 0).all() and (last["mlm_weights"][pad_rows] == 0).all()


def test_clm_stream(setup):
    c, tok = setup
    c = ml_collections.ConfigDict(c.to_dict())
    c.model.objective = "clm"
    batches = list(it(c, tok, shuffle=False, repeat=False, global_batch_size=4))
    b = batches[0]
    assert set(b) == {"inputs", "targets", "weights"} and b["inputs"].shape == (4, 32)
    np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
    np.testing.assert_array_equal(b["targets"][0, -1], b["inputs"][1, 0])  # windows overlap by one token
    assert (b["inputs"] != tok.cls_id).all() and (b["inputs"] == tok.sep_id).any()
    # every token after the first is a weighted target exactly once
    targets = np.concatenate([x["targets"][x["weights"] > 0] for x in batches])
    docs = D.load_documents(c, "validation")
    stream = []
    for d in docs:
        for ids in tok.encode_batch(d.split("\n")):
            stream += ids
        stream.append(tok.sep_id)
    np.testing.assert_array_equal(targets, stream[1:])


def test_full_sentences_packing_keeps_lines_whole(setup):
    c, tok = setup
    b = next(it(c, tok, shuffle=False))
    docs = D.load_documents(c, "validation")
    first_doc = tok.encode(docs[0].split("\n")[0])
    if len(first_doc) <= 31:  # the first block starts with the first sentence, whole
        np.testing.assert_array_equal(b["targets"][0, 1:1 + len(first_doc)], first_doc)


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
