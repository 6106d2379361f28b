"""Absolute-position probes on frozen hidden states (NoPos, Haviv et al. 2022 §5; research/positional.md §1.3).

For every layer l = 0 (embedding output) … num_layers of a frozen model, a 2-layer ReLU MLP probe

    logits = relu(x W1) W2,    W1: d × 2d,  W2: 2d × n  (no biases, Xavier-uniform init, as the paper's probe)

classifies each token's hidden state x into its absolute position 0..n−1, n = max_len, with cross-entropy and
Adam(β=(0.9, 0.98), weight decay 0.01, cosine-decayed lr). Inputs are standardised per feature with the
training tokens' mean/std (an invertible affine map: it removes no information and makes one lr fit every layer).
Training tokens: full-length windows (`max_len` tokens; MLM: [CLS] + max_len−1) of unmasked text cut from the
train split's token stream; evaluation on windows of the validation split. MLM runs leave position 0 out of
training and evaluation: it always holds [CLS], so a probe would read that token, not a position, and get it for
free; their positions are 1..n−1. Every position probed occurs equally often, so over m probed positions a
uniformly random guess has mean absolute distance (MAD) (m²−1)/(3m) — the "chance" line — and the best constant
guess, the median position, has MAD about m/4 (`median_mad`, exact for the positions evaluated). A MAD between the
median line and chance shows no position information: a probe that learned only the middle gets there.

Reported per layer: MAD = mean |argmax − position|, accuracy, and the MAD over each of `SEGMENTS` position
ranges. All layers' probes train together (vmapped).
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from tupe_jax.analysis import common
from tupe_jax.errors import UserError


@dataclasses.dataclass(frozen=True)
class ProbeSettings:
    """Probe training knobs (defaults: tiny and fast)."""

    steps: int = 300
    batch_tokens: int = 512          # tokens per Adam step
    learning_rate: float = 2e-3       # the NoPos paper's lr
    weight_decay: float = 0.01
    train_tokens: int = 16384        # frozen training tokens (rounded up to whole windows)
    eval_tokens: int = 4096
    seed: int = 0


# Adam steps per jitted call of a probe fit: one scan of every step could not be interrupted (Ctrl-C waits for the
# program), which at a base model's width takes minutes; the default 300 steps are 12 calls of one program.
FIT_CHUNK = 25
SEGMENTS = 8      # position ranges each layer's MAD is also reported over (`segment_mads`)


def chance_mad(n: int) -> float:
    """E|U − V| for U, V independent uniform on {0..n−1}: (n² − 1) / (3n)."""
    return (n * n - 1) / (3.0 * n)


def median_position(positions: np.ndarray) -> int:
    """The (lower) median of `positions`: the best constant prediction under absolute distance."""
    p = np.sort(np.asarray(positions, np.int64))
    return int(p[(len(p) - 1) // 2])


def median_mad(positions: np.ndarray) -> float:
    """MAD of the best constant prediction of `positions`: the (lower) median, predicted everywhere (about m/4)."""
    p = np.asarray(positions, np.int64)
    return float(np.abs(p - median_position(p)).mean())


def first_position(run: common.Run) -> int:
    """The first position probed: 1 for an MLM encoder (position 0 always holds [CLS]), else 0."""
    return 0 if run.model_cfg.causal else 1


def _xavier(key, fan_in: int, fan_out: int, layers: int) -> jax.Array:
    limit = np.sqrt(6.0 / (fan_in + fan_out))
    return jax.random.uniform(key, (layers, fan_in, fan_out), jnp.float32, -limit, limit)


def _logits(params, x):
    return jax.nn.relu(x @ params["w1"]) @ params["w2"]


def train_probes(train_x: np.ndarray, train_y: np.ndarray, eval_x: np.ndarray, eval_y: np.ndarray,
                 num_classes: int, settings: ProbeSettings = ProbeSettings()) -> list[dict]:
    """Train one probe per layer and evaluate it.

    train_x (K, N, d) float, train_y (N,) int in [0, num_classes); eval_x (K, M, d), eval_y (M,).
    Returns per layer {'layer', 'mad', 'accuracy', 'train_loss'}.
    """
    train_x = np.asarray(train_x, np.float32)
    eval_x = np.asarray(eval_x, np.float32)
    if train_x.ndim != 3 or eval_x.ndim != 3 or train_x.shape[0] != eval_x.shape[0]:
        raise ValueError(f"expected (layers, tokens, d) features, got {train_x.shape} and {eval_x.shape}")
    layers, n_train, d = train_x.shape
    mean = train_x.mean(axis=1, keepdims=True)
    std = train_x.std(axis=1, keepdims=True) + 1e-6
    tx = jnp.asarray((train_x - mean) / std)
    ex = jnp.asarray((eval_x - mean) / std)
    ty = jnp.asarray(train_y, jnp.int32)
    ey = jnp.asarray(eval_y, jnp.int32)

    key = jax.random.PRNGKey(settings.seed)
    k1, k2, k3 = jax.random.split(key, 3)
    params = {"w1": _xavier(k1, d, 2 * d, layers), "w2": _xavier(k2, 2 * d, num_classes, layers)}
    schedule = optax.cosine_decay_schedule(settings.learning_rate, max(settings.steps, 1), alpha=0.05)
    opt = optax.adamw(schedule, b1=0.9, b2=0.98, weight_decay=settings.weight_decay)
    batch = min(settings.batch_tokens, n_train)
    idx = jax.random.randint(k3, (settings.steps, batch), 0, n_train)

    def loss_fn(p, x, y):  # one layer
        logp = jax.nn.log_softmax(_logits(p, x), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=-1))

    grad_fn = jax.vmap(jax.value_and_grad(loss_fn), in_axes=(0, 0, None))

    @jax.jit
    def fit(params, state, tx, ty, idx):  # features as arguments, not closure constants baked into the program
        def step(carry, i):
            p, s = carry
            loss, grads = grad_fn(p, tx[:, i], ty[i])
            updates, s = opt.update(grads, s, p)
            return (optax.apply_updates(p, updates), s), loss

        (params, state), losses = jax.lax.scan(step, (params, state), idx)
        return params, state, losses

    state, chunks = opt.init(params), []
    for start in range(0, settings.steps, FIT_CHUNK):    # Python between chunks: Ctrl-C stops a long fit
        params, state, chunk = fit(params, state, tx, ty, idx[start:start + FIT_CHUNK])
        chunks.append(chunk)
    losses = jnp.concatenate(chunks) if chunks else jnp.zeros((0, layers))

    @jax.jit
    def predict(p, x):
        return jnp.argmax(jax.vmap(_logits)(p, x), axis=-1)

    preds = []
    for i in range(0, ex.shape[1], 4096):
        preds.append(np.asarray(predict(params, ex[:, i:i + 4096])))
    pred = np.concatenate(preds, axis=1)
    truth = np.asarray(ey)[None]
    mad = np.abs(pred - truth).mean(axis=1)
    acc = (pred == truth).mean(axis=1)
    tail = np.asarray(losses)[-max(1, settings.steps // 10):].mean(axis=0) if settings.steps else np.full(layers,
                                                                                                          np.nan)
    return [{"layer": i, "mad": float(mad[i]), "accuracy": float(acc[i]), "train_loss": float(tail[i]),
             "mad_by_segment": segment_mads(pred[i], truth[0])} for i in range(layers)]


def segment_mads(pred: np.ndarray, truth: np.ndarray, segments: int = SEGMENTS) -> list[list]:
    """[first, last, MAD] for `segments` ranges of the positions in `truth`, of equal width to within one position
    (fewer when there are fewer positions): where in the window a probe knows the position (NoPos Fig. 3)."""
    lo, hi = int(truth.min()), int(truth.max()) + 1
    edges = np.linspace(lo, hi, min(segments, hi - lo) + 1).astype(int)
    out = []
    for a, b in zip(edges[:-1], edges[1:]):
        sel = (truth >= a) & (truth < b)
        out.append([int(a), int(b) - 1, float(np.abs(pred[sel] - truth[sel]).mean())])
    return out


def features(run: common.Run, split: str, tokens_wanted: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(K, N, d) hidden states of every layer and (N,) positions: whole windows of `split` drawn at `seed`, the
    fewest covering `tokens_wanted` (a larger request's first windows are a smaller one's: same permutation)."""
    length = run.model_cfg.max_len
    count = max(1, -(-tokens_wanted // length))
    windows = common.model_windows(run, split, length, count=count, seed=seed)
    states = common.hidden_states(run, windows)[:, :, first_position(run):]     # (K, n, L, d): MLM: no [CLS]
    k, n, l, d = states.shape
    return states.reshape(k, n * l, d), np.tile(np.arange(first_position(run), length), n)


def probe_run(run: common.Run, settings: ProbeSettings = ProbeSettings()) -> dict:
    """Probe every layer of one frozen run: {'chance_mad', 'num_classes', 'layers': [...] , ...describe}."""
    n = run.model_cfg.max_len
    if n < 2:
        raise UserError(f"max_len {n} leaves nothing to probe", "model.max_len", "probe a run with max_len ≥ 2")
    print(f"probe {run.name}: collecting hidden states", flush=True)
    train_x, train_y = features(run, "train", settings.train_tokens, settings.seed)
    eval_x, eval_y = features(run, "validation", settings.eval_tokens, settings.seed + 1)
    print(f"probe {run.name}: training {train_x.shape[0]} probes on {train_x.shape[1]} tokens "
          f"for {settings.steps} steps", flush=True)
    layers = train_probes(train_x, train_y, eval_x, eval_y, n, settings)
    return {**run.describe(), "num_classes": n, "first_position": first_position(run),
            "chance_mad": chance_mad(n - first_position(run)), "median_mad": median_mad(eval_y),
            "train_tokens": int(train_x.shape[1]), "eval_tokens": int(eval_x.shape[1]), "layers": layers}


def probe(runs: Sequence[common.Run], settings: ProbeSettings = ProbeSettings()) -> dict:
    return {"settings": dataclasses.asdict(settings),
            "protocol": ("2-layer ReLU MLP (d -> 2d -> max_len, no bias) per layer on frozen, standardised hidden "
                         "states; train split windows for training, validation split for evaluation; "
                         "MAD = mean |argmax - position|; chance = (m^2-1)/(3m) over the m positions probed; "
                         "median = the MAD of predicting the median position everywhere (about m/4); MLM runs "
                         "leave position 0 ([CLS]) out"),
            "runs": [probe_run(r, settings) for r in runs]}


def plot(report: dict, path) -> None:
    """MAD vs layer, one line per run; dashed: chance, dotted: the median constant, per distinct position range."""
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for r in report["runs"]:
        xs = [x["layer"] for x in r["layers"]]
        ax.plot(xs, [x["mad"] for x in r["layers"]], marker="o", label=f"{r['name']} ({r['pe']}, {r['objective']})")
    for n, chance, median in sorted({(r["num_classes"] - r["first_position"], r["chance_mad"], r["median_mad"])
                                     for r in report["runs"]}):
        ax.axhline(chance, color="gray", linestyle="--", label=f"chance, {n} positions: {chance:.2f}")
        ax.axhline(median, color="gray", linestyle=":", label=f"median constant, {n} positions: {median:.2f}")
    ax.set_xlabel("layer (0 = embedding output)")
    ax.set_ylabel("mean absolute distance (positions)")
    ax.set_title("absolute-position probe (lower = more position information)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    common.save_figure(fig, path)


def run(workdir, *, out: Optional[str] = None, step: Optional[int] = None, steps: Optional[int] = None,
        train_tokens: Optional[int] = None, settings: Optional[ProbeSettings] = None,
        runs: Optional[Sequence[common.Run]] = None, data: Optional[Mapping[str, str]] = None) -> dict:
    """Load the run(s), probe every layer, write `probe.json` + `probe.png` to `out` (default RUN/analysis/).
    `steps`, `train_tokens`: `--probe_steps`, `--probe_tokens` over `settings`' values. `data`: `--config.data.*`
    overrides, another corpus to probe on (`out` is then required)."""
    settings = settings or ProbeSettings()
    for flag, value, key in (("--probe_steps", steps, "steps"), ("--probe_tokens", train_tokens, "train_tokens")):
        if value is not None:
            if value < 1:
                raise UserError(f"{flag}={value} must be at least 1", flag, "give a positive number")
            settings = dataclasses.replace(settings, **{key: value})
    common.check_output_dir(workdir, out, data)
    runs = list(runs) if runs is not None else common.load_runs(workdir, step, data)
    report = probe(runs, settings)
    directory = common.output_dir(workdir, out)
    common.write_json(directory / "probe.json", report)
    plot(report, directory / "probe.png")
    for r in report["runs"]:
        mads = ", ".join(f"{x['mad']:.2f}" for x in r["layers"])
        print(f"probe {r['name']} ({r['pe']}): MAD per layer [{mads}] (chance {r['chance_mad']:.2f}, median "
              f"constant {r['median_mad']:.2f}" + (", position 0 ([CLS]) left out)" if r["first_position"] else ")"))
    print(f"probe: wrote probe.json and probe.png to {common.publish(directory)}")
    return report
