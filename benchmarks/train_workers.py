"""The per-job side of benchmarks/bench_train.py: the reference shapes, synthetic MLM batches, the step timer
(with the timed steps' page faults and CPU seconds), and one worker per implementation: ours (the real
`pretrain.steps.make_train_step`), HF `BertForMaskedLM` (PyTorch) and HF `FlaxBertForMaskedLM`. bench_train runs
each worker in its own subprocess (`--worker KIND`); importing this module imports neither torch nor flax.
"""
from __future__ import annotations

import ast
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

SHAPES = {  # layers, hidden, heads, mlp, vocab, seq, batch
    "small": (4, 256, 4, 1024, 8192, 128, 16),
    "base": (12, 768, 12, 3072, 30522, 128, 4),
}


def _schemes() -> tuple[str, ...]:
    """tupe_jax.positional.SCHEMES, read from its source (importing it would import flax here)."""
    with open(os.path.join(ROOT, "tupe_jax", "positional", "__init__.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                and any(getattr(t, "id", "") == "SCHEMES" for t in node.targets))


ALL_SCHEMES = _schemes() + ("tupe_a:concat", "tupe_r:concat")


# ================================================================================================ shared
SHAPE_KEYS = ("layers", "hidden", "heads", "mlp", "vocab", "seq", "batch")


def shape(name: str = "small") -> dict:
    """A preset of SHAPES as {layers, hidden, heads, mlp, vocab, seq, batch}."""
    return dict(zip(SHAPE_KEYS, SHAPES[name]))


def shape_args(args) -> dict:
    """`args.shape`'s preset with each of its values that `args` sets (non-zero) instead."""
    return {key: getattr(args, key) or value for key, value in shape(args.shape).items()}


def synthetic_batches(s: dict, count: int, predictions: int, seed: int = 0):
    """MLM batches in the format of `tupe_jax.data.pretrain_iterator` (gather form), NumPy: ceil(0.15·seq) masked
    positions per row in `predictions` slots (more slots than that: padding slots at position 0 with weight 0, as
    `data.masking` pads them — the `--predictions 128` equal-work row runs the head on every slot)."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    rng = np.random.default_rng(seed)
    masked = min(-(-15 * s["seq"] // 100), predictions)
    out = []
    for _ in range(count):
        tokens = rng.integers(5, s["vocab"], (s["batch"], s["seq"])).astype(np.int32)
        tokens[:, 0] = 2  # [CLS]
        positions = np.sort(np.stack([rng.choice(np.arange(1, s["seq"]), masked, replace=False)
                                      for _ in range(s["batch"])]), axis=1).astype(np.int32)
        labels = np.take_along_axis(tokens, positions, axis=1).copy()
        inputs = tokens.copy()
        np.put_along_axis(inputs, positions, 4, axis=1)  # [MASK]
        pad = ((0, 0), (0, predictions - masked))
        weights = np.pad(np.ones(positions.shape, np.float32), pad)
        out.append({"inputs": inputs, "input_mask": np.ones_like(inputs), "mlm_positions": np.pad(positions, pad),
                    "mlm_labels": np.pad(labels, pad), "mlm_weights": weights})
    return out


def dense_labels(batch: dict, ignore: int):
    """(B, L) labels with `ignore` where no prediction is asked for (HF convention)."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    labels = np.full(batch["inputs"].shape, ignore, np.int32)
    real = batch["mlm_weights"] > 0
    rows = np.nonzero(real)[0]
    labels[rows, batch["mlm_positions"][real]] = batch["mlm_labels"][real]
    return labels


USAGE: dict = {}   # what the timed steps cost this process, per step (filled by time_steps, added to the result)


def _malloc() -> str:
    """Which malloc this process runs with (tupe_jax/allocator.py's `active`)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tupe_jax import allocator  # pylint: disable=import-outside-toplevel
    return allocator.active()


def time_steps(step, warmup: int, steps: int) -> list[float]:
    """`step()` must run one full step and return only when it is done. Returns per-step seconds; records the
    timed steps' page faults and user/system CPU seconds per step in USAGE (all threads of this process), and
    the process's peak resident memory."""
    import resource  # pylint: disable=import-outside-toplevel
    for _ in range(warmup):
        step()
    times = []
    before = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    after = resource.getrusage(resource.RUSAGE_SELF)
    USAGE.update(minor_faults_per_step=(after.ru_minflt - before.ru_minflt) / steps,
                 user_s_per_step=(after.ru_utime - before.ru_utime) / steps,
                 sys_s_per_step=(after.ru_stime - before.ru_stime) / steps,
                 max_rss_mb=after.ru_maxrss / 1024,          # the process's peak so far (Linux: KiB)
                 glibc_tunables=os.environ.get("GLIBC_TUNABLES", ""), malloc=_malloc())
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
    from tupe_jax import xla_options  # pylint: disable=import-outside-toplevel
    step_fn = xla_options.jit(make_train_step(model, tx, schedule, 1), donate_argnums=0)  # as the trainer compiles it
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


def torch_peer(s: dict, dropout: float, predictions: int, threads: int = 0):
    """HF `BertForMaskedLM`'s train step (dense labels, -100 ignored, global-norm clipping, AdamW with HF's decay
    groups): (step() -> loss, model). `threads` > 0 sets torch's intra-op threads."""
    import torch  # pylint: disable=import-outside-toplevel
    from transformers import BertForMaskedLM  # pylint: disable=import-outside-toplevel
    torch.manual_seed(0)
    if threads:
        torch.set_num_threads(threads)
    model = BertForMaskedLM(hf_config(s, dropout))
    model.train()
    decay = [p for n, p in model.named_parameters() if not ("bias" in n or "LayerNorm" in n)]
    no_decay = [p for n, p in model.named_parameters() if "bias" in n or "LayerNorm" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=5e-4, betas=(0.9, 0.999), eps=1e-6)
    batches = []
    for b in synthetic_batches(s, 4, predictions):
        batches.append((torch.from_numpy(b["inputs"]).long(), torch.from_numpy(b["input_mask"]).long(),
                        torch.from_numpy(dense_labels(b, -100)).long()))
    holder = {"i": 0}

    def step() -> float:
        ids, mask, labels = batches[holder["i"] % len(batches)]
        holder["i"] += 1
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss.item()
    return step, model


def worker_torch(args, s: dict) -> dict:
    import torch  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel
    step_fn, model = torch_peer(s, args.dropout, args.predictions, args.torch_threads)
    holder = {"loss": 0.0}

    def step():
        holder["loss"] = step_fn()

    times = time_steps(step, args.warmup, args.steps)
    return {"times": times, "final_loss": holder["loss"], "predictions": None,
            "threads": f"torch.get_num_threads()={torch.get_num_threads()}",
            "version": f"torch {torch.__version__}, transformers {transformers.__version__}, "
                       f"attn={model.config._attn_implementation}"}  # pylint: disable=protected-access


def flax_peer(s: dict, dropout: float, predictions: int, compiler_options=None):
    """HF `FlaxBertForMaskedLM`'s train step as HF's run_mlm_flax.py builds it (dense logits, labels -100 ignored,
    AdamW after global-norm clipping): (jitted step(state, batch) -> (state, loss), state, device batches).
    `compiler_options`: XLA options for the step (None: XLA's defaults, as HF's script runs)."""
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    import optax  # pylint: disable=import-outside-toplevel
    from flax import traverse_util  # pylint: disable=import-outside-toplevel
    from transformers import FlaxBertForMaskedLM  # pylint: disable=import-outside-toplevel

    model = FlaxBertForMaskedLM(hf_config(s, dropout), seed=0, dtype=jnp.float32)

    def decay_mask(params):
        flat = {k: not (k[-1] == "bias" or "LayerNorm" in "/".join(k)) for k in traverse_util.flatten_dict(params)}
        return traverse_util.unflatten_dict(flat)

    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(5e-4, b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.01, mask=decay_mask))
    params = model.params
    state = {"params": params, "opt": tx.init(params), "rng": jax.random.PRNGKey(0)}

    def train_step(state, batch):
        rng, dropout_rng = jax.random.split(state["rng"])

        def loss_fn(p):
            logits = model(batch["inputs"], attention_mask=batch["input_mask"], params=p, dropout_rng=dropout_rng,
                           train=True)[0]
            weights = (batch["labels"] >= 0).astype(jnp.float32)
            labels = jnp.maximum(batch["labels"], 0)
            nll = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
            return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1.0)

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt, "rng": rng}, loss

    batches = [jax.device_put({"inputs": b["inputs"], "input_mask": b["input_mask"],
                               "labels": dense_labels(b, -100)}) for b in synthetic_batches(s, 4, predictions)]
    return jax.jit(train_step, donate_argnums=0, compiler_options=compiler_options), state, batches


def worker_flax(args, s: dict) -> dict:
    import jax  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel

    step_fn, state, batches = flax_peer(s, args.dropout, args.predictions)
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
