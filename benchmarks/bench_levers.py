"""In-process A/B of train-step variants (speed levers) at the benchmark's reference shape; not a test.

    python benchmarks/bench_levers.py --slots 128 --rounds 5 --json benchmarks/results_levers_cpu.json

One process builds every variant (bert_a, `size=small`: 4 layers, d 256, 4 heads, MLP 1024, vocab 8192, batch 16 ×
128, float32, dropout 0.1), compiles each, then runs `--steps` synced steps of each variant in turn (each round one
later first), `--rounds` times. A variant's ratio to "current" is computed within each round; reported: the median
over rounds with its min–max (the machine may be shared: the spread is the noise) and, from 6 rounds, the median's
95% interval (`rounds.spread`). `--slots`: MLM head slots per row (20 = the default head on the masked positions, 128
= equal work with HF). Variants:
- current: the code as it is;
- argmax (before): the accuracy metric via `jnp.argmax` instead of `head.argmax_hits`;
- two-pass accuracy (before): `argmax_hits` before its one-pass form (a max, then a check for an earlier tie);
- uint32 mask halves (before): `dropout.keep_mask16` as it was before it compared the 16-bit halves before putting
  them side by side (a uint32 concatenation of the halves, then the compare; the same masks);
- rbg / unsafe_rbg: `train.dropout_rng` (different dropout masks, same statistics);
- logits head (before): the loss and accuracy from the full (M, V) logits (`head.tied_logits`, optax's cross
  entropy, `argmax_hits`) instead of `head.tied_cross_entropy`'s chunks with the gradient in the forward;
- plain head (before): the tied output projection as `nn.Embed.attend` (XLA's own layouts) instead of
  `tupe_jax.head.tied_logits` (`projection.matmul` against a materialised Eᵀ; at commit 59d342f this lever was
  the variant "head custom VJP (tried)" against the plain head, results_levers_*.json);
- plain projections (before): every Dense layer with `lax.dot_general` (XLA's own layouts) instead of
  `tupe_jax.projection.dense_dot_general` (its custom VJP: the weight gradient transposes the smaller operand);
- dX through Wᵀ (tried): `projection.matmul`'s input gradient g · Wᵀ against a materialised Wᵀ when the weight
  is taller than wide (the MLP output projection), instead of XLA's transposed-operand dot;
- dW as a TN dot (tried): the weight gradient as XLA's `dot_general` over both operands' long M axis, instead of
  the transpose of the smaller operand materialised first;
- tall dW transpose folded (before): a tall weight's gradient (gᵀ·x)ᵀ (the MLP output projection's) without the
  barrier before the transpose, which XLA folds into one dot that XLA:CPU runs on Eigen instead of YNNPACK;
- jax.nn.gelu (before): the MLP and head GELU as `jax.nn.gelu(approximate=False)` (its erfc form) instead of
  `tupe_jax.activations.gelu` (the erf form: the same function in fewer, cheaper passes on XLA:CPU);
- dropout_bits=16 / dropout_bits=32: `model.dropout_bits` (tupe_jax/dropout.py: four masks per threefry hash, the
  default, or flax's one);
- no dropout: dropout 0 (hidden and attention), an upper bound on what any cheaper mask scheme could save;
- last layer at every row (before): `model.last_layer_rows=all` (at `--slots 128` both variants run every row);
- tupe_a / tupe_r: the same step for that scheme instead of bert_a (the scheme's cost, measured in one process,
  where the rounds alternate within seconds: steadier than bench_train's one process per job);
- XLA dots (before): the step with its dots on XLA:CPU's default library (YNNPACK), not oneDNN
  (`tupe_jax.xla_options`; before that module the variant was "oneDNN dots (tried)", the other way round);
- rolled threefry (before): the 16-bit masks' threefry hash as JAX's `threefry2x32_p`, whose XLA:CPU lowering is
  a rolled while loop whose outputs XLA copies, instead of `kernels/threefry.py`'s written out as uint32
  operations (bit for bit the same masks; before session 28 the variant was "unrolled threefry (tried)");
- transposed-operand dEᵀ (before): the chunked head as before session 49 (`bench_head.before_chunked_fwd`);
- head chunks of 512 / 1024 rows: the chunked head's default chunk (`head.CHUNK_BYTES`, 256 rows at vocab 8192)
  at that many rows (the plain form still runs below two chunks' worth of rows);
- dX then dW / dW then dX (tried): each projection's two backward products one after the other, not both at once;
- oneDNN dots with elementwise (tried): oneDNN fusions that take in a dot's elementwise neighbours (in the step:
  the MLM bias add, the head's gradient accumulation and four scalings) instead of one call per bare dot;
- memory- / concurrency-optimised schedule (tried): `xla_cpu_scheduler_type` other than the default;
- HF Flax (peer), HF torch (peer): HF `FlaxBertForMaskedLM`'s and `BertForMaskedLM`'s steps as bench_train runs
  them (dense logits over all 128 positions, whatever `--slots`; torch's default threads): at `--slots 128` the
  equal-work ratios without the spread between processes; HF Flax (peer) with oneDNN dots: compiled as ours is.
`--variants` picks a subset (comma-separated names; "current" always runs). Each round records wall ms and the
process's CPU ms (all threads) per step: on a loaded machine the CPU time is the steadier of the two. For the HF
peers use `--steps 8`: timed 2 steps at a time the peers ran a fifth slower than in their own processes and ours did
not, so those ratios flatter ours (RESULTS.md, "The same VM three hours later (session 27)"); 8 steps at a time they
ran at their own speed.
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from outputs import refuse_below, refuse_missing_folder, refuse_unknown, write_json  # noqa: E402  pylint: disable=wrong-import-position
from bench_head import before_chunked_fwd  # noqa: E402  pylint: disable=wrong-import-position
from lever_variants import (  # noqa: E402  pylint: disable=wrong-import-position
    logits_batch_loss, matmul_bwd_variant, rolled_hash_words, two_pass_hits, uint32_halves_mask)
from rounds import rotated, spread  # noqa: E402  pylint: disable=wrong-import-position
from tupe_jax.xla_options import ONEDNN_DOTS  # noqa: E402  pylint: disable=wrong-import-position


def build(slots: int, rng_impl: str = "threefry2x32", plain_argmax: bool = False, dropout: float = 0.1,
          dropout_bits: int = 0, plain_head: bool = False, plain_projections: bool = False,
          plain_gelu: bool = False, two_pass_accuracy: bool = False, uint32_halves: bool = False,
          matmul_bwd=None, scheme: str = "bert_a", logits_head: bool = False,
          compiler_options: Optional[dict] = None, rolled_hash: bool = False, head_fwd=None,
          last_layer_rows: str = "", head_chunk_bytes: int = 0) -> dict:
    import flax.linen as nn  # pylint: disable=import-outside-toplevel
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    from train_workers import shape as train_shape, synthetic_batches  # pylint: disable=import-outside-toplevel
    from configs.pretrain import get_config  # pylint: disable=import-outside-toplevel
    from tupe_jax.data.batch import LMBatch  # pylint: disable=import-outside-toplevel
    from tupe_jax.model import ModelConfig, Transformer, TransformerLM  # pylint: disable=import-outside-toplevel
    from tupe_jax.optim import make_optimizer  # pylint: disable=import-outside-toplevel
    from tupe_jax.pretrain import steps  # pylint: disable=import-outside-toplevel
    from tupe_jax.trainer import init_state_fn  # pylint: disable=import-outside-toplevel

    shape = train_shape("small")
    config = get_config(f"pe={scheme},size=small")
    with config.unlocked():
        config.model.dropout_rate = config.model.attention_dropout_rate = dropout
        config.model.dropout_bits = dropout_bits or config.model.dropout_bits     # 0: the config's default
        config.model.last_layer_rows = last_layer_rows or config.model.last_layer_rows
        config.train.batch_size, config.train.steps, config.train.warmup_steps = shape["batch"], 1000, 10
    model = TransformerLM(ModelConfig.from_config(config.model))
    tx, schedule = make_optimizer(config.train)
    state = jax.jit(lambda r: nn.meta.unbox(init_state_fn(model, tx, shape["seq"])(r)))(jax.random.PRNGKey(0))
    from tupe_jax import attention as attention_lib, dropout as dropout_lib  # pylint: disable=import-outside-toplevel
    from tupe_jax import head as head_lib, model as model_lib  # pylint: disable=import-outside-toplevel
    kept, kept_attend, kept_dot, kept_gelu = (head_lib.argmax_hits, Transformer.attend, model_lib.dense_dot_general,
                                              model_lib.gelu)
    kept_loss, kept_chunk = steps.batch_loss, head_lib.CHUNK_BYTES
    head_lib.CHUNK_BYTES = head_chunk_bytes or kept_chunk
    kept_mask, kept_hash = dropout_lib.keep_mask16, dropout_lib._hash_words  # pylint: disable=protected-access
    from tupe_jax import projection  # pylint: disable=import-outside-toplevel
    if matmul_bwd is not None:
        projection.matmul.defvjp(projection._matmul_fwd, matmul_bwd)  # pylint: disable=protected-access
    if head_fwd is not None:
        head_lib._chunked.defvjp(head_fwd, head_lib._chunked_bwd)  # pylint: disable=protected-access
    if uint32_halves:
        dropout_lib.keep_mask16 = uint32_halves_mask
    if rolled_hash:
        dropout_lib._hash_words = rolled_hash_words  # pylint: disable=protected-access
    if plain_argmax:
        head_lib.argmax_hits = lambda logits, labels: (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
    if two_pass_accuracy:
        head_lib.argmax_hits = two_pass_hits
    if logits_head:
        steps.batch_loss = logits_batch_loss
    if plain_head:      # the code before head.tied_logits: nn.Embed.attend, XLA's own layouts
        Transformer.attend = lambda self, h: self.embed.attend(h)
    if plain_projections:   # the code before projection.dense_dot_general: XLA's own layouts
        model_lib.dense_dot_general = attention_lib.dense_dot_general = jax.lax.dot_general
    if plain_gelu:      # the code before activations.gelu: jax.nn.gelu's erfc form
        model_lib.gelu = lambda x: jax.nn.gelu(x, approximate=False)
    from tupe_jax import xla_options  # pylint: disable=import-outside-toplevel
    try:    # XLA options for this executable alone: the trainer's (xla_options.step_options), unless given
        step = jax.jit(steps.make_train_step(model, tx, schedule, 1, rng_impl), donate_argnums=0,
                       compiler_options=xla_options.step_options() if compiler_options is None else compiler_options)
        batches = [jax.device_put(LMBatch(targets=None, weights=None, **b))
                   for b in synthetic_batches(shape, 4, slots)]
        variant = {"state": state, "step": step, "batches": batches, "i": 0}
        run(variant, 2)   # compile (traced while the patch is in place) + one warm step
    finally:
        head_lib.argmax_hits, Transformer.attend, steps.batch_loss = kept, kept_attend, kept_loss
        head_lib.CHUNK_BYTES = kept_chunk
        model_lib.dense_dot_general = attention_lib.dense_dot_general = kept_dot
        model_lib.gelu = kept_gelu
        dropout_lib.keep_mask16, dropout_lib._hash_words = kept_mask, kept_hash  # pylint: disable=protected-access
        projection.matmul.defvjp(projection._matmul_fwd, projection._matmul_bwd)  # pylint: disable=protected-access
        head_lib._chunked.defvjp(head_lib._chunked_fwd, head_lib._chunked_bwd)  # pylint: disable=protected-access
    return variant


# The step's dots on XLA:CPU's default library (YNNPACK), as before `xla_options.step_options` sent them to oneDNN
XLA_DOTS = {"xla_cpu_use_onednn": False}
# oneDNN for the dots with elementwise neighbours fused into its calls (a bias or accumulator add, a scale)
ONEDNN_ELTWISE = {"xla_cpu_use_onednn": True,
                  "xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_ELTWISE"}


def build_hf_flax(slots: int, compiler_options: Optional[dict] = None) -> dict:
    """The HF Flax peer's step (`train_workers.flax_peer`) at the same shape, as a variant: its ratio to ours in
    the same process and rounds, free of bench_train's process-to-process spread."""
    from train_workers import shape as train_shape, flax_peer  # pylint: disable=import-outside-toplevel
    shape = train_shape("small")
    step, state, batches = flax_peer(shape, 0.1, slots, compiler_options)

    def with_metrics(state, batch):
        state, loss = step(state, batch)
        return state, {"loss": loss}
    variant = {"state": state, "step": with_metrics, "jitted": step, "batches": batches, "i": 0}
    run(variant, 2)
    return variant


