"""How long `make demo`'s command takes after set-up: `python -m launch demo` into a fresh folder, in a fresh
process each round (its corpus, vocabulary, compile and 500 steps included; the venv install is not); not a test.

    python benchmarks/bench_demo.py --rounds 3 --json benchmarks/results_demo_time.json

Reports each round's wall seconds, their median and min–max, and the load average around each round (the machine may
be shared). The README's "~N min" for `make demo` comes from this file.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from outputs import refuse_below, refuse_missing_folder, write_json  # noqa: E402  pylint: disable=wrong-import-position


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    refuse_missing_folder(args.json)
    refuse_below(args, rounds=1)
    rows = []
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="bench_demo_") as tmp:
            load = os.getloadavg()[0]
            t0 = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "launch", "demo", f"--workdir={tmp}/demo"], cwd=ROOT,
                                  capture_output=True, text=True, check=False)
            wall = time.perf_counter() - t0
        if done.returncode != 0:
            sys.exit(f"error: the demo failed in round {r} ({(done.stderr.strip().splitlines() or [''])[-1]}), "
                     "python -m launch demo, run it by hand to see why")
        rows.append({"round": r, "wall_s": wall, "loadavg_1m_before": load, "loadavg_1m_after": os.getloadavg()[0]})
        print(f"round {r + 1}/{args.rounds}: {wall:.1f} s", flush=True)
    walls = [x["wall_s"] for x in rows]
    result = {"wall_s": {"median": statistics.median(walls), "min": min(walls), "max": max(walls)}, "rounds": rows}
    print(f"median {result['wall_s']['median']:.1f} s ({min(walls):.1f}–{max(walls):.1f})", flush=True)
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
