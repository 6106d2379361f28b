"""Packing and MLM masking as pure NumPy functions of their inputs.

Randomness comes from a counter-based hash (SplitMix64 finaliser) of (seed, epoch, example index, position,
stream), so the mask of an example depends only on (seed, example index, epoch) — not on batch composition,
host count, threads or resume point — and a whole batch is masked in a few vectorised NumPy calls.

MLM rule for one sequence with n candidate positions (real tokens that are not special ids: the five, and
reserved "[...]" tokens such as BERT's [unusedN]; `special_ids`/`mask_id`/`cls_id`/`pad_id` default to a
vocabulary trained here, [PAD]..[MASK] = 0..4, and a loaded vocabulary passes its tokenizer's):
  k = min(floor(mask_prob · n + 0.5), max_predictions) positions are chosen — the first k of a uniformly random
  permutation of the candidates (i.e. the k candidates with the smallest hash keys). When mask_prob·n would
  exceed max_predictions, the sequence is simply masked at max_predictions positions (fewer than mask_prob);
  the dense `weights` and the gather form always describe exactly the same positions.
  Each chosen position becomes [MASK] with prob 0.8, a uniformly random non-special id with prob 0.1, and
  keeps its token with prob 0.1. Targets are the original ids everywhere; weights are 1.0 at chosen positions.
"""
from __future__ import annotations

import numpy as np

from tupe_jax.data.batch import LMBatch
from tupe_jax.data.tokenizer import CLS_ID, MASK_ID, NUM_SPECIALS, PAD_ID

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLD = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser, elementwise on uint64 (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def example_keys(seed: int, index: np.ndarray, epoch: np.ndarray) -> np.ndarray:
    """One 64-bit key per example from (seed, global example index, epoch)."""
    with np.errstate(over="ignore"):
        s = _mix(np.full(np.shape(index), np.uint64(seed & 0xFFFFFFFFFFFFFFFF)) + _GOLD)
        e = _mix(s ^ (np.asarray(epoch).astype(np.uint64) + _GOLD))
        return _mix(e ^ (np.asarray(index).astype(np.uint64) * _GOLD + np.uint64(1)))


def position_bits(keys: np.ndarray, length: int, stream: int) -> np.ndarray:
    """(B, length) uint64 hash bits for each example key, position and stream number."""
    pos = np.arange(length, dtype=np.uint64) + np.uint64(1 + stream * 1_000_003)
    with np.errstate(over="ignore"):
        return _mix(keys[:, None] + pos[None, :] * _GOLD)


def uniform(bits: np.ndarray) -> np.ndarray:
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def mask_tokens(tokens: np.ndarray, input_mask: np.ndarray, keys: np.ndarray, *, vocab_size: int,
                mask_prob: float, max_predictions: int, special_ids: tuple[int, ...] = tuple(range(NUM_SPECIALS)),
                mask_id: int = MASK_ID) -> dict[str, np.ndarray]:
    """Mask a (B, L) batch; see the module docstring. `keys` from `example_keys`."""
    b, length = tokens.shape
    p = max_predictions
    cand = (input_mask > 0) & ~np.isin(tokens, special_ids)
    n = cand.sum(axis=1)
    k = np.minimum(np.floor(mask_prob * n + 0.5).astype(np.int64), p)
    prio = np.where(cand, uniform(position_bits(keys, length, 0)), 2.0)
    order = np.argsort(prio, axis=1, kind="stable")[:, :p]           # candidates in random order
    if order.shape[1] < p:                                            # L < P: pad the slots
        order = np.pad(order, ((0, 0), (0, p - order.shape[1])))
    valid = np.arange(p)[None, :] < k[:, None]
    positions = np.sort(np.where(valid, order, length), axis=1)      # chosen positions ascending, then L
    valid = positions < length
    positions = np.where(valid, positions, 0)

    rows = np.arange(b)[:, None]
    chosen = np.zeros((b, length), bool)
    vr, vs = np.nonzero(valid)
    chosen[vr, positions[vr, vs]] = True
    weights = chosen.astype(np.float32)

    r = uniform(position_bits(keys, length, 1))
    ordinary = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), special_ids)   # 5..V-1 in our own layout
    random_tok = ordinary[(position_bits(keys, length, 2) % np.uint64(len(ordinary))).astype(np.int64)]
    masked = np.where(r < 0.8, mask_id, np.where(r < 0.9, random_tok, tokens))
    inputs = np.where(chosen, masked, tokens).astype(np.int32)
    return LMBatch(inputs=inputs, input_mask=input_mask.astype(np.int32), targets=tokens.astype(np.int32),
                   weights=weights, mlm_positions=positions.astype(np.int32),
                   mlm_labels=np.where(valid, tokens[rows, positions], 0).astype(np.int32),
                   mlm_weights=valid.astype(np.float32))


# ------------------------------------------------------------------------------------------------ packing

def full_sentence_starts(unit_lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Block start offsets for FULL-SENTENCES packing (fairseq `--sample-break-mode complete`).

    Units (sentences; the document [SEP] is part of the last unit of a document) are added to a block while
    they fit in `capacity` tokens; a unit that does not fit starts a new block; a unit longer than `capacity`
    is cut into capacity-sized pieces (the only case where a sentence is split). Returns int64 starts into the
    concatenated stream; block i spans [starts[i], starts[i+1]) (the last ends at the stream end).
    """
    starts: list[int] = []
    offset = 0
    used = capacity  # force a new block at the first unit
    for n in unit_lengths.tolist():
        if n <= 0:
            continue
        if used + n <= capacity:
            used += n
        elif n <= capacity:
            starts.append(offset)
            used = n
        else:
            pieces = -(-n // capacity)
            starts.extend(offset + capacity * j for j in range(pieces))
            used = n - capacity * (pieces - 1)
        offset += n
    return np.asarray(starts, np.int64)


def contiguous_starts(total: int, capacity: int, stride: int | None = None) -> np.ndarray:
    """Starts of fixed windows: every `stride` (default `capacity`) tokens over a stream of `total` tokens."""
    stride = stride or capacity
    return np.arange(0, max(total - (capacity - stride), 1), stride, dtype=np.int64)


def gather_windows(stream: np.ndarray, starts: np.ndarray, ends: np.ndarray, width: int,
                   pad_id: int = PAD_ID) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, valid) of shape (B, width): stream[start:end] left-aligned, [PAD] after `end`."""
    offs = np.arange(width, dtype=np.int64)[None, :]
    idx = starts[:, None] + offs
    valid = idx < ends[:, None]
    tokens = np.asarray(stream[np.minimum(idx, len(stream) - 1)]).astype(np.int32)
    return np.where(valid, tokens, pad_id).astype(np.int32), valid


def add_cls(tokens: np.ndarray, valid: np.ndarray, cls_id: int = CLS_ID) -> tuple[np.ndarray, np.ndarray]:
    b = tokens.shape[0]
    cls = np.full((b, 1), cls_id, np.int32)
    return np.concatenate([cls, tokens], 1), np.concatenate([np.ones((b, 1), bool), valid], 1)
