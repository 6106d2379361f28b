"""Worker processes for `launch prepare`: bounded submission, an orphan guard, and the parallel tokenizer learner.

Workers are spawned, never forked (the launcher has started JAX's threads before a command runs). Arguments and
results travel between our own processes through multiprocessing's pipes; nothing is stored that way.

Tokenizer learning (`learn`) keeps our deterministic WordPiece learner (`tokenizer.learn_wordpiece`) and spreads
its word counting over the workers. Measured on 100 MB of text, vocabulary 30522, this shared 2-core machine,
medians of 3 interleaved rounds (benchmarks/results_tokenizer_learning.json, RESULTS.md "Tokenizer learning"):
ours in one process 45.2 s / 320 MB peak RSS; the `tokenizers` WordPiece trainer 15.6 s / 428 MB. HF's trainer
is ~2.9x faster but needs ~1.34x the memory: neither is better on both counts, so ours stays, for its lower
peak memory and because it gives one vocabulary per text on any machine and in any run (HF's breaks ties by
hash-map order), so a repeated or resumed `prepare` is byte-identical. Counting is most of our time: spread over 2
workers here it took 37.6 s (22.7-39.9), at the price of the workers' own interpreters (808 MB for main + 2
workers; each spawned worker imports the data package), as many worker processes as the encoding stage then
starts.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
import time
from collections import Counter
from typing import Callable, Iterator

from tupe_jax.data.tokenizer import NUM_SPECIALS, SPECIALS, Tokenizer, _build, learn_wordpiece
from tupe_jax.errors import UserError

_STATE: dict = {}


def orphan_guard() -> None:
    """End this worker when the process that started it is gone (kill -9 would leave pool workers running)."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)   # pylint: disable=protected-access

    threading.Thread(target=watch, daemon=True).start()


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """While it lasts (main thread only), SIGTERM raises KeyboardInterrupt, so the pool's context ends its workers
    and the launcher says how to continue (the default handler ended the process with its workers left running and
    the semaphores of the pool leaked)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:  # pylint: disable=unused-argument
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def spawn_pool(num_workers: int, initializer: Callable = orphan_guard, initargs: tuple = ()):
    return multiprocessing.get_context("spawn").Pool(num_workers, initializer, initargs)


def bounded(pool, fn, items: Iterator[tuple[int, object]], num_workers: int) -> Iterator[tuple[int, object]]:
    """(key, fn(item)) for (key, item) in `items`, in order, with at most 2 items per worker in flight (the
    corpus is never held whole: `Pool.imap` would read all of `items` ahead). Items that are None are skipped."""
    pending: list = []
    for key, item in items:
        if item is not None:
            pending.append((key, pool.apply_async(fn, (item,))))
        while len(pending) >= 2 * num_workers:
            key0, res = pending.pop(0)
            yield key0, res.get()
    for key0, res in pending:
        yield key0, res.get()


def groups(docs: Iterator[str], group_bytes: int) -> Iterator[list[str]]:
    """Consecutive groups of documents of >= group_bytes characters (the last may be smaller)."""
    group, size = [], 0
    for doc in docs:
        group.append(doc)
        size += len(doc) + 1
        if size >= group_bytes:
            yield group
            group, size = [], 0
    if group:
        yield group


def count_words(docs: list[str]) -> Counter:
    """Word counts of some documents, exactly as `Tokenizer.train` counts them (BERT normaliser, pre-tokeniser)."""
    if "counter" not in _STATE:
        _STATE["counter"] = _build(None)
    hf = _STATE["counter"]
    counts: Counter = Counter()
    for doc in docs:
        for special in SPECIALS:
            doc = doc.replace(special, " ")
        counts.update(w for w, _ in hf.pre_tokenizer.pre_tokenize_str(hf.normalizer.normalize_str(doc)))
    return counts


def learn(docs: Iterator[str], vocab_size: int, num_workers: int, group_bytes: int = 8_000_000) -> Tokenizer:
    """`Tokenizer.train(docs, vocab_size)` with the counting spread over `num_workers` processes: the same
    vocabulary (counts add up in any order; the merge loop is deterministic)."""
    if vocab_size <= NUM_SPECIALS + 30:
        raise UserError(f"vocab_size {vocab_size} is too small", "config.model.vocab_size", "use at least 100")
    counts: Counter = Counter()
    with spawn_pool(num_workers) as pool:
        for _, part in bounded(pool, count_words, enumerate(groups(docs, group_bytes)), num_workers):
            counts.update(part)
    return Tokenizer(learn_wordpiece(counts, vocab_size))
