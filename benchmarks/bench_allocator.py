"""Our training step under malloc settings, in alternating processes. Not a test.

    python benchmarks/bench_allocator.py --rounds 7 --slots 128,20 --json benchmarks/results_allocator_tbb.json

XLA:CPU allocates a step's temporary buffer afresh on every call; glibc maps a chunk that large with `mmap` and
unmaps it on `free`, so every step faults the buffer in again and the kernel zeroes its pages
(tupe_jax/allocator.py). The base, glibc's huge pages (`glibc.malloc.hugetlb=1`), makes those faults 2 MiB each.
The variants (`--variants`) keep the buffer mapped between steps:
- `tbbmalloc`: oneTBB's malloc preloaded, freed blocks of 1 MiB or more kept (the launcher's setting where the
  `tbb` wheel is installed);
- `kept`: glibc with huge pages, no `mmap` for large chunks (`mmap_max=0`), no trimming of the heap's top
  (`trim_threshold` of 64 GiB) and one malloc arena for every thread (`arena_max=1`; without it the step's buffer
  comes from a thread's own arena and is still mapped afresh). Tried in session 45, not kept.

Each round runs bert_a's step (bench_train.py's `ours` worker at the `small` shape, dropout 0.1) once per setting
and per `--slots` (MLM head slots per sequence: 128 = equal work with the HF peers, 20 = the default head), in a
fresh process each, in an order rotated per round. Reported: per job its median and its mean step (ms), the timed
steps' page faults and user/system CPU seconds per step (means over the steps) and the process's peak resident
memory (each a median over rounds); per slot count each variant's speed over the base's (base step ÷ variant step)
in each round, by the median step and by the mean step (a stall of seconds in one step shows only in the mean, and
a run pays the mean), as a median with its spread (`rounds.spread`).
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
from outputs import refuse_below, refuse_missing_folder, refuse_unknown, write_json  # noqa: E402  pylint: disable=wrong-import-position
from rounds import rotated, spread  # noqa: E402  pylint: disable=wrong-import-position
from tupe_jax import allocator  # noqa: E402  pylint: disable=wrong-import-position

BASE = "huge pages (glibc)"
TBB = "tbbmalloc, blocks kept (the launcher's)"
KEPT = "huge pages, buffer kept mapped (tried)"
VARIANTS = {"tbbmalloc": TBB, "kept": KEPT}       # --variants name -> job label
KEPT_TUNABLES = (allocator.SETTING + ":glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736"
                 ":glibc.malloc.arena_max=1")
USAGE_KEYS = ("minor_faults_per_step", "user_s_per_step", "sys_s_per_step", "max_rss_mb")


def clean_environ() -> dict:
    """The caller's environment without any malloc setting (the system's malloc)."""
    return {k: v for k, v in os.environ.items() if k not in allocator.SETTINGS_ENV}


def setting_environ(label: str) -> dict:
    """The environment of a job under setting `label` (BASE or a VARIANTS label)."""
    env = clean_environ()
    if label == KEPT:
        return {**env, "GLIBC_TUNABLES": KEPT_TUNABLES}
    chosen = {BASE: "hugepages", TBB: "tbbmalloc"}[label]
    tuned = allocator.tuned_environ({**env, allocator.CHOICE: chosen}, platform.libc_ver(), allocator.thp_mode(),
                                    allocator.tbbmalloc_libs(), "")
    return {k: v for k, v in (tuned or {}).items() if k != allocator.MARKER}


def refuse_unavailable(variants: list[str]) -> None:
    """Exit (one line) where a setting asked for cannot apply here: the jobs would not be what they are named."""
    needs = {"hugepages"} | ({"tbbmalloc"} if "tbbmalloc" in variants else set())
    libc, mode, libs = platform.libc_ver(), allocator.thp_mode(), allocator.tbbmalloc_libs()
    for name in sorted(needs):
        why = ("this is " + sys.platform if not sys.platform.startswith("linux")
               else allocator.why_not(name, clean_environ(), libc, mode, libs, ""))
        if why:
            sys.exit(f"error: the {name} setting cannot apply here ({why}), the machine, run on Linux with glibc "
                     "2.35 or later, huge pages not 'never' (and the tbb wheel installed for tbbmalloc)")


def run_job(label: str, slots: int, steps: int, warmup: int) -> dict:
    """One fresh process of bench_train.py's `ours` worker under setting `label`: its result, or its error."""
    cmd = [sys.executable, os.path.join(HERE, "bench_train.py"), "--worker", "ours", "--worker_arg", "bert_a",
           "--predictions", str(slots), "--steps", str(steps), "--warmup", str(warmup)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=setting_environ(label), cwd=ROOT, check=False)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"step_ms": 1e3 * statistics.median(result["times"]), "mean_step_ms": 1e3 * statistics.mean(result["times"]),
            "times_s": result["times"], "malloc": result["usage"].get("malloc", ""),
            **{k: result["usage"][k] for k in USAGE_KEYS}}


