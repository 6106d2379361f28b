"""Side-by-side MLM training-step throughput: tupe-jax (every scheme) vs HF BertForMaskedLM (PyTorch) and HF
FlaxBertForMaskedLM, same shapes, same dtype, same optimizer family, in one run; not a test.

    pip install -e ".[bench]"            # torch (CPU wheel) + transformers<5 (the last with Flax BERT)
    python benchmarks/bench_train.py --shape small                      # reference shape, every scheme
    python benchmarks/bench_train.py --shape base --batch 4 --steps 5 --schemes bert_a,tupe_a,tupe_r

Every implementation runs in its own subprocess (clean thread pools: torch's OpenMP workers cannot spin on the
cores while XLA runs, and vice versa), one after the other, on the same synthetic batches. Each step is the full
train step: forward + backward + global-norm clip + AdamW update, dropout 0.1 (hidden and attention) in all three.
Warm-up steps (incl. compilation) are excluded; the step time is the median of `--steps` timed steps, each timed
to completion (the loss is read back). The fp32 matmul peak of this machine is measured in the same run
(torch 2048³ float32 matmul, best of several, before every round) and MFU = model FLOP/s ÷ that peak.
On a shared 2-core machine other processes inflate wall times: `--rounds R` repeats all jobs interleaved and keeps,
per job, the round with the lowest median; the load average is printed with the table.

Model FLOPs (`tupe_jax.metrics.transformer_training_flops`, 3 × forward matmul FLOPs): ours runs the MLM head on
the P masked positions only (the gather form), HF runs it on every position; each row counts the head it runs.
tokens/s = batch × seq_len ÷ step time (all input tokens, the same for all three).

Prints a Markdown table and writes `--json` (default benchmarks/results_<shape>.json).
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

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

SHAPES = {  # layers, hidden, heads, mlp, vocab, seq, batch
    "small": (4, 256, 4, 1024, 8192, 128, 16),
    "base": (12, 768, 12, 3072, 30522, 128, 4),
}
ALL_SCHEMES = ("bert_a", "sinusoidal", "rope", "alibi", "t5", "bert_r", "nopos", "tupe_a", "tupe_r", "bert_ad",
               "tupe_a:concat", "tupe_r:concat")


# ================================================================================================ shared
def shape_args(args) -> dict:
    layers, hidden, heads, mlp, vocab, seq, batch = SHAPES[args.shape]
    return dict(layers=args.layers or layers, hidden=args.hidden or hidden, heads=args.heads or heads,
                mlp=args.mlp or mlp, vocab=args.vocab or vocab, seq=args.seq or seq, batch=args.batch or batch)


def synthetic_batches(s: dict, count: int, predictions: int, seed: int = 0):
    """MLM batches in the format of `tupe_jax.data.pretrain_iterator` (gather form), NumPy."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        tokens = rng.integers(5, s["vocab"], (s["batch"], s["seq"])).astype(np.int32)
        tokens[:, 0] = 2  # [CLS]
        positions = np.sort(np.stack([rng.choice(np.arange(1, s["seq"]), predictions, replace=False)
                                      for _ in range(s["batch"])]), axis=1).astype(np.int32)
        labels = np.take_along_axis(tokens, positions, axis=1).copy()
        inputs = tokens.copy()
        np.put_along_axis(inputs, positions, 4, axis=1)  # [MASK]
        out.append({"inputs": inputs, "input_mask": np.ones_like(inputs), "mlm_positions": positions,
                    "mlm_labels": labels, "mlm_weights": np.ones(positions.shape, np.float32)})
    return out


def dense_labels(batch: dict, ignore: int):
    """(B, L) labels with `ignore` where no prediction is asked for (HF convention)."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    labels = np.full(batch["inputs"].shape, ignore, np.int32)
    np.put_along_axis(labels, batch["mlm_positions"], batch["mlm_labels"], axis=1)
    return labels


def time_steps(step, warmup: int, steps: int) -> list[float]:
    """`step()` must run one full step and return only when it is done. Returns per-step seconds."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def hf_config(s: dict, dropout: float):
    from transformers import BertConfig  # pylint: disable=import-outside-toplevel
    return BertConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                      num_attention_heads=s["heads"], intermediate_size=s["mlp"], max_position_embeddings=s["seq"],
                      hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, hidden_act="gelu",
                      layer_norm_eps=1e-12)


