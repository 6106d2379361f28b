"""How long `make demo`'s command takes after set-up: `python -m launch demo` into a fresh folder, in a fresh
process each round (its corpus, vocabulary, compile and 500 steps included; the venv install is not); not a test.

    python benchmarks/bench_demo.py --rounds 3 --json benchmarks/results_demo_time.json
    python benchmarks/bench_demo.py --rounds 3 --allocators auto,hugepages \
        --json benchmarks/results_demo_time_<machine>.json

Reports each round's wall seconds, their median and min–max, and the load average around each round (the machine may
be shared). The README's "~N min" for `make demo` comes from this file. `--allocators`: run the demo once per round
under each `TUPE_JAX_ALLOCATOR` setting (tupe_jax/allocator.py; `auto` is the launcher's default), in turn, the
order rotated each round; per setting: wall seconds, peak resident memory (from `wait4`: the largest of the demo
process's and its children's) and its wall over the first setting's within each round (median, min–max).

    python benchmarks/bench_demo.py --command compare --rounds 3 --allocators auto,hugepages --json …

`--command compare`: instead of the demo, the extrapolation comparison suite on the embedded corpus with
`--config.train.steps=COMPARE_STEPS` (five schemes trained, then evaluated at 128 to 1024 tokens, in one process):
the command that compiles and frees the most buffer sizes, where a malloc that keeps freed blocks costs the most.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from outputs import refuse_below, refuse_missing_folder, refuse_unknown, write_json  # noqa: E402  pylint: disable=wrong-import-position
from rounds import rotated, spread  # noqa: E402  pylint: disable=wrong-import-position

sys.path.insert(0, ROOT)
from tupe_jax.allocator import CHOICE, CHOICES  # noqa: E402  pylint: disable=wrong-import-position


COMPARE_STEPS = 100
COMMANDS = {"demo": ["demo"],
            "compare": ["compare", "--config=configs/compare.py:suite=extrapolation",
                        f"--config.train.steps={COMPARE_STEPS}"]}


def run_once(tmp: str, allocator: str, command: str = "demo") -> tuple[float, int]:
    """(wall seconds, peak RSS in MB) of `python -m launch <COMMANDS[command]>` into tmp, with
    TUPE_JAX_ALLOCATOR=allocator if given ('' keeps the environment's); exits with one line when it fails."""
    env = dict(os.environ, **({CHOICE: allocator} if allocator else {}))
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "launch", *COMMANDS[command], f"--workdir={tmp}/run"], cwd=ROOT,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"error: the {command} failed ({(err.strip().splitlines() or [''])[-1]}), python -m launch "
                 f"{' '.join(COMMANDS[command])}{f' with {CHOICE}={allocator}' if allocator else ''}, "
                 "run it by hand to see why")
    return wall, usage.ru_maxrss // 1024


def summarise(rows: list[dict], allocators: list[str]) -> dict:
    """The JSON's body from the rounds: per setting its wall seconds, peak RSS (MB) and wall over the first setting's
    in the same round, each as `rounds.spread` (median, min, max, the median's interval from 6 rounds); with one
    setting also the older file's top-level `wall_s`. (The command line is in the JSON's `environment`.)"""
    result = {"allocators": allocators,
              "per_allocator": {a: {"wall_s": spread([x["wall_s"][a] for x in rows]),
                                    "max_rss_mb": spread([x["max_rss_mb"][a] for x in rows]),
                                    "wall_over_first": spread([x["wall_s"][a] / x["wall_s"][allocators[0]]
                                                               for x in rows])}
                                for a in allocators},
              "rounds": rows}
    if len(allocators) == 1:     # the single-setting form keeps the older file's key
        result["wall_s"] = result["per_allocator"][allocators[0]]["wall_s"]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--command", choices=sorted(COMMANDS), default="demo", help="what to time (module docstring)")
    ap.add_argument("--allocators", default="", help="comma-separated TUPE_JAX_ALLOCATOR settings, one demo each "
                    "per round (default: the environment's alone)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    refuse_missing_folder(args.json)
    refuse_below(args, rounds=1)
    allocators = args.allocators.split(",") if args.allocators else [""]
    refuse_unknown("--allocators", [a for a in allocators if a], CHOICES, "settings")
    rows = []
    for r in range(args.rounds):
        row = {"round": r, "loadavg_1m_before": os.getloadavg()[0], "wall_s": {}, "max_rss_mb": {}}
        for allocator in rotated(allocators, r):
            with tempfile.TemporaryDirectory(prefix="bench_demo_") as tmp:
                row["wall_s"][allocator], row["max_rss_mb"][allocator] = run_once(tmp, allocator, args.command)
        row["loadavg_1m_after"] = os.getloadavg()[0]
        rows.append(row)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{a or args.command} {row['wall_s'][a]:.1f} s, "
              f"{row['max_rss_mb'][a]} MB" for a in allocators), flush=True)
    result = {**summarise(rows, allocators), "timed": "python -m launch " + " ".join(COMMANDS[args.command])}
    for a in allocators:
        wall = result["per_allocator"][a]["wall_s"]
        print(f"{a or args.command}: median {wall['median']:.1f} s ({wall['min']:.1f}–{wall['max']:.1f}), "
              f"{result['per_allocator'][a]['wall_over_first']['median']:.3f}× the first", flush=True)
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
