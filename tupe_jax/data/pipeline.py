"""Pretraining batches (MLM / CLM) as a checkpointable grain pipeline.

1. Each split is tokenized once into a flat int32 stream — sentence (line) after sentence, [SEP] after every
   document — cached as .npy under `<cache_dir>/streams/<corpus>/` keyed by the tokenizer fingerprint, plus the
   cumulative ends of the sentences (the packing units). Later runs memory-map it.
2. Examples are windows of that stream: MLM — FULL-SENTENCES blocks of ≤ L−1 tokens (`data.packing=
   'full_sentences'`; or `'contiguous'` fixed cuts) with [CLS] prepended, so [CLS] is at index 0 and documents
   are separated by [SEP]; CLM — windows of L+1 tokens every L tokens (inputs = w[:-1], targets = w[1:]), so
   every token after the first is predicted exactly once. The last window may be short: it is padded with [PAD]
   (input_mask/weights 0), never dropped.
3. Global ordinal o (0, 1, 2, ... over all epochs) → epoch e = o // n, example = perm_e[o % n], perm_e a
   seeded permutation of all n examples (global shuffle; identity with shuffle=False). Process p of P takes
   ordinals p, p+P, p+2P, ... (`[p::P]`) and batches B = global_batch / P of them, so step s of all processes
   together is exactly ordinals [s·G, (s+1)·G). A `grain.MapDataset` over step numbers builds each batch with
   vectorised NumPy (gather + mask, masking keyed by (seed, example, epoch)); `to_iter_dataset` prefetches.
   repeat=False: one pass; the last step is filled with padding rows (all weights 0) so every example is seen
   exactly once and all processes take the same number of steps.
   A prepared directory (`data.name=prepared`, `launch prepare`) replaces 1–2: its records are the examples
   (`prepared.PreparedSplit.rows` reads only the records of this process's rows); 3–4 are the same code.
4. The iterator's `get_state()` is grain's `{next_index}` plus a fingerprint of the settings (the corpus keyed by
   its files' content, so a copy with new mtimes is the same corpus); `set_state` of a fresh pipeline with the
   same settings continues with exactly the batches that would have come next. States saved by data format 1
   (files keyed by mtime) are accepted while those files are untouched. A state saved with another process count P'
   is accepted too: the step's ordinals are the same [s·G, (s+1)·G), so the run goes on with the same examples in
   the same steps, and only their rows in the global batch move (a process's rows come first as a block), which
   moves dropout masks between examples: the continuation is not bitwise the one on P' processes.
"""
from __future__ import annotations

import itertools
import logging
import math
import os
import threading
from typing import Callable

import grain
import numpy as np

from tupe_jax.data import builders, masking, prepared
from tupe_jax.data.batch import LMBatch
from tupe_jax.data.tokenizer import Tokenizer
from tupe_jax.errors import UserError

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------ token streams

def _encode_documents(docs, tokenizer: Tokenizer, chunk: int = 4096):
    """Yield (tokens int32, unit_lengths int64) per chunk of documents; [SEP] ends every document."""
    buf: list[str] = []

    def flush(buf):
        units, last = [], []
        for doc in buf:
            lines = [ln for ln in doc.split("\n") if ln.strip()] or [""]
            units.extend(lines)
            last.extend([False] * (len(lines) - 1) + [True])
        enc = tokenizer.encode_batch(units)
        sizes = np.fromiter(map(len, enc), np.int64, len(enc))
        flat = np.fromiter(itertools.chain.from_iterable(enc), np.int32, int(sizes.sum()))
        last = np.asarray(last, bool)
        toks = np.insert(flat, np.cumsum(sizes)[last], np.int32(tokenizer.sep_id))   # [SEP] ends each document
        return toks, sizes + last

    for doc in docs:
        buf.append(doc)
        if len(buf) >= chunk:
            yield flush(buf)
            buf = []
    if buf:
        yield flush(buf)


