"""`launch prepare` throughput against the `tokenizers` floor, and the reading side's memory vs corpus size.

    python benchmarks/bench_prepare.py throughput --text /work/shared/data/wikitext-2/train.txt --copies 10 \
        --rounds 3 --json benchmarks/results_prepare_throughput.json
    python benchmarks/bench_prepare.py memory --text /work/shared/data/wikitext-2/train.txt --copies 1,50 \
        --rounds 3 --json benchmarks/results_prepare_memory.json

Corpus: `--copies` copies of the WikiText-2 training file (`<scratch>/text-<key>/cN/wiki-<i>.train.txt`, key: the
text file's path, size and time; data.name=wikitext),
tokenized with one vocabulary (8192 pieces, learned once on one copy by `launch prepare`, then given as
data.vocab_file), max_len 128, MLM FULL-SENTENCES, prepare.shard_mb=4 (the default 64 MB would make 2 shards of the
10-copy corpus: one core would do the last 18 MB alone).

throughput: per round, in a fresh process each, (a) `launch prepare` into a fresh directory with 2 workers
(reading the files, tokenizing, packing, writing the shards and manifest: everything) and (b) the floor: the same
documents' lines, already in memory, through `tokenizers`' `encode_batch` alone (its own threads, 2 cores).
Ratio = prepare seconds / floor seconds, median over interleaved rounds with min..max.

memory: per round and corpus size, a 2-step `launch pretrain` (size=tiny) on the prepared directory in a fresh
process; peak RSS from the child's ru_maxrss (one child at a time). Ratio = peak(largest) / peak(smallest).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from outputs import refuse_below, refuse_missing_folder, write_json  # noqa: E402  pylint: disable=wrong-import-position

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
WORKERS = 2      # prepare's data.num_threads; per-core rates divide by it
SHARD_MB = 4.0   # >= 4 shards per worker even for the 1-copy corpus (11 MB): the last shard is not left to one core

FLOOR = r"""
import json, sys, time
sys.path.insert(0, sys.argv[3])
import ml_collections
from tupe_jax import data as D
from tupe_jax.data import prepare as P
c = ml_collections.ConfigDict({"data": {**D.default_data_config().to_dict(), "name": "wikitext", "path": sys.argv[1]}})
lines = [ln for doc in P.documents(c, "train") for ln in doc.split("\n") if ln.strip()]
tok = D.Tokenizer.from_file(sys.argv[2])
t0 = time.perf_counter()
n = sum(len(ids) for i in range(0, len(lines), 4096) for ids in tok.encode_batch(lines[i:i + 4096]))
print(json.dumps({"seconds": time.perf_counter() - t0, "tokens": n}))
"""


def sh(cmd, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, **kw)
    if out.returncode:
        raise SystemExit(f"failed: {' '.join(map(str, cmd))}\n{out.stderr[-3000:]}")
    return out


def text_scratch(scratch: Path, text: Path) -> Path:
    """`scratch`'s folder for this `--text`: named by the file's real path, size and modification time, so the
    corpora, vocabulary and prepared folders of one text are never reused for another (or for an edited one)."""
    st = text.stat()
    key = hashlib.sha256(f"{text.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return scratch / f"text-{key}"


def corpus(scratch: Path, text: Path, copies: int) -> Path:
    """`copies` names for `text` in `scratch`/cN, made in a temporary folder and renamed into place, so a copy
    cut off midway is never taken for a whole corpus."""
    folder = scratch / f"c{copies}"
    if not folder.is_dir():
        partial = scratch / f".c{copies}.{os.getpid()}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        try:
            first = partial / "wiki-000.train.txt"
            first.write_bytes(text.read_bytes())
            for i in range(1, copies):   # hard links: the same text under `copies` names, no extra disk
                os.link(first, partial / f"wiki-{i:03d}.train.txt")
            partial.rename(folder)
        finally:
            shutil.rmtree(partial, ignore_errors=True)      # gone after the rename; the pieces after a failure
    return folder


def prepare_cmd(src: Path, out: Path, vocab: Path | None, workers: int = WORKERS) -> list[str]:
    cmd = [PY, "-m", "launch", "prepare", "--config=configs/prepare.py:max_len=128,vocab_size=8192",
           f"--workdir={out}", "--config.data.name=wikitext", f"--config.data.path={src}",
           f"--config.data.num_threads={workers}", "--config.prepare.splits=train",
           f"--config.prepare.shard_mb={SHARD_MB}"]
    return cmd + ([f"--config.data.vocab_file={vocab}"] if vocab else [])


def vocabulary(scratch: Path, text: Path) -> Path:
    out = scratch / "vocab-run"
    if not (out / "manifest.json").is_file():
        sh(prepare_cmd(corpus(scratch, text, 1), out, None))
    return out / "tokenizer" / "vocab.txt"


def stat(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def throughput(args, scratch: Path, vocab: Path) -> dict:
    src = corpus(scratch, Path(args.text), int(args.copies))
    rows = []
    for r in range(args.rounds):
        out = scratch / f"tp-{r}"
        sh(["rm", "-rf", str(out)])
        t0 = time.perf_counter()
        done = sh(prepare_cmd(src, out, vocab))
        wall = time.perf_counter() - t0
        manifest = json.loads((out / "manifest.json").read_text())
        inner = re.search(r"^prepare: done in ([0-9.]+) s", done.stdout, re.M)   # printed, not in the manifest
        floor = json.loads(sh([PY, "-c", FLOOR, str(src), str(vocab), str(ROOT)]).stdout.strip().splitlines()[-1])
        tokens = manifest["splits"]["train"]["tokens"]
        row = {"round": r, "prepare_seconds": wall, "prepare_inner_seconds": float(inner.group(1)) if inner else None,
               "prepare_tokens": tokens, "floor_seconds": floor["seconds"], "floor_tokens": floor["tokens"],
               "ratio": wall / floor["seconds"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
        sh(["rm", "-rf", str(out)])
    cores = WORKERS                            # prepare's workers (and the floor's threads) on 2 cores
    return {"rounds": rows, "ratio": stat([x["ratio"] for x in rows]),
            "prepare_tokens_per_s_per_core": stat([x["prepare_tokens"] / x["prepare_seconds"] / cores for x in rows]),
            "floor_tokens_per_s_per_core": stat([x["floor_tokens"] / x["floor_seconds"] / cores for x in rows]),
            "text_mb": sum(f.stat().st_size for f in src.iterdir()) / 1e6, "cores": cores}


def memory(args, scratch: Path, vocab: Path) -> dict:
    sizes = [int(x) for x in args.copies.split(",")]
    dirs = {}
    for k in sizes:
        dirs[k] = scratch / f"prepared-{k}"
        if not (dirs[k] / "manifest.json").is_file():
            sh(prepare_cmd(corpus(scratch, Path(args.text), k), dirs[k], vocab))
    rows = []
    for r in range(args.rounds):
        for k in sizes:
            work = scratch / f"run-{k}-{r}"
            sh(["rm", "-rf", str(work)])
            child = [PY, "-c", "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
                     "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)",
                     PY, "-m", "launch", "pretrain", "--config=configs/pretrain.py:pe=tupe_r,size=tiny",
                     f"--workdir={work}", "--config.data.name=prepared", f"--config.data.path={dirs[k]}",
                     "--config.model.vocab_size=8192", "--config.train.steps=2", "--config.train.batch_size=16",
                     "--config.train.eval_every=0", "--config.checkpoint.async_save=false"]
            peak = int(sh(child).stdout.strip().splitlines()[-1]) / 1024
            m = json.loads((dirs[k] / "manifest.json").read_text())["splits"]["train"]
            row = {"round": r, "copies": k, "peak_rss_mb": peak, "examples": m["examples"], "tokens": m["tokens"],
                   "shards": len(m["shards"])}
            rows.append(row)
            print(json.dumps(row), flush=True)
            sh(["rm", "-rf", str(work)])
    lo, hi = min(sizes), max(sizes)
    ratios = [next(x["peak_rss_mb"] for x in rows if x["round"] == r and x["copies"] == hi)
              / next(x["peak_rss_mb"] for x in rows if x["round"] == r and x["copies"] == lo)
              for r in range(args.rounds)]
    return {"rounds": rows, "ratio_largest_to_smallest": stat(ratios),
            "peak_rss_mb": {str(k): stat([x["peak_rss_mb"] for x in rows if x["copies"] == k]) for k in sizes}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("throughput", "memory"))
    ap.add_argument("--text", required=True)
    ap.add_argument("--copies", default="10")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scratch", default="/tmp/bench_prepare")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    refuse_missing_folder(args.json)
    refuse_below(args, rounds=1)
    if not os.path.isfile(args.text):
        sys.exit(f"error: no file {args.text!r}, --text, name the corpus's text file "
                 "(e.g. ../shared/data/wikitext-2/train.txt)")
    try:
        copies = [int(x) for x in args.copies.split(",")]
    except ValueError:
        copies = [0]
    if min(copies) < 1 or (args.what == "throughput" and len(copies) != 1):
        sys.exit(f"error: --copies {args.copies!r} is not " + ("one whole number ≥ 1" if args.what == "throughput"
                 else "a comma-separated list of whole numbers ≥ 1") + ", --copies, give e.g. " +
                 ("10" if args.what == "throughput" else "1,50"))
    scratch = text_scratch(Path(args.scratch), Path(args.text))
    scratch.mkdir(parents=True, exist_ok=True)
    vocab = vocabulary(scratch, Path(args.text))
    result = (throughput if args.what == "throughput" else memory)(args, scratch, vocab)
    result.update(command="python " + " ".join(sys.argv), machine=platform.machine(), cpus=os.cpu_count(),
                  time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=1))
    if args.json:
        write_json(args.json, result, newline=True)


if __name__ == "__main__":
    main()
