"""In-process A/B of the analyses' model forward with each dot library (oneDNN against XLA:CPU's default); not a test.

    GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python benchmarks/bench_eval_dots.py --rounds 15 \
        --json benchmarks/results_eval_dots_avx512_zen4.json

The forward is `extrapolate`'s own NLL function (`tupe_jax.analysis.extrapolate._nll_fn`, built through
`xla_options.jit`), once with `TUPE_JAX_ONEDNN=0` and once with `1`, for causal `size=small` models (4 layers,
d 256, 4 heads, MLP 1024, vocab 8192, float32) at each `--lengths`, with as many rows as `extrapolate` puts in one
forward at that length (`common.batch_rows`: 8192 tokens). Each round runs `--reps` synced forwards of every
(scheme, length, library) in turn; a length's ratio oneDNN / XLA is taken within each round and reported as the
median over rounds with its spread and, from 6 rounds, the median's 95% interval (`rounds.spread`). Wall ms and
the process's CPU ms (all threads) are both kept.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from outputs import refuse_below, refuse_missing_folder, write_json  # noqa: E402  pylint: disable=wrong-import-position
from rounds import rotated, spread  # noqa: E402  pylint: disable=wrong-import-position

LIBRARIES = {"xla": "0", "onednn": "1"}


def build(scheme: str, lengths: list[int]) -> dict:
    """{(length, library): (fn, args)} for one scheme, every forward compiled and run once."""
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    from configs.pretrain import get_config  # pylint: disable=import-outside-toplevel
    from tupe_jax.analysis import common, extrapolate  # pylint: disable=import-outside-toplevel
    from tupe_jax.model import ModelConfig, init_params  # pylint: disable=import-outside-toplevel

    cfg = ModelConfig.from_config(get_config(f"pe={scheme},size=small,objective=clm").model)
    params = init_params(cfg, jax.random.PRNGKey(0))
    out, setting_before = {}, os.environ.get("TUPE_JAX_ONEDNN")
    for length in lengths:
        rows = common.batch_rows(length, cfg)
        tokens = jax.random.randint(jax.random.PRNGKey(length), (rows, length), 5, cfg.vocab_size, jnp.int32)
        weights = jnp.ones((rows, length), jnp.float32)
        for library, setting in LIBRARIES.items():
            os.environ["TUPE_JAX_ONEDNN"] = setting
            fn = extrapolate._nll_fn.__wrapped__(cfg)  # pylint: disable=protected-access
            args = (params, tokens, tokens, weights)
            jax.block_until_ready(fn(*args))
            out[(length, library)] = (fn, args, rows)
    if setting_before is None:
        os.environ.pop("TUPE_JAX_ONEDNN")
    else:
        os.environ["TUPE_JAX_ONEDNN"] = setting_before
    return out


def timed(fn, args, reps: int) -> tuple[float, float]:
    """(wall ms, process CPU ms) per synced forward, over `reps` forwards."""
    import jax  # pylint: disable=import-outside-toplevel
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(reps):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - wall) * 1e3 / reps, (time.process_time() - cpu) * 1e3 / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemes", default="alibi,rope")
    parser.add_argument("--lengths", default="128,512,2048")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    refuse_missing_folder(args.json)
    refuse_below(args, rounds=1, reps=1)
    schemes, lengths = args.schemes.split(","), [int(x) for x in args.lengths.split(",")]
    built = {scheme: build(scheme, lengths) for scheme in schemes}
    rounds = []
    for r in range(args.rounds):
        row = {}
        for scheme in schemes:
            for length in lengths:
                for library in rotated(LIBRARIES, r):
                    fn, fn_args, _ = built[scheme][(length, library)]
                    row[f"{scheme}/{length}/{library}"] = timed(fn, fn_args, args.reps)
        rounds.append(row)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{s}/{n} {row[f'{s}/{n}/onednn'][0] / row[f'{s}/{n}/xla'][0]:.3f}" for s in schemes for n in lengths),
            flush=True)
    results = []
    for scheme in schemes:
        for length in lengths:
            key = f"{scheme}/{length}"
            results.append({
                "scheme": scheme, "length": length, "rows": built[scheme][(length, "xla")][2],
                "xla_wall_ms": statistics.median(r[f"{key}/xla"][0] for r in rounds),
                "onednn_wall_ms": statistics.median(r[f"{key}/onednn"][0] for r in rounds),
                "onednn_over_xla_wall": spread([r[f"{key}/onednn"][0] / r[f"{key}/xla"][0] for r in rounds]),
                "onednn_over_xla_cpu": spread([r[f"{key}/onednn"][1] / r[f"{key}/xla"][1] for r in rounds])})
            w = results[-1]["onednn_over_xla_wall"]
            print(f"{key}: oneDNN / XLA wall {w['median']:.3f} (min {w['min']:.3f}, max {w['max']:.3f}, "
                  f"ci95 {w['ci95']})")
    import jax  # pylint: disable=import-outside-toplevel
    from tupe_jax import host  # pylint: disable=import-outside-toplevel
    report = {"command": "python " + " ".join(sys.argv), "cpu": host.cpu_description(), "machine": platform.machine(),
              "cores": os.cpu_count(), "jax": jax.__version__, "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
              "rounds": args.rounds, "reps": args.reps,
              "model": "size=small causal: 4 layers, d 256, 4 heads, MLP 1024, vocab 8192, float32",
              "results": results, "per_round_ms": rounds}
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    main()
