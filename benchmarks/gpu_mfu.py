"""BERT-base MLM training-step MFU on one GPU (seq 512, bfloat16): bert_a, tupe_a and tupe_r, bias vs concat form,
XLA, cuDNN or the pallas kernel for attention. Prepared to finish in under 5 minutes on an H100/H200; not a test.

    pip install -e ".[bench]" "jax[cuda12]"     # on the GPU machine
    python benchmarks/gpu_mfu.py [--batch 32] [--steps 20] [--budget_s 270] [--json gpu_mfu.json]
    python benchmarks/gpu_mfu.py --smoke         # 2-layer d128 seq 128 on any backend (checks the script itself)

Per configuration: `configs/pretrain.py:pe=<scheme>,size=base` (12 layers, d 768, 12 heads, MLP 3072, vocab 30522),
max_len 512, dtype bfloat16 (params float32), attention-probability dropout `--attention_dropout` (default 0: the
xla and cudnn paths run only without it; 0.1 = the paper's recipe, which they train through the einsum path and the
pallas kernel keeps, with the einsum path's masks; hidden dropout stays 0.1), no padding (input_mask None, so no
mask reaches the kernel), MLM head on the P = 77 masked positions, and since session 51 the last block's rows past
its keys and values too (`model.last_layer_rows`, configs/pretrain.py's default). The full jitted train step (forward + backward + clip + AdamW, donated state, batches already
on the device) is timed over `--steps` steps after `--warmup` steps; step time = median, each step synced.
Model FLOPs from `tupe_jax.metrics.transformer_training_flops`; MFU against (a) the device's dense bf16 peak from
`tupe_jax.metrics.PEAK_TFLOPS` and (b) a bf16 8192³ matmul measured in the same run. A configuration that fails
(e.g. cuDNN refusing a shape) is reported with its error; configurations are skipped once `--budget_s` is spent.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
from outputs import refuse_below, refuse_missing_folder, write_json  # noqa: E402  pylint: disable=wrong-import-position

# (scheme, tupe_form, attention_backend[, dropout_rng]); cheapest-to-skip last
CONFIGS = [("bert_a", "bias", "cudnn"), ("tupe_a", "bias", "cudnn"), ("tupe_a", "concat", "cudnn"),
           ("bert_a", "bias", "xla"), ("tupe_a", "bias", "xla"), ("tupe_a", "concat", "xla"),
           ("tupe_r", "bias", "cudnn")]


def measured_matmul_peak(dtype_name: str, n: int) -> float:
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    dtype = jnp.bfloat16 if dtype_name == "bfloat16" else jnp.float32
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), dtype)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), dtype)
    mm = jax.jit(lambda x, y: x @ y)
    mm(a, b).block_until_ready()
    best = float("inf")
    for _ in range(10):
        t0 = time.perf_counter()
        mm(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best


def run_config(args, scheme: str, form: str, backend: str, rng_impl: str = "threefry2x32",
               causal_mask: str = "explicit") -> dict:
    import flax.linen as nn  # pylint: disable=import-outside-toplevel
    import jax  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    from configs.pretrain import get_config  # pylint: disable=import-outside-toplevel
    from tupe_jax.metrics import transformer_training_flops  # pylint: disable=import-outside-toplevel
    from tupe_jax.optim import make_optimizer  # pylint: disable=import-outside-toplevel
    from tupe_jax.data.batch import LMBatch  # pylint: disable=import-outside-toplevel
    from tupe_jax.model import ModelConfig, TransformerLM  # pylint: disable=import-outside-toplevel
    from tupe_jax.pretrain.steps import make_train_step  # pylint: disable=import-outside-toplevel
    from tupe_jax.trainer import init_state_fn  # pylint: disable=import-outside-toplevel

    from tupe_jax import attention  # pylint: disable=import-outside-toplevel
    attention.NATIVE_CAUSAL_MASK = causal_mask == "native"   # read when the step is traced below
    causal = args.objective == "clm"
    config = get_config(f"pe={scheme},size={'tiny' if args.smoke else 'base'},objective={args.objective}")
    with config.unlocked():
        m = config.model
        m.max_len, m.dtype = args.seq, args.dtype
        m.attention_dropout_rate = args.attention_dropout
        m.tupe_form, m.attention_backend = form, backend
        config.train.batch_size, config.train.steps, config.train.warmup_steps = args.batch, 10_000, 100
    cfg = ModelConfig.from_config(config.model)
    model = TransformerLM(cfg)
    tx, schedule = make_optimizer(config.train)
    state = jax.jit(lambda r: nn.meta.unbox(init_state_fn(model, tx, cfg.max_len)(r)))(jax.random.PRNGKey(0))
    step_fn = jax.jit(make_train_step(model, tx, schedule, 1, rng_impl), donate_argnums=0)
    if args.pallas_blocks:   # QxK[xKb] tiles of the pallas kernel (tupe_jax/kernels/flash.py)
        from tupe_jax.kernels import flash  # pylint: disable=import-outside-toplevel
        tiles = [int(x) for x in args.pallas_blocks.split("x")]
        flash.BLOCK_Q, flash.BLOCK_K = tiles[:2]
        flash.BACKWARD_BLOCK_K = tiles[2] if len(tiles) > 2 else flash.BACKWARD_BLOCK_K
    if args.pallas_warps:    # Triton's num_warps for every pallas kernel (tupe_jax/kernels/calls.py)
        from tupe_jax.kernels import calls  # pylint: disable=import-outside-toplevel
        calls.NUM_WARPS = args.pallas_warps
    predictions = -(-15 * args.seq // 100)
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(2):
        inputs = rng.integers(5, cfg.vocab_size, (args.batch, args.seq)).astype(np.int32)
        if causal:   # every next token scored; no padding, so the mask is the bare causal triangle
            batches.append(jax.device_put(LMBatch(inputs=inputs, targets=np.roll(inputs, -1, 1),
                                                  weights=np.ones(inputs.shape, np.float32))))
            continue
        positions = np.sort(np.stack([rng.choice(np.arange(1, args.seq), predictions, replace=False)
                                      for _ in range(args.batch)]), axis=1).astype(np.int32)
        batches.append(jax.device_put(LMBatch(
            inputs=inputs, targets=None, weights=None, mlm_positions=positions,
            mlm_labels=np.take_along_axis(inputs, positions, 1), mlm_weights=np.ones(positions.shape, np.float32))))
    from tupe_jax.kernels.flash import TRITON_CALL  # pylint: disable=import-outside-toplevel
    lowered = step_fn.lower(state, batches[0]).as_text()
    kernels = [name for name, call in (("pallas", TRITON_CALL), ("cudnn", "__cudnn$fmha")) if call in lowered]
    t0 = time.perf_counter()
    for i in range(args.warmup):
        state, metrics = step_fn(state, batches[i % 2])
    loss0 = float(metrics["loss"])
    compile_and_warmup = time.perf_counter() - t0
    times = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        state, metrics = step_fn(state, batches[i % 2])
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    if args.profile_dir:  # a jax.profiler trace of 3 steps, copied up to <profile_dir>/trace_<config>.json.gz
        import glob  # pylint: disable=import-outside-toplevel
        import shutil  # pylint: disable=import-outside-toplevel
        tmp = f"/tmp/gpu_mfu_trace_{scheme}_{form}_{backend}_{rng_impl}"
        jax.profiler.start_trace(tmp)
        for i in range(3):
            state, metrics = step_fn(state, batches[i % 2])
        jax.block_until_ready(metrics["loss"])
        jax.profiler.stop_trace()
        for path in glob.glob(f"{tmp}/**/*.trace.json.gz", recursive=True)[:1]:
            shutil.copy(path, os.path.join(args.profile_dir, f"trace_{scheme}_{form}_{backend}_{rng_impl}.json.gz"))
    flops = transformer_training_flops(cfg.num_layers, cfg.hidden_size, cfg.mlp_dim, cfg.vocab_size, args.seq,
                                       args.batch, causal=causal, mlm_predictions=None if causal else predictions,
                                       last_layer_predictions=cfg.last_layer_rows == "predicted")
    return {"scheme": scheme, "form": form, "backend": backend, "dropout_rng": rng_impl,
            "last_layer_rows": cfg.last_layer_rows,    # configs/pretrain.py's (predicted since session 51)
            "objective": args.objective, "causal_mask": causal_mask if causal else "",
            "attention_dropout": args.attention_dropout,
            "attention_kernels": kernels,   # the fused kernels in the compiled step (none: the einsum path ran)
            "fused_attention_ran": bool(kernels) or (backend == "xla" and args.attention_dropout == 0.0),
            "pallas_blocks": args.pallas_blocks, "pallas_warps": args.pallas_warps,
            "pallas_dropout_mask": attention.PALLAS_DROPOUT_MASK,
            "step_ms": 1e3 * step_s,
            "min_step_ms": 1e3 * min(times), "tokens_per_s": args.batch * args.seq / step_s,
            "model_tflops_per_s": flops / step_s / 1e12, "model_tflop_per_step": flops / 1e12,
            "loss_after_warmup": loss0, "final_loss": float(metrics["loss"]),
            "compile_and_warmup_s": compile_and_warmup}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--budget_s", type=float, default=270.0, help="stop starting new configurations after this")
    ap.add_argument("--configs", default="", help="subset, e.g. 'bert_a:bias:cudnn,tupe_a:concat:cudnn:rbg' "
                    "(scheme:tupe_form:attention_backend[:dropout_rng])")
    ap.add_argument("--attention_dropout", type=float, default=0.0,
                    help="0.1 = the paper's recipe (xla/cudnn then fall back to the einsum path in training; pallas "
                         "keeps its kernel, with the einsum path's masks)")
    ap.add_argument("--pallas_blocks", default="", help="QxK[xKb] tiles of the pallas kernel: query and key tile "
                    "of the forward [and the backward's key tile], e.g. 64x128x64 (default: tupe_jax/kernels/flash.py's "
                    "BLOCK_Q, BLOCK_K, BACKWARD_BLOCK_K)")
    ap.add_argument("--pallas_warps", type=int, default=0, help="Triton num_warps of the pallas kernels (default: "
                    "tupe_jax/kernels/calls.py's NUM_WARPS, 4; benchmarks/triton_registers.py: at 8 the dK/dV kernel "
                    "with the precomputed mask needs no spill)")
    ap.add_argument("--objective", default="mlm", help="mlm, or clm: a causal LM scoring every next token")
    ap.add_argument("--causal_mask", default="explicit", help="clm only: explicit (the (1, 1, L, L) triangle), "
                    "native (attention.NATIVE_CAUSAL_MASK: is_causal=True) or both, e.g. explicit,native: each "
                    "configuration runs once per mode")
    ap.add_argument("--smoke", action="store_true", help="tiny model, seq 128, batch 4, float32, 2 steps")
    ap.add_argument("--json", default="")
    ap.add_argument("--profile_dir", default="", help="also write a 3-step jax.profiler trace per configuration")
    args = ap.parse_args()
    out = args.json or os.path.join(os.environ.get("OUT", HERE), "gpu_mfu.json")
    refuse_missing_folder(out)
    refuse_below(args, steps=1, warmup=0)
    if args.smoke:
        args.seq, args.batch, args.steps, args.warmup, args.dtype = 128, 4, 2, 1, "float32"
    start = time.perf_counter()

    import jax  # pylint: disable=import-outside-toplevel
    from tupe_jax.metrics import peak_tflops  # pylint: disable=import-outside-toplevel
    device = jax.devices()[0]
    table_peak = peak_tflops(0.0, device.device_kind)
    measured = measured_matmul_peak(args.dtype, 2048 if args.smoke else 8192)
    configs = CONFIGS if not args.configs else [tuple(c.split(":")) for c in args.configs.split(",")]
    rows = []

    def write(rows: list) -> None:     # quietly: rewritten after every configuration
        write_json(out, {"device": device.device_kind, "jax": jax.__version__, "args": vars(args),
                         "table_peak_tflops": table_peak, "measured_peak_flops": measured, "rows": rows},
                   announce=False)

    write(rows)
    modes = args.causal_mask.split(",") if args.objective == "clm" else ["explicit"]
    for (scheme, form, backend, *rng), mode in [(c, m) for c in configs for m in modes]:
        rng_impl = rng[0] if rng else "threefry2x32"
        if time.perf_counter() - start > args.budget_s:
            rows.append({"scheme": scheme, "form": form, "backend": backend, "dropout_rng": rng_impl,
                         "causal_mask": mode, "error": "skipped: time budget spent"})
            continue
        try:
            row = run_config(args, scheme, form, backend, rng_impl, mode)
        except Exception as e:  # pylint: disable=broad-except
            row = {"scheme": scheme, "form": form, "backend": backend, "dropout_rng": rng_impl, "causal_mask": mode,
                   "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}",
                   "traceback": traceback.format_exc()[-2000:]}
        rows.append(row)
        print("#", json.dumps({k: v for k, v in row.items() if k != "traceback"}), file=sys.stderr, flush=True)
        write(rows)   # after every configuration, so a run cut off by its timeout keeps the rows it finished

    print(f"\ndevice: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}; BERT-base "
          f"{'(smoke: tiny) ' if args.smoke else ''}seq {args.seq}, batch {args.batch}, {args.dtype}; "
          f"median of {args.steps} steps after {args.warmup}; peak: table {table_peak:.0f} TFLOP/s, measured "
          f"{args.dtype} matmul {measured / 1e12:.1f} TFLOP/s; total {time.perf_counter() - start:.0f} s\n")
    print("| scheme | form | attention | dropout rng, causal mask | step ms | tokens/s | model TFLOP/s | "
          "MFU (table peak) | "
          "MFU (measured) |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['scheme']} | {r['form']} | {r['backend']} | {r['dropout_rng']} {r.get('causal_mask', '')} | "
                  f"{r['error']} | | | | |")
            continue
        mfu_table = f"{100 * r['model_tflops_per_s'] / table_peak:.1f}%" if table_peak else "n/a"
        print(f"| {r['scheme']} | {r['form']} | {r['backend']} | {r['dropout_rng']} {r['causal_mask']} | "
              f"{r['step_ms']:.1f} | "
              f"{r['tokens_per_s']:,.0f} | "
              f"{r['model_tflops_per_s']:.1f} | {mfu_table} | "
              f"{100 * r['model_tflops_per_s'] * 1e12 / measured:.1f}% |")
    failed = [r for r in rows if "error" in r and "cuDNN is not detected" not in r["error"]]
    if args.smoke and failed:  # the smoke checks the script itself: any other failure is a non-zero exit
        sys.exit(f"smoke: {len(failed)} configuration(s) failed: {failed[0]['error']}")


if __name__ == "__main__":
    main()