# ================================================================================================ workers
def worker_ours(args, s: dict) -> dict:
    import jax  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    sys.path.insert(0, ROOT)
    from configs.pretrain import get_config  # pylint: disable=import-outside-toplevel
    from tupe_jax.optim import make_optimizer  # pylint: disable=import-outside-toplevel
    from tupe_jax.data.batch import LMBatch  # pylint: disable=import-outside-toplevel
    from tupe_jax.model import ModelConfig, TransformerLM  # pylint: disable=import-outside-toplevel
    from tupe_jax.pretrain.steps import make_train_step  # pylint: disable=import-outside-toplevel
    from tupe_jax.trainer import init_state_fn  # pylint: disable=import-outside-toplevel
    import flax.linen as nn  # pylint: disable=import-outside-toplevel

    scheme, _, form = args.worker_arg.partition(":")
    config = get_config(f"pe={scheme},size={args.shape}")
    with config.unlocked():
        m = config.model
        m.num_layers, m.hidden_size, m.num_heads, m.mlp_dim = s["layers"], s["hidden"], s["heads"], s["mlp"]
        m.vocab_size, m.max_len, m.dtype = s["vocab"], s["seq"], "float32"
        m.dropout_rate = m.attention_dropout_rate = args.dropout
        m.tupe_form = form or "bias"
        m.attention_backend = args.backend
        config.train.batch_size, config.train.steps, config.train.warmup_steps = s["batch"], 1000, 10
    model = TransformerLM(ModelConfig.from_config(config.model))
    tx, schedule = make_optimizer(config.train)
    state = jax.jit(lambda r: nn.meta.unbox(init_state_fn(model, tx, config.model.max_len)(r)))(jax.random.PRNGKey(0))
    step_fn = jax.jit(make_train_step(model, tx, schedule, 1), donate_argnums=0)
    batches = [jax.device_put(LMBatch(targets=None, weights=None, **b))     # prefetched onto the device
               for b in synthetic_batches(s, 4, args.predictions)]
    holder = {"state": state, "i": 0}

    def step():
        holder["state"], metrics = step_fn(holder["state"], batches[holder["i"] % len(batches)])
        holder["i"] += 1
        return float(metrics["loss"])  # waits for the step

    times = time_steps(step, args.warmup, args.steps)
    # pipelined throughput: dispatch everything, sync once (what the training loop does)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        holder["state"], metrics = step_fn(holder["state"], batches[holder["i"] % len(batches)])
        holder["i"] += 1
    jax.block_until_ready(metrics["loss"])
    pipelined = (time.perf_counter() - t0) / args.steps
    loss = float(metrics["loss"])
    if args.profile_dir:
        jax.profiler.start_trace(args.profile_dir)
        for _ in range(3):
            step()
        jax.profiler.stop_trace()
    return {"times": times, "pipelined_s": pipelined, "final_loss": loss, "predictions": args.predictions,
            "threads": f"XLA CPU ({os.cpu_count()} cores visible)", "version": f"jax {jax.__version__}",
            "devices": str(jax.devices()), "np": np.__version__}


def worker_torch(args, s: dict) -> dict:
    import torch  # pylint: disable=import-outside-toplevel
    from transformers import BertForMaskedLM  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel
    torch.manual_seed(0)
    model = BertForMaskedLM(hf_config(s, args.dropout))
    model.train()
    decay = [p for n, p in model.named_parameters() if not ("bias" in n or "LayerNorm" in n)]
    no_decay = [p for n, p in model.named_parameters() if "bias" in n or "LayerNorm" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=5e-4, betas=(0.9, 0.999), eps=1e-6)
    batches = []
    for b in synthetic_batches(s, 4, args.predictions):
        batches.append((torch.from_numpy(b["inputs"]).long(), torch.from_numpy(b["input_mask"]).long(),
                        torch.from_numpy(dense_labels(b, -100)).long()))
    holder = {"i": 0, "loss": 0.0}

    def step():
        ids, mask, labels = batches[holder["i"] % len(batches)]
        holder["i"] += 1
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        holder["loss"] = float(out.loss)

    times = time_steps(step, args.warmup, args.steps)
    return {"times": times, "final_loss": holder["loss"], "predictions": None,
            "threads": f"torch.get_num_threads()={torch.get_num_threads()}",
            "version": f"torch {torch.__version__}, transformers {transformers.__version__}, "
                       f"attn={model.config._attn_implementation}"}  # pylint: disable=protected-access