def token_stream(config, tokenizer: Tokenizer, split: str) -> tuple[np.ndarray, np.ndarray]:
    """(tokens int32 memmap, unit_ends int64) of a split; built once per (corpus, split, tokenizer)."""
    key, _ = builders.corpus_fingerprint(config, split)
    root = builders.cache_dir(config) / "streams" / key
    tok_path = root / f"{split}.{tokenizer.fingerprint}.tokens.npy"
    unit_path = root / f"{split}.{tokenizer.fingerprint}.units.npy"
    if not (tok_path.is_file() and unit_path.is_file()):
        with builders.file_lock(root / f"{split}.{tokenizer.fingerprint}.lock"):
            if not (tok_path.is_file() and unit_path.is_file()):
                parts = list(_encode_documents(builders.iter_documents(config, split), tokenizer))
                toks = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int32)
                ends = np.cumsum(np.concatenate([p[1] for p in parts])) if parts else np.zeros(0, np.int64)
                for path, arr in ((unit_path, ends.astype(np.int64)), (tok_path, toks.astype(np.int32))):
                    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.npy")
                    np.save(tmp, arr)
                    os.replace(tmp, path)
                log.info("data: tokenized %s/%s: %d tokens in %d sentences", key, split, len(toks), len(ends))
    try:
        toks = np.load(tok_path, mmap_mode="r")
        ends = np.load(unit_path)
    except (ValueError, OSError, EOFError) as err:
        raise UserError(f"the cached token stream {tok_path.parent} is damaged ({err})", str(tok_path.parent),
                        f"delete {tok_path.parent} (it is rebuilt from the corpus)") from None
    if len(toks) == 0:
        raise UserError(f"split {split!r} of data.name={config.data.get('name')} has no text", str(tok_path.parent),
                        "check data.path / data.holdout (a holdout larger than the number of documents is empty)")
    return toks, ends


