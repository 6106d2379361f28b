"""XLA compile time of a tiny `launch pretrain` under the test suite's XLA flags, with and without extra flags.
Not a test.

    python benchmarks/bench_compile_flags.py --rounds 5 --variant=--xla_cpu_use_fusion_emitters=false \
        --json benchmarks/results_compile_flags_avx2_zen4.json

Each round runs, one after the other in fresh processes, the suite's flags (`tests/xla_flags.py` without the flags
under test) and then each `--variant` added to them: a 3-step, 2-layer, d=32 BERT-A `python -m launch pretrain` on
8 fake CPU devices with no persistent compilation cache. From JAX_LOG_COMPILES it sums the seconds of every XLA
compilation and keeps the train step's alone, plus the process's wall time. Medians over rounds, with min, max
and the median's 95% interval (`rounds.spread`).
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
from outputs import refuse_below, refuse_missing_folder, write_json  # noqa: E402  pylint: disable=wrong-import-position
from rounds import rotated, spread  # noqa: E402  pylint: disable=wrong-import-position
from tests import xla_flags  # noqa: E402  pylint: disable=wrong-import-position

TINY = ["--config.train.steps=3", "--config.model.num_layers=2", "--config.model.hidden_size=32",
        "--config.model.num_heads=2", "--config.model.mlp_dim=64", "--config.model.vocab_size=512",
        "--config.model.max_len=32", "--config.train.batch_size=8"]
_COMPILED = re.compile(r"Finished XLA compilation of (\S+) in ([\d.]+) sec")


def base_flags(variants: list[str]) -> str:
    """The suite's XLA_FLAGS for 8 devices, less every flag a variant tests."""
    names = {v.split("=")[0] for v in variants}
    return " ".join(f for f in xla_flags.devices(8).split() if f.split("=")[0] not in names)


def run_once(flags: str, cache: str) -> dict:
    """One tiny pretrain in a fresh process: compile seconds (all, train step) and wall seconds."""
    with tempfile.TemporaryDirectory() as workdir:
        env = {**os.environ, "XLA_FLAGS": flags, "JAX_LOG_COMPILES": "1", "JAX_COMPILATION_CACHE_DIR": "",
               "TUPE_JAX_CACHE": cache, "JAX_PLATFORMS": "cpu"}
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "launch", "pretrain",
                              f"--config={ROOT}/configs/pretrain.py:pe=bert_a,size=tiny",
                              f"--workdir={workdir}/run", *TINY], cwd=ROOT, env=env, capture_output=True, text=True,
                             check=True)
        wall = time.perf_counter() - t0
    compiles = [(name, float(sec)) for name, sec in _COMPILED.findall(out.stderr + out.stdout)]
    return {"compile_s": sum(s for _, s in compiles),
            "train_step_compile_s": sum(s for n, s in compiles if n == "jit(train_step)"), "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variant", action="append", default=[], help="extra XLA flags (repeatable)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    refuse_missing_folder(args.json)
    refuse_below(args, rounds=1)
    base = base_flags(args.variant)
    jobs = {"suite flags less the variants": base, **{v: f"{base} {v}" for v in args.variant}}
    rows: dict[str, list[dict]] = {name: [] for name in jobs}
    with tempfile.TemporaryDirectory() as cache:
        run_once(base, cache)            # prepares the embedded corpus once, outside the rounds
        for r in range(args.rounds):
            for name, flags in rotated(jobs.items(), r):
                rows[name].append(run_once(flags, cache))
                print(f"round {r + 1}/{args.rounds} {name}: " + ", ".join(
                    f"{k} {v:.2f}" for k, v in rows[name][-1].items()), flush=True)
    out = {"command": "python benchmarks/bench_compile_flags.py " + shlex.join(sys.argv[1:]), "base_flags": base,
           "loadavg_after": list(os.getloadavg()),
           "jobs": {name: {k: spread([row[k] for row in rs]) for k in rs[0]} for name, rs in rows.items()}}
    for name, job in out["jobs"].items():
        print(f"{name}: compile {job['compile_s']['median']:.2f} s (train step {job['train_step_compile_s']['median']:.2f}),"
              f" wall {job['wall_s']['median']:.2f} s")
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    main()
