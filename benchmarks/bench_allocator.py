"""Our training step under two settings of glibc's malloc, in alternating processes. Not a test.

    python benchmarks/bench_allocator.py --rounds 7 --slots 128,20 --json benchmarks/results_allocator_keep.json

XLA:CPU allocates a step's temporary buffer afresh on every call; glibc maps a chunk that large with `mmap` and
unmaps it on `free`, so every step faults the buffer in again and the kernel zeroes its pages
(tupe_jax/allocator.py). The launcher's setting, huge pages (`glibc.malloc.hugetlb=1`), makes those faults 2 MiB
each. The other variant also keeps the buffer mapped between steps: no `mmap` for large chunks
(`mmap_max=0`), no trimming of the heap's top (`trim_threshold` of 64 GiB), and one malloc arena for every thread
(`arena_max=1`; without it the step's buffer comes from a thread's own arena and is still mapped afresh).

Each round runs bert_a's step (bench_train.py's `ours` worker at the `small` shape, dropout 0.1) once per variant
and per `--slots` (MLM head slots per sequence: 128 = equal work with the HF peers, 20 = the default head), in a
fresh process each, in an order rotated per round. Reported: per job its median and its mean step (ms), the timed
steps' page faults and user/system CPU seconds per step (means over the steps) and the process's peak resident
memory (each a median over rounds); per slot count the kept-mapped variant's speed over the launcher's (launcher
step ÷ variant step) in each round, by the median step and by the mean step (a stall of seconds in one step shows
only in the mean, and a run pays the mean), as a median with its spread (`rounds.spread`).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
from outputs import refuse_below, refuse_missing_folder, write_json  # noqa: E402  pylint: disable=wrong-import-position
from rounds import rotated, spread  # noqa: E402  pylint: disable=wrong-import-position
from tupe_jax import allocator  # noqa: E402  pylint: disable=wrong-import-position

HUGE_PAGES = allocator.SETTING
LAUNCHER = "huge pages (the launcher's)"
KEPT = "huge pages, buffer kept mapped (tried)"
VARIANTS = {LAUNCHER: HUGE_PAGES,
            KEPT: HUGE_PAGES + ":glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736"
                               ":glibc.malloc.arena_max=1"}
USAGE_KEYS = ("minor_faults_per_step", "user_s_per_step", "sys_s_per_step", "max_rss_mb")


def refuse_without_tunables() -> None:
    """Exit (one line) where the launcher would not set its tunable (tupe_jax/allocator.py: Linux, glibc 2.35 or
    later, transparent huge pages not `never`): the variants would not be what they are named."""
    libc, mode = platform.libc_ver(), allocator.thp_mode()
    if not sys.platform.startswith("linux") or allocator.tuned_environ({}, libc, mode) is None:
        sys.exit(f"error: the variants are glibc malloc tunables with transparent huge pages, this is {sys.platform} "
                 f"with {libc[0] or 'no glibc'} {libc[1]} and huge pages '{mode or 'unknown'}', run on Linux with "
                 "glibc 2.35 or later and huge pages not 'never'")


def run_job(variant: str, slots: int, steps: int, warmup: int) -> dict:
    """One fresh process of bench_train.py's `ours` worker under `variant`'s tunables: its result, or its error."""
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", allocator.MARKER, allocator.OPT_OUT)}
    env["GLIBC_TUNABLES"] = VARIANTS[variant]
    cmd = [sys.executable, os.path.join(HERE, "bench_train.py"), "--worker", "ours", "--worker_arg", "bert_a",
           "--predictions", str(slots), "--steps", str(steps), "--warmup", str(warmup)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"step_ms": 1e3 * statistics.median(result["times"]), "mean_step_ms": 1e3 * statistics.mean(result["times"]),
            "times_s": result["times"],
            **{k: result["usage"][k] for k in USAGE_KEYS}}


def summary(rounds: list[dict], slots: list[int]) -> tuple[dict, dict]:
    """(per-job medians over the rounds where the job ran, per-slot-count spread of the speed ratio)."""
    jobs = {}
    for name in rounds[0]:
        done = [r[name] for r in rounds if "error" not in r[name]]
        if done:
            jobs[name] = {"step_ms": spread([d["step_ms"] for d in done]),
                          "mean_step_ms": spread([d["mean_step_ms"] for d in done]),
                          **{k: statistics.median(d[k] for d in done) for k in USAGE_KEYS}}
    ratios = {}
    for p in slots:
        base, kept = f"{LAUNCHER} @{p}", f"{KEPT} @{p}"
        pairs = [(r[base], r[kept]) for r in rounds if "error" not in r[base] and "error" not in r[kept]]
        for key, what in (("step_ms", "median step"), ("mean_step_ms", "mean step")):
            if pairs:
                ratios[f"{p} slots, {what}: {KEPT} speed / {LAUNCHER}"] = spread([b[key] / k[key] for b, k in pairs])
    return jobs, ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--slots", default="128,20", help="MLM head slots per sequence, comma-separated")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per process (median reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation included)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    refuse_missing_folder(args.json)
    refuse_below(args, rounds=1, steps=1)
    refuse_without_tunables()
    slots = [int(s) for s in args.slots.split(",") if s.strip()]
    jobs = [(v, p) for p in slots for v in VARIANTS]
    out: dict = {"command": "python benchmarks/bench_allocator.py " + " ".join(sys.argv[1:]),
                 "variants": VARIANTS, "slots": slots, "rounds": []}
    for r in range(args.rounds):
        row = {}
        for variant, p in rotated(jobs, r):
            row[f"{variant} @{p}"] = job = run_job(variant, p, args.steps, args.warmup)
            print(f"round {r + 1}/{args.rounds}: {variant} @{p}: " + (f"{job['step_ms']:.1f} ms/step (mean "
                  f"{job['mean_step_ms']:.1f}), "
                  f"{job['minor_faults_per_step']:.0f} faults/step, peak RSS {job['max_rss_mb']:.0f} MB"
                  if "error" not in job else f"failed: {job['error']}"), flush=True)
        out["rounds"].append(row)
        out["jobs"], out["ratios"] = summary(out["rounds"], slots)
        if args.json:
            write_json(args.json, out)
    for name, s in out["ratios"].items():
        print(f"{name}: {s['median']:.3f}x ({s['min']:.3f}-{s['max']:.3f})")


if __name__ == "__main__":
    main()