def summary(rounds: list[dict], slots: list[int], labels: tuple[str, ...] = (KEPT,)) -> tuple[dict, dict]:
    """(per-job medians over the rounds where the job ran, per variant and slot count the spread of its speed
    ratio to the base's)."""
    jobs = {}
    for name in rounds[0]:
        done = [r[name] for r in rounds if "error" not in r[name]]
        if done:
            jobs[name] = {"step_ms": spread([d["step_ms"] for d in done]),
                          "mean_step_ms": spread([d["mean_step_ms"] for d in done]),
                          **{k: statistics.median(d[k] for d in done) for k in USAGE_KEYS}}
    ratios = {}
    for label in labels:
        for p in slots:
            base, other = f"{BASE} @{p}", f"{label} @{p}"
            pairs = [(r[base], r[other]) for r in rounds if "error" not in r[base] and "error" not in r[other]]
            for key, what in (("step_ms", "median step"), ("mean_step_ms", "mean step")):
                if pairs:
                    ratios[f"{p} slots, {what}: {label} speed / {BASE}"] = spread([b[key] / k[key] for b, k in pairs])
    return jobs, ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--slots", default="128,20", help="MLM head slots per sequence, comma-separated")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per process (median reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation included)")
    ap.add_argument("--variants", default="tbbmalloc", help="against the base: " + ", ".join(VARIANTS))
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    refuse_missing_folder(args.json)
    refuse_below(args, rounds=1, steps=1)
    variants = [v for v in args.variants.split(",") if v.strip()]
    refuse_unknown("--variants", variants, tuple(VARIANTS), "variants")
    refuse_unavailable(variants)
    slots = [int(s) for s in args.slots.split(",") if s.strip()]
    labels = tuple(VARIANTS[v] for v in variants)
    jobs = [(v, p) for p in slots for v in (BASE, *labels)]
    out: dict = {"command": "python benchmarks/bench_allocator.py " + " ".join(sys.argv[1:]),
                 "settings": {label: {k: v for k, v in setting_environ(label).items() if k in allocator.SETTINGS_ENV}
                              for label in (BASE, *labels)}, "slots": slots, "rounds": []}
    for r in range(args.rounds):
        row = {}
        for variant, p in rotated(jobs, r):
            row[f"{variant} @{p}"] = job = run_job(variant, p, args.steps, args.warmup)
            print(f"round {r + 1}/{args.rounds}: {variant} @{p}: " + (f"{job['step_ms']:.1f} ms/step (mean "
                  f"{job['mean_step_ms']:.1f}), "
                  f"{job['minor_faults_per_step']:.0f} faults/step, peak RSS {job['max_rss_mb']:.0f} MB"
                  if "error" not in job else f"failed: {job['error']}"), flush=True)
        out["rounds"].append(row)
        out["jobs"], out["ratios"] = summary(out["rounds"], slots, labels)
        if args.json:
            write_json(args.json, out)
    for name, s in out["ratios"].items():
        print(f"{name}: {s['median']:.3f}x ({s['min']:.3f}-{s['max']:.3f})")


if __name__ == "__main__":
    main()