def example_windows(config, stream_len: int, unit_ends: np.ndarray, objective: str, max_len: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of every example in the stream (see the module docstring)."""
    if objective == "clm":
        starts = masking.contiguous_starts(stream_len, max_len + 1, max_len)
        return starts, np.minimum(starts + max_len + 1, stream_len)
    cap = max_len - 1
    packing = config.data.get("packing", "full_sentences")
    if packing == "full_sentences":
        starts = masking.full_sentence_starts(np.diff(unit_ends, prepend=0), cap)
    elif packing == "contiguous":
        starts = masking.contiguous_starts(stream_len, cap)
    else:
        raise UserError(f"unknown data.packing {packing!r}", "config.data.packing",
                        "use 'full_sentences' or 'contiguous'")
    return starts, np.minimum(np.append(starts[1:], stream_len), starts + cap)


# ----------------------------------------------------------------------------------------------- batches

class StreamRows:
    """Examples as windows [starts[i], ends[i]) of one token stream (the corpora tokenized in the cache)."""

    def __init__(self, stream, starts, ends):
        self.stream, self.starts, self.ends = stream, starts, ends
        self.n = len(starts)

    def rows(self, index: np.ndarray, real: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, valid) of shape (B, width) for examples `index` where `real` (other rows: empty windows)."""
        starts = self.starts[index]
        ends = np.where(real, self.ends[index], starts)  # padding rows: empty window
        return masking.gather_windows(self.stream, starts, ends, width)


class _Batcher:
    """Step number → host-local batch (a pure function of the settings).

    `source.rows(index, real, width)` gives the token rows of examples (`StreamRows`, or a prepared directory's
    `prepared.PreparedSplit`, which reads only those records); `source.n` is the number of examples."""

    def __init__(self, source, *, objective, max_len, vocab_size, mask_prob, max_predictions,
                 global_batch, process_index, process_count, seed, shuffle, repeat, tokenizer: Tokenizer):
        self.source = source
        # the vocabulary's own special ids ([PAD] 0 ... [MASK] 4 here; [CLS] 101 etc. in an imported BERT vocab)
        self.pad_id, self.cls_id = tokenizer.pad_id, tokenizer.cls_id
        self.special_ids, self.mask_id = tokenizer.special_ids, tokenizer.mask_id
        self.n = source.n
        self.objective, self.max_len, self.vocab_size = objective, max_len, vocab_size
        self.mask_prob, self.max_predictions = mask_prob, max_predictions
        self.p, self.pc = process_index, process_count
        self.local = global_batch // process_count
        self.global_batch, self.seed, self.shuffle, self.repeat = global_batch, seed, shuffle, repeat
        self._perms: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()
        self.num_steps = None if repeat else math.ceil(self.n / global_batch)

    def _perm(self, epoch: int) -> np.ndarray:
        with self._lock:
            if epoch not in self._perms:
                if len(self._perms) >= 3:
                    self._perms.pop(min(self._perms))
                rng = np.random.default_rng([self.seed, epoch, 0x5EED])
                self._perms[epoch] = rng.permutation(self.n)
            return self._perms[epoch]

    def examples(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(example index or -1 for padding, epoch) of each row of this host's batch at `step`."""
        ordinals = (step * self.local + np.arange(self.local, dtype=np.int64)) * self.pc + self.p
        epochs = ordinals // self.n
        pos = ordinals % self.n
        index = pos.copy()
        if self.shuffle:
            for e in np.unique(epochs):
                sel = epochs == e
                index[sel] = self._perm(int(e))[pos[sel]]
        if not self.repeat:
            index = np.where(ordinals < self.n, index, -1)
        return index, epochs

    def __call__(self, step: int) -> LMBatch:
        index, epochs = self.examples(int(step))
        real = index >= 0
        safe = np.where(real, index, 0)
        if self.objective == "clm":
            win, valid = self.source.rows(safe, real, self.max_len + 1)
            win = np.where(valid, win, self.pad_id).astype(win.dtype)
            return LMBatch(inputs=win[:, :-1], targets=win[:, 1:], weights=valid[:, 1:].astype(np.float32))
        toks, valid = self.source.rows(safe, real, self.max_len - 1)
        toks, valid = masking.add_cls(toks, valid, self.cls_id)
        valid &= real[:, None]
        toks = np.where(valid, toks, self.pad_id)
        keys = masking.example_keys(self.seed, safe, epochs)
        return masking.mask_tokens(toks, valid.astype(np.int32), keys, vocab_size=self.vocab_size,
                                   mask_prob=self.mask_prob, max_predictions=self.max_predictions,
                                   special_ids=self.special_ids, mask_id=self.mask_id)


class PretrainIterator(grain.DatasetIterator):
    """Batches of one process; `get_state()`/`set_state()` checkpoint it (also via grain's Orbax handler)."""

    def __init__(self, parent: grain.DatasetIterator, batcher: _Batcher,
                 fingerprints: Callable[..., tuple[str, ...]], corpus_key: str = "",
                 text_differs: Callable[[str], UserError] = lambda saved: UserError("the data read is not the run's")):
        super().__init__(parent)
        # (process count[, another text's key]) -> the keys of these settings on that many processes: the current
        # one first, then the same settings as an older data format keyed them
        self.batcher, self.fingerprints = batcher, fingerprints
        self.corpus_key, self.text_differs = corpus_key, text_differs   # the text's key; the error (given the saved key)
        self.fingerprint = fingerprints(batcher.pc)[0]
        self.saved_process_count = batcher.pc   # set_state: the count of the processes that saved the state
        self.per_host_batch_size = batcher.local
        self.num_examples = batcher.n
        self.num_steps = batcher.num_steps  # None when repeating forever

    def __next__(self) -> LMBatch:
        return next(self._parent)

    def get_state(self) -> dict:
        return {"pipeline": self._parent.get_state(), "fingerprint": self.fingerprint,
                "process_count": self.batcher.pc, "corpus": self.corpus_key}

    def set_state(self, state: dict) -> None:
        saved, now = state.get("process_count"), self.batcher.pc
        if not (isinstance(saved, int) and saved > 0):     # saved before the key: the count its key was made with
            saved = next((c for c in [now, *range(1, MAX_PROCESSES + 1)]
                          if state.get("fingerprint") in self.fingerprints(c)), now)
        self.saved_process_count = saved
        if state.get("fingerprint") not in self.fingerprints(saved):
            other = state.get("corpus")
            if isinstance(other, str) and other != self.corpus_key and \
                    state.get("fingerprint") in self.fingerprints(saved, other):
                raise self.text_differs(other)
            if saved != now:
                raise UserError(f"the saved data-iterator state is of a run with {_processes(saved)} and other data "
                                f"settings; this one has {_processes(now)}", "checkpoint data-iterator state",
                                "resume with the same data/tokenizer/batch/seed settings, or start a new workdir")
            raise UserError("the saved data-iterator state belongs to different data settings",
                            "checkpoint data-iterator state",
                            "resume with the same data/tokenizer/batch/seed settings, or start a new workdir")
        if saved != now:
            log.warning("data: the checkpoint was saved by %s, this run has %s: the next steps read the same "
                        "examples, in another row order of the global batch (the continuation is not bitwise the "
                        "one on %s)", _processes(saved), _processes(now), _processes(saved))
        self._parent.set_state(state["pipeline"])


MAX_PROCESSES = 4096   # the process counts tried for a state saved without its count (before session 38)


def _processes(count: int) -> str:
    return f"{count} process" + ("" if count == 1 else "es")


def resolve_max_predictions(config, max_len: int) -> int:
    p = int(config.data.get("max_predictions", 0))
    mask_prob = float(config.data.get("mask_prob", 0.15))
    return p if p > 0 else max(1, math.ceil(mask_prob * max_len))


def pretrain_iterator(config, tokenizer: Tokenizer, *, split: str, global_batch_size: int, seed: int,
                      process_index: int | None = None, process_count: int | None = None,
                      shuffle: bool = True, repeat: bool = True) -> PretrainIterator:
    """Iterator of host-local MLM or CLM batches (`config.model.objective`, length `config.model.max_len`).

    process_index/process_count default to jax.process_index()/jax.process_count().
    """
    if process_index is None or process_count is None:
        import jax
        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    objective = config.model.get("objective", "mlm")
    max_len = int(config.model.max_len)
    if objective not in ("mlm", "clm"):
        raise UserError(f"unknown model.objective {objective!r}", "config.model.objective", "use mlm or clm")
    if global_batch_size <= 0 or global_batch_size % process_count:
        raise UserError(f"global batch {global_batch_size} is not a positive multiple of {process_count} processes",
                        "config.train.batch_size", f"use a multiple of {process_count}")
    if max_len < 2:
        raise UserError(f"model.max_len {max_len} is too small", "config.model.max_len", "use at least 8")
    if config.data.get("name") == "prepared":
        source = prepared.open_split(config, split)
        key, legacy = source.key, ""
    else:
        stream, unit_ends = token_stream(config, tokenizer, split)
        source = StreamRows(stream, *example_windows(config, len(stream), unit_ends, objective, max_len))
        key, legacy = builders.resume_keys(config, split)
    mask_prob = float(config.data.get("mask_prob", 0.15))
    max_pred = resolve_max_predictions(config, max_len)
    batcher = _Batcher(source, objective=objective, max_len=max_len, tokenizer=tokenizer,
                       vocab_size=tokenizer.vocab_size, mask_prob=mask_prob, max_predictions=max_pred,
                       global_batch=global_batch_size, process_index=process_index, process_count=process_count,
                       seed=int(seed), shuffle=shuffle, repeat=repeat)
    if repeat and batcher.n < global_batch_size:
        log.warning("data: %d examples but a global batch of %d: examples repeat within a batch", batcher.n,
                    global_batch_size)
    steps = np.iinfo(np.int64).max if repeat else batcher.num_steps
    ds = grain.MapDataset.range(steps).map(batcher)
    prefetch = int(config.data.get("prefetch", 4))
    threads = int(config.data.get("num_threads", 2)) if prefetch > 0 else 0
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=prefetch)).__iter__()

    def fingerprints(count: int, text: str = key) -> tuple[str, ...]:   # these settings on `count` processes
        rest = [split, tokenizer.fingerprint, objective, max_len, global_batch_size, count, int(seed), shuffle, repeat,
                mask_prob, max_pred, config.data.get("packing", "full_sentences")]
        return (builders.digest([text] + rest),) + ((builders.digest([legacy] + rest),) if legacy and text == key
                                                     else ())

    return PretrainIterator(it, batcher, fingerprints, key, lambda saved: _text_differs(config, saved))


