"""Sentence(-pair) classification batches (GLUE, word order): `[CLS] a [SEP] b [SEP]`, longest-first truncation,
bucketed padding.

Batches are `batch.ClassificationBatch` (host-local NumPy; labels -1 on test splits, example_index = position in
`glue_examples(...)`, -1 and weight 0 on padding rows) of width Lb, the smallest bucket (`data.glue_buckets`, capped by
max_len) that holds the longest sequence of the *global* batch, so all processes agree on the shape.

Ordering: shuffle=True uses a permutation seeded by (seed, epoch); global batch k is rows [k·G, (k+1)·G) of
that order and process p takes rows p, p+P, ... of it. Training (shuffle) drops the incomplete last batch by
default; evaluation pads it with weight-0 rows so every example is evaluated exactly once.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from tupe_jax.data import builders
from tupe_jax.data.batch import ClassificationBatch
from tupe_jax.data.tokenizer import PAD_ID, Tokenizer
from tupe_jax.errors import UserError

DEFAULT_BUCKETS = (32, 64, 128, 256, 512)


def truncate_lengths(la: np.ndarray, lb: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """Longest-first truncation (remove one token from the longer side, ties from b) in closed form."""
    la, lb = np.asarray(la, np.int64), np.asarray(lb, np.int64)
    fits = la + lb <= budget
    a_only = lb + np.minimum(la, lb) <= budget  # cutting a alone reaches the budget while a stays ≥ b
    b_only = la + np.minimum(la, lb) <= budget
    half_a, half_b = (budget + 1) // 2, budget // 2
    ta = np.where(fits, la, np.where((la > lb) & a_only, budget - lb, np.where((lb >= la) & b_only, la, half_a)))
    tb = np.where(fits, lb, np.where((la > lb) & a_only, lb, np.where((lb >= la) & b_only, budget - la, half_b)))
    return ta, tb


@dataclasses.dataclass
class EncodedGlue:
    tokens: np.ndarray    # flat int32: every example's [CLS] a [SEP] (b [SEP])
    offsets: np.ndarray   # int64 (N+1,)
    labels: np.ndarray    # int32 or float32 (N,)
    num_truncated: int
    first_lengths: np.ndarray   # int64 (N,): tokens of [CLS] a [SEP] (segment 0; the whole example unless a pair)
    pad_id: int = PAD_ID  # the tokenizer's [PAD]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.labels)


_CACHE: dict[tuple, EncodedGlue] = {}


def encode_glue(tokenizer: Tokenizer, examples: list[dict], max_len: int, regression: bool) -> EncodedGlue:
    pair = any(e["sentence2"] for e in examples)
    a = tokenizer.encode_batch([e["sentence1"] for e in examples])
    b = tokenizer.encode_batch([e["sentence2"] for e in examples]) if pair else [[] for _ in examples]
    la = np.array([len(x) for x in a], np.int64)
    lb = np.array([len(x) for x in b], np.int64)
    seps = int(getattr(tokenizer, "pair_separators", 1))   # 2 for the fairseq tokenizer: <s> a </s> </s> b </s>
    budget = max_len - (2 + seps if pair else 2)
    if budget < 2:
        raise UserError(f"max_len {max_len} is too short for GLUE", "config.model.max_len", "use at least 8")
    ta, tb = truncate_lengths(la, lb, budget)
    seqs, cls, sep = [], tokenizer.cls_id, tokenizer.sep_id
    for x, y, na, nb in zip(a, b, ta.tolist(), tb.tolist()):
        seqs.append([cls] + x[:na] + [sep] + (([sep] * (seps - 1) + y[:nb] + [sep]) if pair else []))
    lens = np.array([len(s) for s in seqs], np.int64)
    flat = np.fromiter((t for s in seqs for t in s), np.int32, int(lens.sum()))
    labels = np.array([e["label"] for e in examples], np.float32 if regression else np.int32)
    return EncodedGlue(flat, np.concatenate([[0], np.cumsum(lens)]), labels,
                       int(np.sum((ta < la) | (tb < lb))), ta + 2, tokenizer.pad_id)


def encoded_split(config, tokenizer: Tokenizer, task: str, split: str, max_len: int) -> EncodedGlue:
    """Encoded examples of a split, cached in-process."""
    source = builders.glue_source_name(config, task)
    key = (source, config.data.get("glue_dir", ""), builders.cache_dir(config).as_posix(), task, split,
           tokenizer.fingerprint, max_len)
    if key not in _CACHE:
        examples = builders.glue_examples(config, task, split)
        if not examples:
            raise UserError(f"GLUE {task} {split} has no examples", "glue split", "check the GLUE files")
        _CACHE[key] = encode_glue(tokenizer, examples, max_len, task == "stsb")
        if _CACHE[key].num_truncated:    # the paper's protocol too (max length 512), but say how many
            print(f"data: {task} {split}: {_CACHE[key].num_truncated} of {len(examples)} examples cut to max_len "
                  f"{max_len} tokens", flush=True)
        if len(_CACHE) > 16:
            _CACHE.pop(next(iter(_CACHE)))
    return _CACHE[key]


def batch_widths(config, max_len: int) -> tuple[int, ...]:
    """Every padded width a GLUE batch can take: the `data.glue_buckets` up to max_len, and max_len itself."""
    buckets = tuple(config.data.get("glue_buckets", DEFAULT_BUCKETS)) or (max_len,)
    bad = [b for b in buckets if int(b) < 3]
    if bad:   # [CLS] x [SEP] needs 3 positions; a smaller width would cut every example
        raise UserError(f"data.glue_buckets = {tuple(buckets)} holds {bad[0]}, below 3", "--config.data.glue_buckets",
                        "give padded widths of at least 3, e.g. '(32,64,128)', or '()' for max_len only")
    return tuple(sorted({int(b) for b in buckets if int(b) <= max_len} | {max_len}))


def bucket_length(longest: int, buckets, max_len: int) -> int:
    for b in sorted(int(x) for x in buckets):
        if longest <= b <= max_len:
            return b
    return max_len


class GlueBatches:
    """One pass over a GLUE split; `len()` is the number of batches."""

    def __init__(self, enc: EncodedGlue, *, batch_size: int, max_len: int, buckets, shuffle: bool, seed: int,
                 epoch: int, drop_remainder: bool, process_index: int, process_count: int):
        if batch_size <= 0 or batch_size % process_count:
            raise UserError(f"batch size {batch_size} is not a positive multiple of {process_count} processes",
                            "batch_size", f"use a multiple of {process_count}")
        self.enc, self.max_len, self.buckets = enc, max_len, buckets
        self.global_batch, self.p, self.pc = batch_size, process_index, process_count
        n = len(enc)
        order = np.random.default_rng([seed, epoch, 0x61E]).permutation(n) if shuffle else np.arange(n)
        steps = n // batch_size if drop_remainder else math.ceil(n / batch_size)
        padded = np.full(steps * batch_size, -1, np.int64)
        take = min(n, len(padded))
        padded[:take] = order[:take]
        self.order = padded.reshape(steps, batch_size)

    def __len__(self) -> int:
        return len(self.order)

    def __iter__(self):
        lens = self.enc.lengths
        for row in self.order:
            real_all = row >= 0
            longest = int(lens[row[real_all]].max()) if real_all.any() else 1
            width = bucket_length(longest, self.buckets, self.max_len)
            idx = row[self.p::self.pc]
            real = idx >= 0
            safe = np.where(real, idx, 0)
            starts = self.enc.offsets[safe]
            ln = np.where(real, lens[safe], 0)
            offs = np.arange(width)[None, :]
            mask = offs < ln[:, None]
            toks = self.enc.tokens[np.minimum(starts[:, None] + offs, len(self.enc.tokens) - 1)]
            first = np.where(real, self.enc.first_lengths[safe], 0)
            yield ClassificationBatch(
                inputs=np.where(mask, toks, self.enc.pad_id).astype(np.int32), input_mask=mask.astype(np.int32),
                segments=(mask & (offs >= first[:, None])).astype(np.int32),
                label=np.where(real, self.enc.labels[safe], self.enc.labels.dtype.type(0)).astype(
                    self.enc.labels.dtype),
                example_index=np.where(real, idx, -1).astype(np.int32), example_weight=real.astype(np.float32))


def glue_batches(config, tokenizer: Tokenizer, task: str, split: str, *, batch_size: int, seed: int = 0,
                 epoch: int = 0, shuffle: bool | None = None, drop_remainder: bool | None = None,
                 process_index: int | None = None, process_count: int | None = None,
                 max_len: int | None = None) -> GlueBatches:
    """One epoch of host-local batches of a GLUE (or `wordorder`) split; `batch_size` is global.

    shuffle defaults to split == 'train'; drop_remainder defaults to shuffle. max_len defaults to
    config.model.max_len.
    """
    if process_index is None or process_count is None:
        import jax
        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    max_len = int(max_len or config.model.max_len)
    shuffle = (split == "train") if shuffle is None else shuffle
    drop_remainder = shuffle if drop_remainder is None else drop_remainder
    enc = encoded_split(config, tokenizer, task, split, max_len)
    return GlueBatches(enc, batch_size=batch_size, max_len=max_len, buckets=batch_widths(config, max_len),
                       shuffle=shuffle, seed=seed, epoch=epoch, drop_remainder=drop_remainder,
                       process_index=process_index, process_count=process_count)
