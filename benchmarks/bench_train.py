"""Side-by-side MLM training-step throughput: tupe-jax vs HF BertForMaskedLM (PyTorch) and HF FlaxBertForMaskedLM,
same shapes, same dtype, same optimizer family, in one run; plus the real `launch pretrain` loop. Not a test.

    pip install -e ".[bench]"            # torch (CPU wheel) + transformers<5 (the last with Flax BERT)
    python benchmarks/bench_train.py --rounds 3 --json benchmarks/results_small_rounds.json
    python benchmarks/bench_train.py --shape base --batch 4 --steps 5 --peers "" --loop_steps 0

Jobs (each in its own subprocess: clean thread pools, torch's OpenMP workers cannot spin while XLA runs):
ours for each `--schemes` entry (default head: the MLM head on the ceil(0.15·seq) masked positions, gathered);
`bert_a@all` (equal work: `data.max_predictions = seq`, the head on every slot as HF runs it, padding slots
weighted 0); the HF peers; `loop` = `python -m launch pretrain` (bert_a, same shape, embedded corpus), its
steady-state tokens/s from metrics.jsonl. Each step is the full train step: forward + backward + global-norm clip +
AdamW, dropout 0.1 (hidden and attention) in all. Warm-up steps (incl. compilation) are excluded; a job's step
time is the median of `--steps` timed steps, each timed to completion (the loss is read back).

Noise: the machine may be shared. `--rounds R` runs every job once per round (order rotated each round) and each
ratio is computed WITHIN a round, then reported as the median over rounds with its min–max spread and, from 6
rounds, the median's 95% interval (`rounds.spread`); nothing keeps a job's best round. `os.getloadavg()` before
and after every job is in the JSON. The torch 2048³ fp32 matmul rate is measured at the start of every round
(recorded, for reference only).

Model FLOPs (`tupe_jax.metrics.transformer_training_flops`, 3 × forward matmul FLOPs) count the head and last-layer
rows each job runs. tokens/s = batch × seq_len ÷ step time (all input tokens, the same for every job).

Allocator (`--allocator`; the launcher's malloc setting, tupe_jax/allocator.py): `launcher` (default) gives ours and
the loop what `python -m launch` gives itself and the peers the system's malloc, `all` gives it to every job, `none`
to none. In the same rounds `--allocator_ab 1` also runs ours with the system's (`bert_a~system`), and
`--peers_allocator_ab 1` each peer with the launcher's (`torch~launcher`), with ratios against each peer's faster
allocator per round. Each worker reports its malloc, page faults and user/system CPU seconds per step.

Prints Markdown tables, and writes the results to `--json` where one is given, with the checkout's git commit at the
start (`git_commit`, "+dirty" with uncommitted changes). This file is the driver; the shapes, batches, step timer
and the three workers are in benchmarks/train_workers.py.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from train_workers import ALL_SCHEMES, SHAPES, USAGE, WORKERS, shape_args  # noqa: E402  pylint: disable=wrong-import-position
from outputs import refuse_below, refuse_failed, refuse_missing_folder, refuse_unknown, write_json  # noqa: E402  pylint: disable=wrong-import-position
from rounds import spread  # noqa: E402  pylint: disable=wrong-import-position


# ================================================================================================ driver
def matmul_peak(n: int = 2048, repeats: int = 7) -> tuple[float, int]:
    """Best-of-`repeats` float32 n³ matmul FLOP/s with torch (all cores)."""
    import torch  # pylint: disable=import-outside-toplevel
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best, torch.get_num_threads()


def model_flops(s: dict, predictions) -> float:
    sys.path.insert(0, ROOT)
    from tupe_jax.metrics import transformer_training_flops  # pylint: disable=import-outside-toplevel
    return transformer_training_flops(s["layers"], s["hidden"], s["mlp"], s["vocab"], s["seq"], s["batch"],
                                      mlm_predictions=predictions, last_layer_predictions=predictions is not None)


def job_env(allocator_mode: str, kind: str) -> dict:
    """A job's environment: the caller's without any malloc setting (tupe_jax/allocator.py), so results do not
    depend on the shell; then `--allocator`: `launcher` = ours and the loop get what `python -m launch` gives
    itself, the peers run as their users run them; `all` = every job gets it; `none` = no job gets it."""
    sys.path.insert(0, ROOT)
    from tupe_jax import allocator  # pylint: disable=import-outside-toplevel
    env = {k: v for k, v in os.environ.items() if k not in allocator.SETTINGS_ENV}
    env.setdefault("JAX_PLATFORMS", "cpu")
    if allocator_mode == "none":
        return {**env, allocator.CHOICE: "system"}
    if allocator_mode == "all" or kind in ("ours", "loop"):
        tuned = allocator.tuned_environ(env, platform.libc_ver(), allocator.thp_mode(), allocator.tbbmalloc_libs(),
                                        allocator.accelerator_plugin())
        return tuned if tuned is not None else env
    return env


def run_worker(args, kind: str, arg: str, predictions: int, allocator_mode: str = "") -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--worker_arg", arg]
    for key in ("shape", "layers", "hidden", "heads", "mlp", "vocab", "seq", "batch", "steps", "warmup",
                "dropout", "backend", "profile_dir", "torch_threads"):
        value = getattr(args, key)
        if value not in (None, ""):
            cmd += [f"--{key}", str(value)]
    cmd += ["--predictions", str(predictions)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=job_env(allocator_mode or args.allocator, kind),
                          check=False)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def loop_overrides(args, s: dict, cache_dir: str) -> dict:
    """The loop job's `--config.` overrides: bert_a at the benchmark's shape and dropout, a metrics row every step,
    no evaluation or checkpoint inside the run, the embedded corpus."""
    return {"model.num_layers": s["layers"], "model.hidden_size": s["hidden"], "model.num_heads": s["heads"],
            "model.mlp_dim": s["mlp"], "model.vocab_size": s["vocab"], "model.max_len": s["seq"],
            "model.dtype": "float32", "model.dropout_rate": args.dropout,
            "model.attention_dropout_rate": args.dropout, "model.attention_backend": args.backend,
            "train.batch_size": s["batch"], "train.steps": args.loop_steps, "train.log_every": 1,
            "train.eval_every": 10 ** 9, "checkpoint.every": 10 ** 9, "data.name": "embedded",
            "data.max_predictions": args.predictions, "data.cache_dir": cache_dir}


def loop_result(rows: list[dict], s: dict) -> dict:
    """Steady-state tokens/s of a loop's metrics.jsonl rows: the median of its per-step rows (`log_every` 1)
    without the first (compilation) and the last (end of run), the same estimator as the benchmark's median step.
    This VM now and then stalls one step for 100-250 ms (the benchmark's own steps alike); a median over 5-step
    windows (the estimator before) let those stalls in. The mean over the same rows is recorded too."""
    windows = [r for r in rows if "tokens_per_sec" in r]
    steady = windows[1:-1]
    if not steady:
        return {"error": [f"only {len(windows)} metrics windows; raise --loop_steps"]}
    tokens_per_s = statistics.median(r["tokens_per_sec"] for r in steady)
    return {"tokens_per_s_windows": [r["tokens_per_sec"] for r in windows], "steady_windows": len(steady),
            "loop_tokens_per_s": tokens_per_s,
            "loop_tokens_per_s_mean": s["batch"] * s["seq"] / statistics.mean(r["step_time_s"] for r in steady),
            "step_ms": 1e3 * s["batch"] * s["seq"] / tokens_per_s}


def run_loop(args, s: dict, cache_dir: str) -> dict:
    """The real `python -m launch pretrain` (bert_a, the benchmark's shape, embedded corpus) for `--loop_steps`,
    in its own process; its steady-state tokens/s (`loop_result`)."""
    workdir = tempfile.mkdtemp(prefix="bench_loop_")
    cmd = [sys.executable, "-m", "launch", "pretrain", f"--config=configs/pretrain.py:pe=bert_a,size={args.shape}",
           f"--workdir={workdir}"] + [f"--config.{k}={v}" for k, v in loop_overrides(args, s, cache_dir).items()]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=job_env(args.allocator, "loop"), cwd=ROOT,
                              check=False)
        if proc.returncode != 0:
            return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
        with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
            rows = [json.loads(line) for line in f]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result = loop_result(rows, s)
    return result if "error" in result else {**result, "command": " ".join(cmd[1:])}


# ratio name -> (job whose step time is divided, job it is divided by): a step-time ratio, i.e. the tokens/s
# ratio of the second job over the first
RATIOS = {
    "default: bert_a tokens/s / HF torch": ("torch", "bert_a"),
    "default: bert_a tokens/s / HF Flax": ("flax", "bert_a"),
    "equal work: bert_a@all tokens/s / HF torch": ("torch", "bert_a@all"),
    "equal work: bert_a@all tokens/s / HF Flax": ("flax", "bert_a@all"),
    "tupe_a step / bert_a step": ("tupe_a", "bert_a"),
    "tupe_r step / bert_a step": ("tupe_r", "bert_a"),
    "loop tokens/s / benchmark bert_a tokens/s": ("bert_a", "loop"),
    "launcher's malloc: bert_a tokens/s / bert_a with the system's": ("bert_a~system", "bert_a"),
    "launcher's malloc: bert_a@all tokens/s / bert_a@all with the system's": ("bert_a@all~system", "bert_a@all"),
    "default: bert_a tokens/s / HF torch with the launcher's malloc": ("torch~launcher", "bert_a"),
    "default: bert_a tokens/s / HF Flax with the launcher's malloc": ("flax~launcher", "bert_a"),
    "equal work: bert_a@all tokens/s / HF torch with the launcher's malloc": ("torch~launcher", "bert_a@all"),
    "equal work: bert_a@all tokens/s / HF Flax with the launcher's malloc": ("flax~launcher", "bert_a@all"),
}
# with --peers_allocator_ab: each peer at the faster of its two allocators in that round
FASTER_PEER = {
    "default: bert_a tokens/s / HF torch, its faster allocator": (("torch", "torch~launcher"), "bert_a"),
    "default: bert_a tokens/s / HF Flax, its faster allocator": (("flax", "flax~launcher"), "bert_a"),
    "equal work: bert_a@all tokens/s / HF torch, its faster allocator": (("torch", "torch~launcher"), "bert_a@all"),
    "equal work: bert_a@all tokens/s / HF Flax, its faster allocator": (("flax", "flax~launcher"), "bert_a@all"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="small", choices=sorted(SHAPES))
    for key in ("layers", "hidden", "heads", "mlp", "vocab", "seq", "batch"):
        ap.add_argument(f"--{key}", type=int, default=0, help="override the shape preset")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation included)")
    ap.add_argument("--predictions", type=int, default=0, help="MLM slots per sequence (0: ceil(0.15·seq))")
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--rounds", type=int, default=3, help="repeat all jobs, interleaved (order rotated per round)")
    ap.add_argument("--backend", default="einsum", help="ours: model.attention_backend (einsum|xla)")
    ap.add_argument("--schemes", default="bert_a,tupe_a,tupe_r", help="ours (" + ",".join(ALL_SCHEMES) + "); "
                    "'scheme:concat' = TUPE concat form")
    ap.add_argument("--equal_work", type=int, default=1, help="also bert_a with the head on every position")
    ap.add_argument("--peers", default="torch,flax", help="HF peers to run: torch,flax (or empty)")
    ap.add_argument("--torch_threads", type=int, default=0, help="HF torch: torch.set_num_threads (0: its default)")
    ap.add_argument("--loop_steps", type=int, default=40, help="also the real `launch pretrain` loop (0: off)")
    ap.add_argument("--allocator", default="launcher", choices=("launcher", "all", "none"),
                    help="the launcher's malloc setting: launcher = ours as `python -m launch` runs (peers "
                         "without), all = every job, none = no job (see job_env)")
    ap.add_argument("--allocator_ab", type=int, default=0, help="also ours (bert_a, bert_a@all) with the system's "
                    "malloc, as jobs bert_a~system / bert_a@all~system in the same rounds")
    ap.add_argument("--peers_allocator_ab", type=int, default=0, help="with --allocator launcher: also each HF "
                    "peer with the launcher's malloc (torch~launcher, flax~launcher) in the same rounds, and ratios "
                    "against each peer's faster allocator per round")
    ap.add_argument("--json", default="", help="where to write the results (default: print only)")
    ap.add_argument("--profile_dir", default="", help="ours: also write a jax.profiler trace of 3 steps here")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    ap.add_argument("--worker_arg", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    refuse_missing_folder(args.json)
    refuse_below(args, rounds=1, steps=1, warmup=0, loop_steps=0, torch_threads=0)
    refuse_unknown("--schemes", [x for x in args.schemes.split(",") if x], ALL_SCHEMES, "schemes")
    refuse_unknown("--peers", [x for x in args.peers.split(",") if x], ("torch", "flax"), "peers")
    if args.allocator_ab and args.allocator == "none":
        sys.exit("error: --allocator_ab 1 needs ours with the launcher's malloc, --allocator none, use launcher or all")
    if not (args.schemes.strip(",") or args.equal_work or args.peers.strip(",") or args.loop_steps):
        sys.exit("error: no job to run, --schemes/--equal_work/--peers/--loop_steps, name at least one")
    s = shape_args(args)
    args.default_predictions = -(-15 * s["seq"] // 100)
    args.predictions = args.predictions or args.default_predictions

    if args.worker:
        print(json.dumps({**WORKERS[args.worker](args, s), "usage": USAGE}))
        return

    load_before = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    sys.path.insert(0, ROOT)
    from tupe_jax.workdir.provenance import git_commit  # pylint: disable=import-outside-toplevel
    commit = git_commit()       # at the start: the workers run this checkout's code as it is now
    jobs = [(x, "ours", x, args.predictions) for x in args.schemes.split(",") if x]
    if args.equal_work:
        jobs.append(("bert_a@all", "ours", "bert_a", s["seq"]))
    if args.allocator_ab:     # ours again with the system's malloc, in the same rounds
        jobs += [("bert_a~system", "ours", "bert_a", args.predictions)] + (
            [("bert_a@all~system", "ours", "bert_a", s["seq"])] if args.equal_work else [])
    jobs += [(p, p, "", args.predictions) for p in args.peers.split(",") if p]
    if args.peers_allocator_ab:
        if args.allocator != "launcher":
            sys.exit("error: --peers_allocator_ab 1 needs the peers without the launcher's malloc, --allocator "
                     f"{args.allocator}, use --allocator launcher")
        jobs += [(p + "~launcher", p, "", args.predictions) for p in args.peers.split(",") if p]
    if args.loop_steps:
        jobs.append(("loop", "loop", "bert_a", args.predictions))
    cache_dir = tempfile.mkdtemp(prefix="bench_cache_")
    peaks, results = [], {name: [] for name, *_ in jobs}
    try:
        for round_index in range(args.rounds):
            peak, torch_threads = matmul_peak()
            peaks.append(peak)
            shift = round_index % len(jobs)      # rotate the order: no job always runs first or after the same one
            for name, kind, arg, predictions in jobs[shift:] + jobs[:shift]:
                load = os.getloadavg()[0]
                t0 = time.perf_counter()
                result = (run_loop(args, s, cache_dir) if kind == "loop"
                          else run_worker(args, kind, arg, predictions,
                                         {"system": "none", "launcher": "all"}.get(name.partition("~")[2], "")))
                result.update(job=name, kind=kind, scheme=arg, round=round_index, predictions_slots=predictions,
                              wall_s=round(time.perf_counter() - t0, 1), loadavg_1m_before=load,
                              loadavg_1m_after=os.getloadavg()[0])
                if "times" in result:
                    result["step_ms"] = 1e3 * statistics.median(result["times"])
                results[name].append(result)
                print(f"# round {round_index} {name}: " + (f"{result['step_ms']:.1f} ms" if "step_ms" in result
                      else str(result.get("error"))), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)

    def round_step(name: str, r: int):
        rows = [x for x in results.get(name, []) if x["round"] == r and "step_ms" in x]
        return rows[0]["step_ms"] if rows else None

    ratios = {}
    for label, (num, den) in RATIOS.items():
        per_round = [round_step(num, r) / round_step(den, r) for r in range(args.rounds)
                     if round_step(num, r) and round_step(den, r)]
        if per_round:
            ratios[label] = spread(per_round)
    for label, (peers, den) in FASTER_PEER.items():
        per_round = [min(round_step(p, r) for p in peers) / round_step(den, r) for r in range(args.rounds)
                     if all(round_step(p, r) for p in peers) and round_step(den, r)]
        if per_round:
            ratios[label] = spread(per_round)
    jobs_out = {}
    for name, kind, arg, predictions in jobs:
        steps_ms = [x["step_ms"] for x in results[name] if "step_ms" in x]
        if not steps_ms:
            jobs_out[name] = {"error": [x.get("error") for x in results[name]]}
            continue
        flops = model_flops(s, predictions if kind in ("ours", "loop") else None)
        median_s = statistics.median(steps_ms) / 1e3
        jobs_out[name] = {"kind": kind, "scheme": arg, "predictions_slots": predictions if kind != "torch" and
                          kind != "flax" else None, "step_ms": spread(steps_ms),
                          "tokens_per_s": s["batch"] * s["seq"] / median_s, "model_flops_per_step": flops,
                          "model_flops_per_s": flops / median_s}
        usage = [x["usage"] for x in results[name] if x.get("usage")]
        if usage:
            jobs_out[name]["usage_median"] = {k: statistics.median(u[k] for u in usage) for k in
                                              ("minor_faults_per_step", "user_s_per_step", "sys_s_per_step")}
            jobs_out[name]["glibc_tunables"] = usage[0]["glibc_tunables"]
            jobs_out[name]["malloc"] = usage[0].get("malloc", "")

    names = {"ours": "tupe-jax", "torch": "HF BertForMaskedLM (PyTorch)", "flax": "HF FlaxBertForMaskedLM",
             "loop": "tupe-jax `launch pretrain` loop"}
    print(f"\nshape={args.shape} {s} dropout={args.dropout} backend={args.backend} masked/seq="
          f"{args.default_predictions} steps={args.steps} (median per job and round) warmup={args.warmup} "
          f"rounds={args.rounds}; load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}\n")
    print("| job | implementation | head slots | step ms, median of rounds (min–max) | tokens/s | model GFLOP/step |"
          " model GFLOP/s |")
    print("|---|---|---:|---|---:|---:|---:|")
    for name, kind, _, predictions in jobs:
        j = jobs_out[name]
        if "error" in j:
            print(f"| {name} | {names[kind]} | | error: {j['error']} | | | |")
            continue
        st = j["step_ms"]
        print(f"| {name} | {names[kind]} | {j['predictions_slots'] or s['seq']} | {st['median']:.1f} "
              f"({st['min']:.1f}–{st['max']:.1f}) | {j['tokens_per_s']:,.0f} | "
              f"{j['model_flops_per_step'] / 1e9:.1f} | {j['model_flops_per_s'] / 1e9:.1f} |")
    print("\n| job | malloc | page faults / step | user CPU s / step | system CPU s / step |\n|---|---|---:|---:|---:|")
    for name, j in jobs_out.items():
        if "usage_median" in j:
            u = j["usage_median"]
            print(f"| {name} | {j['malloc'] or '—'} | {u['minor_faults_per_step']:,.0f} | "
                  f"{u['user_s_per_step']:.3f} | {u['sys_s_per_step']:.3f} |")
    print("\n| ratio (per round, then median) | median | min–max | 95% interval of the median | per round |\n"
          "|---|---:|---|---|---|")
    for label, r in ratios.items():
        ci = f"{r['ci95'][0]:.3f}–{r['ci95'][1]:.3f}" if r["ci95"] else "— (< 6 rounds)"
        print(f"| {label} | {r['median']:.3f}× | {r['min']:.3f}–{r['max']:.3f} | {ci} | "
              f"{', '.join(f'{x:.3f}' for x in r['per_round'])} |")
    refuse_failed({n: j["error"] for n, j in jobs_out.items() if "error" in j}, args.json)
    if not args.json:
        return
    from tupe_jax import host  # pylint: disable=import-outside-toplevel
    print()
    write_json(args.json, {"command": "python benchmarks/bench_train.py " + shlex.join(sys.argv[1:]),
                           "started": started, "git_commit": commit,
                           "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "shape": s,
                           "args": vars(args), "machine": f"{platform.processor() or platform.machine()}, "
                           f"{os.cpu_count()} cores", "cpu": host.cpu_description(), "peaks_flops": peaks,
                           "torch_threads": torch_threads, "loadavg_before": load_before,
                           "loadavg_after": os.getloadavg(), "ratios": ratios, "jobs": jobs_out, "runs": results})


if __name__ == "__main__":
    main()
