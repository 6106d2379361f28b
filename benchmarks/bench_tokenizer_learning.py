"""Tokenizer learning at corpus scale: our deterministic WordPiece learner vs the `tokenizers` WordPiece trainer.

    python benchmarks/bench_tokenizer_learning.py --text /work/shared/data/wikitext-2/train.txt --mb 100 \
        --vocab 30522 --rounds 3 --json benchmarks/results_tokenizer_learning.json

The same `--mb` MB of text (the file repeated until that size; repetition keeps the distinct words of the file,
so the merge phase is as for the file and the counting phase scales with the bytes) is learned by each method
in a fresh child process; wall time, the child's peak RSS (ru_maxrss) and the peak of its RSS plus its
workers' (sampled every 20 ms) are recorded. Methods: `ours` = `Tokenizer.train` (one core), `ours_parallel` =
`pool.learn` with 2 worker processes (what `launch prepare` runs), `hf` = `tokenizers.trainers.WordPieceTrainer`
(its own threads, here 2 cores). Rounds interleave the methods so a load change on this shared machine hits all;
the JSON holds every round and the medians with their spread (min..max).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from outputs import refuse_below, refuse_missing_folder, write_json  # noqa: E402  pylint: disable=wrong-import-position

CHILD = r"""
import json, resource, sys, time
method, path, mb, vocab = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
text = open(path, encoding="utf-8").read().splitlines()
limit, lines, n = int(mb * 1e6), [], 0
while n < limit:
    for ln in text:
        lines.append(ln)
        n += len(ln) + 1
        if n >= limit:
            break
def chunks(step=1000):
    for i in range(0, len(lines), step):
        yield "\n".join(lines[i:i + step])
import threading, psutil
tree_peak, stop = [0], threading.Event()
def sample():   # RSS of this process plus its worker processes, every 20 ms
    me = psutil.Process()
    while not stop.is_set():
        try:
            tree_peak[0] = max(tree_peak[0], me.memory_info().rss + sum(c.memory_info().rss for c in me.children(True)))
        except psutil.Error:
            pass
        time.sleep(0.02)
threading.Thread(target=sample, daemon=True).start()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
if method == "ours":
    from tupe_jax.data.tokenizer import Tokenizer
    size = Tokenizer.train(chunks(), vocab).vocab_size
elif method == "ours_parallel":
    from tupe_jax.data.pool import learn   # (tupe_jax.data.prepare.learn when the JSON was recorded: same code)
    size = learn(chunks(), vocab, 2, 2_000_000).vocab_size
else:
    from tokenizers import trainers
    from tupe_jax.data.tokenizer import SPECIALS, _build
    tok = _build(None)
    tok.train_from_iterator(chunks(), trainers.WordPieceTrainer(vocab_size=vocab, special_tokens=list(SPECIALS),
                                                                show_progress=False))
    size = tok.get_vocab_size()
dt = time.perf_counter() - t0
stop.set()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"method": method, "seconds": dt, "peak_rss_mb": peak / 1024, "rss_before_mb": base / 1024,
                  "peak_tree_rss_mb": tree_peak[0] / 2**20,
                  "text_bytes": n, "vocab": size}))
"""


METHODS = ("ours", "ours_parallel", "hf")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--text", required=True)
    ap.add_argument("--mb", type=float, default=100)
    ap.add_argument("--vocab", type=int, default=30522)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    refuse_missing_folder(args.json)
    refuse_below(args, rounds=1)
    rows = []
    for r in range(args.rounds):
        for method in METHODS:
            out = subprocess.run([sys.executable, "-c", CHILD, method, args.text, str(args.mb), str(args.vocab)],
                                 capture_output=True, text=True, check=True,
                                 env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))})
            row = json.loads(out.stdout.strip().splitlines()[-1])
            row["round"] = r
            rows.append(row)
            print(json.dumps(row), flush=True)

    def summary(method, key):
        vals = [x[key] for x in rows if x["method"] == method]
        return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}

    result = {"command": "python " + " ".join(sys.argv), "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "rounds": rows,
              "median": {m: {k: summary(m, k) for k in ("seconds", "peak_rss_mb", "peak_tree_rss_mb")}
                         for m in METHODS},
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print(json.dumps(result["median"], indent=1))
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