def _text_differs(config, saved: str) -> UserError:
    """The refusal of a state saved over the text keyed `saved` (a `builders.resume_key`), not this text."""
    path = config.data.get("path", "")
    if saved and saved == builders.key_before_newline_only(config):   # the same files, cut into lines another way
        return UserError("the text's lines are not the ones this run trained on: files under data.path hold line "
                         "breaks other than newlines (U+2028, a form feed, ...), which versions before 2026-12-07 "
                         "also cut lines at", f"data.path={path}",
                         "start a new workdir, or finish this run with the version it started with")
    return UserError(f"the {'prepared data' if config.data.get('name') == 'prepared' else 'text'} read is not the one "
                     "this run trained on (its content key differs from the one its checkpoint's data-iterator state "
                     "saved)", f"data.path={path}" if path else f"data.name={config.data.get('name')}",
                     "point data.path at the run's text (a copy of it anywhere resumes), or start a new workdir" if path
                     else "resume with the corpus this run trained on, or start a new workdir")


def check_saved_text(config, state: dict) -> None:
    """Refuse a data-iterator state saved over other training text, before the text is tokenized (`PretrainIterator
    .set_state` refuses it too, once the iterator is built: at corpus scale, an hour later). A state saved before
    it kept the text's key is left to set_state."""
    saved = state.get("corpus") if isinstance(state, dict) else None
    if not isinstance(saved, str):
        return
    now = prepared.open_split(config, "train").key if config.data.get("name") == "prepared" else \
        builders.resume_key(config, "train")
    if now != saved:
        raise _text_differs(config, saved)