def worker_flax(args, s: dict) -> dict:
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    import optax  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel
    from transformers import FlaxBertForMaskedLM  # pylint: disable=import-outside-toplevel

    model = FlaxBertForMaskedLM(hf_config(s, args.dropout), seed=0, dtype=jnp.float32)

    def decay_mask(params):
        flat = {k: not (k[-1] == "bias" or "LayerNorm" in "/".join(k))
                for k in __import__("flax").traverse_util.flatten_dict(params)}
        return __import__("flax").traverse_util.unflatten_dict(flat)

    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(5e-4, b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.01, mask=decay_mask))
    params = model.params
    state = {"params": params, "opt": tx.init(params), "rng": jax.random.PRNGKey(0)}

    def train_step(state, batch):
        rng, dropout_rng = jax.random.split(state["rng"])

        def loss_fn(p):  # as in HF's run_mlm_flax.py: dense logits, labels -100 ignored
            logits = model(batch["inputs"], attention_mask=batch["input_mask"], params=p, dropout_rng=dropout_rng,
                           train=True)[0]
            weights = (batch["labels"] >= 0).astype(jnp.float32)
            labels = jnp.maximum(batch["labels"], 0)
            nll = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
            return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1.0)

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt, "rng": rng}, loss

    step_fn = jax.jit(train_step, donate_argnums=0)
    batches = [jax.device_put({"inputs": b["inputs"], "input_mask": b["input_mask"],
                               "labels": dense_labels(b, -100)}) for b in synthetic_batches(s, 4, args.predictions)]
    holder = {"state": state, "i": 0, "loss": 0.0}

    def step():
        holder["state"], loss = step_fn(holder["state"], batches[holder["i"] % len(batches)])
        holder["i"] += 1
        holder["loss"] = float(loss)

    times = time_steps(step, args.warmup, args.steps)
    return {"times": times, "final_loss": holder["loss"], "predictions": None,
            "threads": f"XLA CPU ({os.cpu_count()} cores visible)",
            "version": f"transformers {transformers.__version__}, jax {jax.__version__}"}


WORKERS = {"ours": worker_ours, "torch": worker_torch, "flax": worker_flax}


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
                                      causal=False, mlm_predictions=predictions)


