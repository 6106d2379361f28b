"""The training loop against the benchmark step, in one process: `launch pretrain`'s loop
(`tupe_jax.pretrain.loop.pretrain`, which writes metrics.jsonl) and bench_train's `bert_a` worker step, alternated
in rounds. Not a test.

    python benchmarks/bench_loop.py --rounds 9 --json benchmarks/results_loop_in_process.json

Why one process: on the shared 2-core VMs the same job's step differs from process to process and from minute to
minute by more than the 5% to be shown (bench_train's per-round loop ratios spread 0.92-1.16 in
results_small_rounds_avx2_zen4.json, its own step 444-675 ms). Each round here runs the loop for `--loop_steps`
steps in a fresh run folder (the launcher's code from the config on: claim, data iterator with its prefetch
threads, trainer, metrics writer, TensorBoard events), then times the benchmark step (`train_workers.worker_ours`:
synthetic batches already on the device, every step synced), in the order rotated each round. The loop's
steady-state tokens/s is bench_train's estimator (`loop_result`); the ratio is taken within each round, then the
median over rounds with its spread and, from 6 rounds, its 95% interval (`rounds.spread`). Both arms compile their
own step (the same jaxpr). The process runs with the huge-page tunable the launcher sets (it re-executes itself
with it, as `python -m launch` does).
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from bench_train import loop_overrides, loop_result  # noqa: E402  pylint: disable=wrong-import-position
from outputs import refuse_below, refuse_missing_folder, write_json  # noqa: E402  pylint: disable=wrong-import-position
from rounds import spread  # noqa: E402  pylint: disable=wrong-import-position
from train_workers import SHAPES, shape_args, worker_ours  # noqa: E402  pylint: disable=wrong-import-position


def loop_config(args, s: dict, cache_dir: str):
    """The loop job's config, as `python -m launch pretrain` builds it from bench_train's overrides."""
    from tupe_jax import config as config_lib  # pylint: disable=import-outside-toplevel
    config = config_lib.load_config(os.path.join(ROOT, "configs", "pretrain.py") + f":pe=bert_a,size={args.shape}")
    return config_lib.apply_overrides(config, {k: str(v) for k, v in loop_overrides(args, s, cache_dir).items()})


def run_loop_here(args, s: dict, cache_dir: str) -> dict:
    """The pretraining loop in this process on a fresh folder; its metrics.jsonl's steady tokens/s."""
    from tupe_jax.metrics import read_metrics  # pylint: disable=import-outside-toplevel
    from tupe_jax.pretrain.loop import pretrain  # pylint: disable=import-outside-toplevel
    config = loop_config(args, s, cache_dir)
    workdir = tempfile.mkdtemp(prefix="bench_loop_")
    try:
        pretrain(config, workdir)
        return loop_result(list(read_metrics(workdir)), s)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def host_costs(args, s: dict, cache_dir: str, calls: int = 100, repeats: int = 3) -> dict:
    """The loop's own host work per step, alone (no step running): the next batch from the data iterator (the
    loop's config: prefetch threads on), its placement on the mesh (`sharding.global_batch`) and one metrics row
    (`MetricsWriter.write`, JSON line and TensorBoard scalars). Wall and process CPU ms per call, median of
    `repeats` runs of `calls` calls."""
    import resource  # pylint: disable=import-outside-toplevel
    import jax  # pylint: disable=import-outside-toplevel
    from tupe_jax import data as data_lib  # pylint: disable=import-outside-toplevel
    from tupe_jax import metrics as metrics_lib  # pylint: disable=import-outside-toplevel
    from tupe_jax import sharding as sharding_lib  # pylint: disable=import-outside-toplevel
    config = loop_config(args, s, cache_dir)
    workdir = tempfile.mkdtemp(prefix="bench_loop_host_")
    try:
        batches = data_lib.pretrain_iterator(config, data_lib.get_tokenizer(config, workdir), split="train",
                                             global_batch_size=s["batch"], seed=0)
        batch, mesh = next(batches), sharding_lib.make_mesh(config, jax.devices())
        writer = metrics_lib.MetricsWriter(workdir)
        row = {"loss": 7.0, "grad_norm": 1.0, "learning_rate": 1e-4, "mlm_accuracy": 0.1, "step_time_s": 0.5,
               "tokens_per_sec": 4000.0, "model_tflops": 0.1}
        work = {"next batch": lambda i: next(batches),
                "place the batch": lambda i: jax.block_until_ready(sharding_lib.global_batch(batch, mesh)),
                "write a metrics row": lambda i: writer.write(i, row)}

        def cpu() -> float:
            usage = resource.getrusage(resource.RUSAGE_SELF)
            return usage.ru_utime + usage.ru_stime
        out = {}
        for name, fn in work.items():
            walls, cpus = [], []
            for _ in range(repeats):
                c0, t0 = cpu(), time.perf_counter()
                for i in range(calls):
                    fn(i)
                walls.append(1e3 * (time.perf_counter() - t0) / calls)
                cpus.append(1e3 * (cpu() - c0) / calls)
            out[name] = {"wall_ms": statistics.median(walls), "cpu_ms": statistics.median(cpus)}
        writer.close()
        return out
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="small", choices=sorted(SHAPES))
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--loop_steps", type=int, default=40)
    ap.add_argument("--steps", type=int, default=8, help="the benchmark step's timed steps")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", default="")
    ap.add_argument("--host_costs", type=int, default=1, help="also time the loop's host work per step alone")
    args = ap.parse_args()
    refuse_missing_folder(args.json)
    refuse_below(args, rounds=0, steps=1, warmup=0)
    from tupe_jax import allocator, host  # pylint: disable=import-outside-toplevel
    allocator.maybe_reexec()                    # the launcher's allocator, for both arms
    for key in ("layers", "hidden", "heads", "mlp", "vocab", "seq", "batch"):
        setattr(args, key, 0)
    args.dropout, args.backend, args.worker_arg, args.profile_dir = 0.1, "einsum", "bert_a", ""
    s = shape_args(args)
    args.predictions = -(-15 * s["seq"] // 100)
    load_before, started = os.getloadavg(), time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    cache_dir = tempfile.mkdtemp(prefix="bench_cache_")
    arms = {"loop": lambda: run_loop_here(args, s, cache_dir),
            "step": lambda: {"step_ms": 1e3 * statistics.median(worker_ours(args, s)["times"])}}
    rows: dict[str, list] = {name: [] for name in arms}
    try:
        for r in range(args.rounds):
            order = list(arms) if r % 2 == 0 else list(arms)[::-1]
            for name in order:
                load = os.getloadavg()[0]
                result = arms[name]()
                if "error" in result:
                    sys.exit(f"error: the {name} arm failed in round {r}: {result['error']}")
                rows[name].append({**result, "round": r, "loadavg_1m_before": load,
                                   "loadavg_1m_after": os.getloadavg()[0]})
                print(f"# round {r} {name}: {result['step_ms']:.1f} ms", file=sys.stderr, flush=True)
        costs = host_costs(args, s, cache_dir) if args.host_costs else {}
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    ratio = spread([st["step_ms"] / lp["step_ms"] for lp, st in zip(rows["loop"], rows["step"])]) if args.rounds \
        else None   # --rounds 0: the host work alone
    out = {"command": "python benchmarks/bench_loop.py " + " ".join(sys.argv[1:]), "started": started,
           "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "shape": s,
           "machine": f"{platform.machine()}, {os.cpu_count()} cores", "cpu": host.cpu_description(),
          
           "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""), "loadavg_before": load_before,
           "loadavg_after": os.getloadavg(), "loop tokens/s / benchmark step tokens/s": ratio,
           "step_ms": {name: spread([x["step_ms"] for x in rows[name]]) for name in rows if rows[name]},
           "host_work_per_step": costs, "runs": rows}
    if ratio is not None:
        ci = ratio["ci95"]
        print(f"loop tokens/s / benchmark step tokens/s: median {ratio['median']:.3f} (min-max {ratio['min']:.3f}-"
              f"{ratio['max']:.3f}; 95% interval of the median {'-'.join(f'{c:.3f}' for c in ci) if ci else '—'}); "
              f"per round {', '.join(f'{x:.3f}' for x in ratio['per_round'])}")
        for name in rows:
            st = out["step_ms"][name]
            print(f"{name}: {st['median']:.1f} ms ({st['min']:.1f}-{st['max']:.1f})")
    for name, cost in costs.items():
        print(f"host work alone, {name}: {cost['wall_ms']:.2f} ms wall, {cost['cpu_ms']:.2f} ms CPU")
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    main()
