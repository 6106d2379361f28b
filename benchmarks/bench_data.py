"""MLM input-pipeline throughput (host batches/s) on the embedded corpus; not a test.

    python benchmarks/bench_data.py [--batch 256] [--max_len 128] [--steps 300] [--threads 2] [--prefetch 4]

Builds (once) the embedded TFDS dataset, a WordPiece vocab and the token stream in a temporary cache, then
times `next()` on `pretrain_iterator` (global shuffle + gather + 15 % masking, both dense and gather forms) and
prints one Markdown table row.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time

import ml_collections

from tupe_jax import data as D

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from outputs import refuse_below  # noqa: E402  pylint: disable=wrong-import-position


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--max_len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefetch", type=int, default=4)
    ap.add_argument("--cache_dir", default="")
    args = ap.parse_args()
    refuse_below(args, steps=1, batch=1, max_len=2, threads=1, prefetch=0)

    with tempfile.TemporaryDirectory() as tmp:
        c = ml_collections.ConfigDict({"data": D.default_data_config(),
                                       "model": {"vocab_size": args.vocab, "max_len": args.max_len,
                                                 "objective": "mlm"}})
        c.data.cache_dir = args.cache_dir or os.path.join(tmp, "cache")
        c.data.prefetch, c.data.num_threads = args.prefetch, args.threads
        t0 = time.perf_counter()
        tok = D.get_tokenizer(c, None)
        it = D.pretrain_iterator(c, tok, split="train", global_batch_size=args.batch, seed=0, process_index=0,
                                 process_count=1)
        next(it)
        setup = time.perf_counter() - t0
        for _ in range(10):  # warm up the prefetch buffer
            next(it)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            next(it)
        dt = time.perf_counter() - t0
    rate = args.steps / dt
    print(f"| data (MLM, embedded) | batch {args.batch} × {args.max_len} | {rate:.0f} batches/s "
          f"({rate * args.batch * args.max_len / 1e6:.1f} M tokens/s) | {os.cpu_count()} CPU cores, "
          f"{args.threads} threads, prefetch {args.prefetch} | setup {setup:.1f} s | {platform.processor() or platform.machine()} |")


if __name__ == "__main__":
    main()