def run_worker(args, kind: str, arg: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--worker_arg", arg]
    for key in ("shape", "layers", "hidden", "heads", "mlp", "vocab", "seq", "batch", "steps", "warmup",
                "predictions", "dropout", "backend", "profile_dir"):
        value = getattr(args, key)
        if value not in (None, ""):
            cmd += [f"--{key}", str(value)]
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="small", choices=sorted(SHAPES))
    for key in ("layers", "hidden", "heads", "mlp", "vocab", "seq", "batch"):
        ap.add_argument(f"--{key}", type=int, default=0, help="override the shape preset")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation included)")
    ap.add_argument("--predictions", type=int, default=0, help="MLM slots per sequence (0: ceil(0.15·seq))")
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--rounds", type=int, default=1, help="repeat all jobs, interleaved; keep each job's best round")
    ap.add_argument("--backend", default="einsum", help="ours: model.attention_backend (einsum|xla)")
    ap.add_argument("--schemes", default=",".join(ALL_SCHEMES), help="ours; 'scheme:concat' = TUPE concat form")
    ap.add_argument("--peers", default="torch,flax", help="HF peers to run: torch,flax (or empty)")
    ap.add_argument("--json", default="")
    ap.add_argument("--profile_dir", default="", help="ours: also write a jax.profiler trace of 3 steps here")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    ap.add_argument("--worker_arg", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    s = shape_args(args)
    args.predictions = args.predictions or -(-15 * s["seq"] // 100)

    if args.worker:
        print(json.dumps(WORKERS[args.worker](args, s)))
        return

    load_before = os.getloadavg()
    jobs = [("ours", x) for x in args.schemes.split(",") if x] + [(p, "") for p in args.peers.split(",") if p]
    peaks, best = [], {}
    for round_index in range(args.rounds):  # rounds interleave the jobs; per job the round with the lowest median
        peak, torch_threads = matmul_peak()
        peaks.append(peak)
        for kind, arg in jobs:
            t0 = time.perf_counter()
            result = run_worker(args, kind, arg)
            result.update(kind=kind, scheme=arg, wall_s=round(time.perf_counter() - t0, 1), round=round_index,
                          loadavg_1m=os.getloadavg()[0])
            old = best.get((kind, arg))
            if old is None or ("times" in result and ("times" not in old or
                                                      statistics.median(result["times"]) <
                                                      statistics.median(old["times"]))):
                best[(kind, arg)] = result
            print(f"# round {round_index} {kind} {arg}: " + (f"{1e3 * statistics.median(result['times']):.1f} ms"
                  if "times" in result else str(result)), file=sys.stderr, flush=True)
    peak = max(peaks)
    rows = []
    for kind, arg in jobs:
        result = best[(kind, arg)]
        if "times" in result:
            step_s = statistics.median(result["times"])
            result["min_step_ms"] = 1e3 * min(result["times"])
            flops = model_flops(s, result["predictions"])
            result.update(step_ms=1e3 * step_s, tokens_per_s=s["batch"] * s["seq"] / step_s,
                          model_flops_per_step=flops, model_flops_per_s=flops / step_s,
                          mfu=flops / step_s / peak)
        rows.append(result)

    names = {"ours": "tupe-jax", "torch": "HF BertForMaskedLM (PyTorch)", "flax": "HF FlaxBertForMaskedLM"}
    bert = next((r for r in rows if r["kind"] == "ours" and r["scheme"] == "bert_a" and "step_ms" in r), None)
    print(f"\nshape={args.shape} {s} dropout={args.dropout} backend={args.backend} predictions/seq="
          f"{args.predictions} steps={args.steps} (median) warmup={args.warmup}")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; fp32 matmul peak "
          f"(torch 2048³, best of 7, {torch_threads} threads, max over {len(peaks)} rounds: "
          f"{', '.join(f'{p / 1e9:.1f}' for p in peaks)}) = {peak / 1e9:.1f} GFLOP/s; load average before "
          f"{load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}; rounds={args.rounds}\n")
    print("| implementation | scheme | step ms (median) | step ms (min) | tokens/s | model GFLOP/step | "
          "model GFLOP/s | MFU | vs BERT-A step |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "step_ms" not in r:
            print(f"| {names[r['kind']]} | {r['scheme'] or 'bert'} | error: {r.get('error')} | | | | | | |")
            continue
        rel = f"{r['step_ms'] / bert['step_ms']:.3f}×" if bert else ""
        print(f"| {names[r['kind']]} | {r['scheme'] or 'BERT (learned abs.)'} | {r['step_ms']:.1f} | "
              f"{r['min_step_ms']:.1f} | "
              f"{r['tokens_per_s']:,.0f} | {r['model_flops_per_step'] / 1e9:.1f} | "
              f"{r['model_flops_per_s'] / 1e9:.1f} | {100 * r['mfu']:.1f}% | {rel} |")
    if bert:
        for kind in ("torch", "flax"):
            peer = next((r for r in rows if r["kind"] == kind and "step_ms" in r), None)
            if peer:
                print(f"\nBERT-A tokens/s ÷ {names[kind]} = {bert['tokens_per_s'] / peer['tokens_per_s']:.2f}×")
    for r in rows:
        if "threads" in r:
            print(f"- {names[r['kind']]} {r['scheme']}: {r['version']}; {r['threads']}; final loss "
                  f"{r['final_loss']:.3f}" + (f"; pipelined (one sync) {1e3 * r['pipelined_s']:.1f} ms/step"
                                              if "pipelined_s" in r else ""))
    out = args.json or os.path.join(HERE, f"results_{args.shape}.json")
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"shape": s, "args": vars(args), "peak_flops": peak, "peaks": peaks, "torch_threads": torch_threads,
                   "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
