"""MLM masking: 15 %, 80/10/10, specials never masked, deterministic, dense == gather; packing helpers."""
import numpy as np

from tupe_jax.data import masking
from tupe_jax.data.tokenizer import CLS_ID, MASK_ID, PAD_ID, SEP_ID

V, L, P = 1000, 128, 20


def random_batch(rng, b=512):
    toks = rng.integers(5, V, size=(b, L)).astype(np.int32)
    toks[:, 0] = CLS_ID
    toks[rng.random((b, L)) < 0.05] = SEP_ID
    lengths = rng.integers(L // 2, L + 1, size=b)
    mask = (np.arange(L)[None] < lengths[:, None]).astype(np.int32)
    return np.where(mask > 0, toks, PAD_ID).astype(np.int32), mask


def run(toks, mask, seed=0, epoch=0, max_predictions=P):
    keys = masking.example_keys(seed, np.arange(len(toks)), np.full(len(toks), epoch))
    return masking.mask_tokens(toks, mask, keys, vocab_size=V, mask_prob=0.15, max_predictions=max_predictions)


def test_rate_and_80_10_10():
    toks, mask = random_batch(np.random.default_rng(0))
    out = run(toks, mask)
    cand = (mask > 0) & (toks >= 5)
    chosen = out.weights > 0
    assert not (chosen & ~cand).any()  # [CLS] [SEP] [PAD] (all ids < 5) never masked
    rate = chosen.sum() / cand.sum()
    assert abs(rate - 0.15) < 0.005
    n = cand.sum(1)
    np.testing.assert_array_equal(chosen.sum(1), np.minimum(np.floor(0.15 * n + 0.5), P))
    inp, tgt = out.inputs[chosen], out.targets[chosen]
    frac_mask = np.mean(inp == MASK_ID)
    frac_keep = np.mean(inp == tgt)
    frac_rand = 1 - frac_mask - frac_keep
    assert abs(frac_mask - 0.8) < 0.02 and abs(frac_keep - 0.1 - 1 / V * 0.1) < 0.015 and abs(frac_rand - 0.1) < 0.015
    assert (inp >= 5).sum() == (inp != MASK_ID).sum()  # random replacements are never special ids
    np.testing.assert_array_equal(out.inputs[~chosen], toks[~chosen])
    np.testing.assert_array_equal(out.targets, toks)


def test_dense_equals_gather_and_cap():
    toks, mask = random_batch(np.random.default_rng(1), b=64)
    for cap in (P, 5):
        out = run(toks, mask, max_predictions=cap)
        assert out.mlm_positions.shape == (64, cap)
        dense = np.zeros_like(out.weights)
        rows = np.arange(64)[:, None]
        np.add.at(dense, (np.broadcast_to(rows, out.mlm_positions.shape), out.mlm_positions),
                  out.mlm_weights)
        np.testing.assert_array_equal(dense, out.weights)
        w = out.mlm_weights > 0
        np.testing.assert_array_equal(out.mlm_labels[w], np.take_along_axis(toks, out.mlm_positions, 1)[w])
        assert (out.mlm_positions[~w] == 0).all() and (out.mlm_labels[~w] == 0).all()
        assert (np.diff(np.where(w, out.mlm_positions, L), axis=1) >= 0).all()  # ascending
    assert (run(toks, mask, max_predictions=5).weights.sum(1) <= 5).all()


def test_deterministic_per_example_seed_epoch():
    toks, mask = random_batch(np.random.default_rng(2), b=32)
    a, b = run(toks, mask, seed=3), run(toks, mask, seed=3)
    for k, v in a.present().items():
        np.testing.assert_array_equal(v, b.present()[k])
    assert not np.array_equal(run(toks, mask, seed=4).weights, a.weights)
    assert not np.array_equal(run(toks, mask, seed=3, epoch=1).weights, a.weights)
    # an example's mask does not depend on its batch neighbours
    keys = masking.example_keys(3, np.arange(32), np.zeros(32))
    sub = masking.mask_tokens(toks[5:9], mask[5:9], keys[5:9], vocab_size=V, mask_prob=0.15, max_predictions=P)
    np.testing.assert_array_equal(sub.inputs, a.inputs[5:9])


def test_full_sentence_packing():
    units = np.array([3, 4, 2, 10, 1, 6])
    starts = masking.full_sentence_starts(units, capacity=7)
    # [3+4] [2] [7 of 10] [3 of 10 + 1] [6]
    np.testing.assert_array_equal(starts, [0, 7, 9, 16, 20])
    ends = np.minimum(np.append(starts[1:], units.sum()), starts + 7)
    assert ((ends - starts) <= 7).all() and ends[-1] == units.sum()
    np.testing.assert_array_equal(masking.contiguous_starts(20, 5), [0, 5, 10, 15])
    np.testing.assert_array_equal(masking.contiguous_starts(21, 6, 5), [0, 5, 10, 15])