def build_hf_torch(slots: int) -> dict:
    """The HF torch peer's step (`train_workers.torch_peer`, torch's default threads) at the same shape, as a
    variant. Its OpenMP workers spin between its operations, which counts as its CPU time: against torch only
    the wall ratio measures the step (benchmarks/RESULTS.md, "Both peers in one process")."""
    from train_workers import shape as train_shape, torch_peer  # pylint: disable=import-outside-toplevel
    shape = train_shape("small")
    step, _ = torch_peer(shape, 0.1, slots)
    variant = {"state": None, "step": lambda state, batch: (state, {"loss": step()}), "batches": [None] * 4, "i": 0}
    run(variant, 2)
    return variant


def run(variant: dict, n: int, cpu: bool = False) -> float:
    """Median seconds per step over `n` synced steps: wall time, or this process's CPU time if `cpu`."""
    clock = time.process_time if cpu else time.perf_counter
    times = []
    for _ in range(n):
        t0 = clock()
        variant["state"], metrics = variant["step"](variant["state"], variant["batches"][variant["i"] % 4])
        variant["i"] += 1
        float(metrics["loss"])
        times.append(clock() - t0)
    return statistics.median(times)


def interval(summary: dict) -> str:
    """', 95% interval a–b' for a `rounds.spread` summary that has one."""
    ci = summary["ci95"]
    return f", 95% interval of the median {ci[0]:.3f}–{ci[1]:.3f}" if ci else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--variants", default="", help="comma-separated subset of the variants (default: all)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    refuse_missing_folder(args.json)
    refuse_below(args, rounds=1, steps=1)
    load_before = os.getloadavg()
    makers = {"current": lambda: build(args.slots),
              "argmax (before)": lambda: build(args.slots, plain_argmax=True, logits_head=True),
              "rbg": lambda: build(args.slots, "rbg"), "unsafe_rbg": lambda: build(args.slots, "unsafe_rbg"),
              "two-pass accuracy (before)": lambda: build(args.slots, two_pass_accuracy=True, logits_head=True),
              "uint32 mask halves (before)": lambda: build(args.slots, uint32_halves=True),
              "logits head (before)": lambda: build(args.slots, logits_head=True),
              "plain head (before)": lambda: build(args.slots, plain_head=True, logits_head=True),
              "plain projections (before)": lambda: build(args.slots, plain_projections=True),
              "jax.nn.gelu (before)": lambda: build(args.slots, plain_gelu=True),
              "dX through Wᵀ (tried)": lambda: build(args.slots, matmul_bwd=matmul_bwd_variant(dx_through_transpose=True)),
              "dW as a TN dot (tried)": lambda: build(args.slots, matmul_bwd=matmul_bwd_variant(dw_tn=True)),
              "tall dW transpose folded (before)": lambda: build(args.slots,
                                                                 matmul_bwd=matmul_bwd_variant(folded_dw=True)),
              "dropout_bits=16": lambda: build(args.slots, dropout_bits=16),
              "dropout_bits=32": lambda: build(args.slots, dropout_bits=32),
              "no dropout": lambda: build(args.slots, dropout=0.0),
              "last layer at every row (before)": lambda: build(args.slots, last_layer_rows="all"),
              "tupe_a": lambda: build(args.slots, scheme="tupe_a"),
              "tupe_r": lambda: build(args.slots, scheme="tupe_r"),
              "XLA dots (before)": lambda: build(args.slots, compiler_options=XLA_DOTS),
              "rolled threefry (before)": lambda: build(args.slots, rolled_hash=True),
              "transposed-operand dEᵀ (before)": lambda: build(args.slots, head_fwd=before_chunked_fwd),
              "head chunks of 1024 rows": lambda: build(args.slots, head_chunk_bytes=1024 * 4 * 8192),
              "head chunks of 512 rows": lambda: build(args.slots, head_chunk_bytes=512 * 4 * 8192),
              "dX then dW (tried)": lambda: build(args.slots, matmul_bwd=matmul_bwd_variant(order="dx,dw")),
              "dW then dX (tried)": lambda: build(args.slots, matmul_bwd=matmul_bwd_variant(order="dw,dx")),
              "oneDNN dots with elementwise (tried)": lambda: build(args.slots, compiler_options=ONEDNN_ELTWISE),
              "memory-optimised schedule (tried)": lambda: build(args.slots, compiler_options={
                  **ONEDNN_DOTS, "xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}),
              "concurrency-optimised schedule (tried)": lambda: build(args.slots, compiler_options={
                  **ONEDNN_DOTS, "xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_CONCURRENCY_OPTIMIZED"}),
              "HF Flax (peer)": lambda: build_hf_flax(args.slots),
              "HF Flax (peer) with oneDNN dots": lambda: build_hf_flax(args.slots, ONEDNN_DOTS),
              "HF torch (peer)": lambda: build_hf_torch(args.slots)}
    chosen = ["current"] + [n for n in (args.variants.split(",") if args.variants else makers) if n != "current"]
    refuse_unknown("--variants", chosen, makers, "variants")
    variants = {name: makers[name]() for name in chosen}
    per, cpu = ({name: [] for name in variants} for _ in range(2))
    loads = []
    for i in range(args.rounds):
        for name, variant in rotated(variants.items(), i):
            per[name].append(1e3 * run(variant, args.steps))
            cpu[name].append(1e3 * run(variant, args.steps, cpu=True))
        loads.append(os.getloadavg()[0])
        print(f"round {i + 1}/{args.rounds}: current {per['current'][-1]:.1f} ms; " + ", ".join(
            f"{name} {per[name][-1] / per['current'][-1]:.3f}×" for name in variants if name != "current"),
            flush=True)
    out = {"command": "python benchmarks/bench_levers.py " + shlex.join(sys.argv[1:]), "slots": args.slots,
           "loadavg_before": load_before, "loadavg_per_round": loads, "step_ms_per_round": per,
           "cpu_ms_per_round": cpu, "ratios": {}, "cpu_ratios": {}}
    for name, values in per.items():
        for key, table in (("ratios", per), ("cpu_ratios", cpu)):
            ratios = [a / b for a, b in zip(table[name], table["current"])]
            out[key][name] = spread(ratios)
        r, c = out["ratios"][name], out["cpu_ratios"][name]
        print(f"{name}: {statistics.median(values):.1f} ms; vs current {r['median']:.3f}× ({r['min']:.3f}–{r['max']:.3f}"
              f"{interval(r)}); CPU {statistics.median(cpu[name]):.1f} ms, {c['median']:.3f}× "
              f"({c['min']:.3f}–{c['max']:.3f}{interval(c)})", flush=True)
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    main()
