"""Perplexity (causal LM) or MLM loss vs evaluation length, on the validation split.

Protocol (Press et al. 2022, App. B; see research/positional.md §2.4), on the split's flat token stream ([SEP]
after every document, as the pretraining pipeline builds it):

- CLM, `nonoverlapping` (default): windows of L inputs every L tokens (inputs w[b:b+L], targets w[b+1:b+L+1]);
  every token after the first is predicted exactly once. At L = max_len this is exactly the CLM pipeline's
  validation batches. perplexity = exp(mean NLL over all predicted tokens).
- CLM, `sliding` with stride S (≤ L): windows of L inputs starting every S tokens; the first window scores all its
  L targets, every later window only its last S (the ones not scored yet), so each prediction has ≥ L−S tokens of
  context. S = L is nonoverlapping; S = 1 is fairseq's `--context-window L-1`.
- MLM: windows [CLS] + L−1 consecutive tokens, cut contiguously; masked with the data layer's MLM masking
  (`data.mask_prob`, 80/10/10) with example keys (seed, window index, epoch 0), at most ceil(mask_prob·L)
  predictions per window. Reported: mlm_loss = mean NLL over masked tokens (and its exp). Sliding is CLM-only.

Schemes with a learned position table (bert_a, bert_r, tupe_a, tupe_r, bert_ad) have no position beyond
`max_len`: those lengths are reported as not defined (never clamped). Forwards are batched by a token budget, so
long lengths run with small batches (batch 1 at worst).
"""
from __future__ import annotations

import functools
import math
from typing import Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tupe_jax import xla_options
from tupe_jax.analysis import common
from tupe_jax.data import masking
from tupe_jax.data.batch import LMBatch
from tupe_jax.data.tokenizer import CLS_ID, PAD_ID, Tokenizer
from tupe_jax.errors import UserError
from tupe_jax.model import TransformerLM

MODES = ("nonoverlapping", "sliding")


def clm_windows(num_tokens: int, length: int, mode: str = "nonoverlapping", stride: Optional[int] = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(begin, lo, hi) per window: inputs stream[begin:begin+length]; targets at stream index t ∈ [lo, hi) scored.

    Together the windows score every stream index 1..num_tokens−1 exactly once.
    """
    if mode not in MODES:
        raise UserError(f"unknown extrapolation mode {mode!r}", "--mode", f"use one of {', '.join(MODES)}")
    step = length if mode == "nonoverlapping" else int(stride or length)
    if step < 1:
        raise UserError(f"stride {stride} must be at least 1", "--stride", "give a positive stride")
    step = min(step, length)
    begins, los, his = [], [], []
    begin, scored = 0, 1  # stream index 0 is never a target
    while scored < num_tokens:
        hi = min(begin + length + 1, num_tokens)
        begins.append(begin)
        los.append(scored)
        his.append(hi)
        scored = hi
        begin += step
    return np.asarray(begins, np.int64), np.asarray(los, np.int64), np.asarray(his, np.int64)


def clm_batch(stream: np.ndarray, begin: np.ndarray, lo: np.ndarray, hi: np.ndarray, length: int,
              pad_id: int = PAD_ID) -> LMBatch:
    """Model inputs, targets and 0/1 weights (B, length) for a set of windows ([PAD] = `pad_id` past the end)."""
    n = len(stream)
    idx = begin[:, None] + np.arange(length, dtype=np.int64)[None, :]
    tgt = idx + 1
    inputs = np.where(idx < n, np.asarray(stream[np.minimum(idx, n - 1)]), pad_id).astype(np.int32)
    targets = np.where(tgt < n, np.asarray(stream[np.minimum(tgt, n - 1)]), pad_id).astype(np.int32)
    weights = ((tgt >= lo[:, None]) & (tgt < hi[:, None])).astype(np.float32)
    return LMBatch(inputs=inputs, targets=targets, weights=weights)


def mlm_batch(stream: np.ndarray, windows: np.ndarray, length: int, *, seed: int, vocab_size: int,
              mask_prob: float, tokenizer: Optional[Tokenizer] = None) -> LMBatch:
    """Masked [CLS] + (length−1)-token windows (indices `windows`) in the data layer's MLM format (special ids
    from `tokenizer`; None: a vocabulary trained here)."""
    text = length - 1
    starts = windows.astype(np.int64) * text
    ends = np.minimum(starts + text, len(stream))
    ids = {} if tokenizer is None else {"special_ids": tokenizer.special_ids, "mask_id": tokenizer.mask_id}
    pad_id = PAD_ID if tokenizer is None else tokenizer.pad_id
    toks, valid = masking.gather_windows(stream, starts, ends, text, pad_id)
    toks, valid = masking.add_cls(toks, valid, CLS_ID if tokenizer is None else tokenizer.cls_id)
    keys = masking.example_keys(seed, windows.astype(np.int64), np.zeros(len(windows), np.int64))
    return masking.mask_tokens(np.where(valid, toks, pad_id), valid.astype(np.int32), keys, vocab_size=vocab_size,
                               mask_prob=mask_prob, max_predictions=max(1, math.ceil(mask_prob * length)), **ids)


@functools.lru_cache(maxsize=32)
def _nll_fn(model_cfg):
    model = TransformerLM(model_cfg)

    @xla_options.jit
    def clm(params, inputs, targets, weights):
        logits = model.apply({"params": params}, inputs, deterministic=True)["logits"]
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        return jnp.sum(nll * weights), jnp.sum(weights)

    @xla_options.jit
    def mlm(params, inputs, input_mask, positions, labels, weights):
        logits = model.apply({"params": params}, inputs, input_mask=input_mask, mlm_positions=positions,
                             deterministic=True)["logits"]
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
        return jnp.sum(nll * weights), jnp.sum(weights)

    return clm if model_cfg.causal else mlm


def _pad_rows(batch: LMBatch, rows: int) -> LMBatch:
    """Pad every array to `rows` rows with zeros (weight 0), so one compiled shape serves every batch."""
    n = batch.inputs.shape[0]
    if n == rows:
        return batch
    return jax.tree_util.tree_map(lambda v: np.concatenate([v, np.zeros((rows - n,) + v.shape[1:], v.dtype)]), batch)


def undefined(run: common.Run, length: int) -> Optional[str]:
    """Why `length` cannot be evaluated for this run, or None."""
    if run.has_table and length > run.model_cfg.max_len:
        return (f"not defined beyond max_len={run.model_cfg.max_len}: '{run.pe}' has a learned position table "
                f"with no rows past it (never clamped)")
    return None


def evaluate_length(run: common.Run, length: int, *, mode: str = "nonoverlapping", stride: Optional[int] = None,
                    split: str = "validation", seed: int = 0, token_budget: int = common.DEFAULT_TOKEN_BUDGET,
                    max_tokens: Optional[int] = None, stream: Optional[np.ndarray] = None) -> dict:
    """One run at one length: {'length', 'defined', 'nll', 'perplexity', 'tokens', 'windows', ...}."""
    cfg = run.model_cfg
    if length < 2:
        raise UserError(f"evaluation length {length} is too short", "--lengths", "use lengths of at least 2")
    if not cfg.causal and mode != "nonoverlapping":
        raise UserError(f"--mode={mode} is defined for causal LMs only; '{run.name}' is an MLM encoder",
                        "--mode", "drop --mode (MLM uses nonoverlapping windows)")
    reason = undefined(run, length)
    if reason:
        return {"length": length, "defined": False, "reason": reason}
    if stream is None:
        stream = common.token_stream(run, split)
    if max_tokens:
        stream = stream[:max_tokens]
    rows = common.batch_rows(length, cfg, token_budget)
    fn = _nll_fn(cfg)
    total, count = 0.0, 0.0
    if cfg.causal:
        begin, lo, hi = clm_windows(len(stream), length, mode, stride)
        n_windows = len(begin)
        if mode == "sliding" and stride is not None and stride > length:   # one --stride serves every length
            print(f"extrapolate {run.name} L={length}: stride {stride} is capped at L (windows without overlap)",
                  flush=True)
    else:
        n_windows = -(-len(stream) // (length - 1))
        mask_prob = float(run.config.data.get("mask_prob", 0.15))
    progress = common.Progress(f"extrapolate {run.name} L={length}", n_windows)
    for i in range(0, n_windows, rows):
        sl = slice(i, min(i + rows, n_windows))
        if cfg.causal:
            b = _pad_rows(clm_batch(stream, begin[sl], lo[sl], hi[sl], length, run.tokenizer.pad_id), rows)
            s, c = fn(run.params, b.inputs, b.targets, b.weights)
        else:
            b = _pad_rows(mlm_batch(stream, np.arange(sl.start, sl.stop), length, seed=seed,
                                    vocab_size=run.tokenizer.vocab_size, mask_prob=mask_prob,
                                    tokenizer=run.tokenizer), rows)
            s, c = fn(run.params, b.inputs, b.input_mask, b.mlm_positions, b.mlm_labels, b.mlm_weights)
        total += float(s)
        count += float(c)
        progress.update(sl.stop)
    nll = total / count if count else float("nan")
    result = {"length": length, "defined": True, "nll": nll, "perplexity": math.exp(min(nll, 700.0)),
              "tokens": int(count), "windows": n_windows, "batch_rows": rows}
    if not cfg.causal:
        result["mlm_loss"] = nll
    elif mode == "sliding":
        result["stride"] = min(int(stride or length), length)
    return result


def protocol(mode: str, stride: Optional[int], split: str, seed: int, max_tokens: Optional[int]) -> dict:
    return {
        "split": split, "mode": mode, "stride": stride if mode == "sliding" else None, "seed": seed,
        "max_tokens": max_tokens,
        "clm": ("perplexity = exp(mean NLL) over every token of the split's stream after the first; "
                + ("nonoverlapping windows of L inputs every L tokens" if mode == "nonoverlapping" else
                   "sliding windows of L inputs every S tokens, the first window scores all L targets, later "
                   "windows only their last S (stride S capped at L)")),
        "mlm": ("mlm_loss = mean NLL over masked tokens of windows [CLS] + L-1 contiguous tokens, masked with the "
                "data layer's MLM masking (keys: seed, window index, epoch 0; at most ceil(mask_prob*L) per window)"),
        "learned_tables": "lengths beyond max_len are reported as not defined (no clamping)",
    }


def _same_tokens(a: np.ndarray, b: np.ndarray, chunk: int = 1 << 22) -> bool:
    """Equal token streams: one cached file (memmaps of one path) or equal contents, compared a chunk at a time."""
    if len(a) != len(b):
        return False
    if getattr(a, "filename", None) and getattr(a, "filename", None) == getattr(b, "filename", None):
        return True
    return all(np.array_equal(a[i:i + chunk], b[i:i + chunk]) for i in range(0, len(a), chunk))


def _check_stream_length(run: common.Run, stream: Optional[np.ndarray], lengths: Sequence[int], split: str,
                         max_tokens: Optional[int]) -> None:
    """Refuse a defined length whose window the stream cannot fill: its windows would be cut to the stream, and the
    result, labelled L, would be the score of a shorter length (the same number at every such L)."""
    if stream is None:
        return
    have = len(stream[:max_tokens] if max_tokens else stream)
    need = {int(L): int(L) + 1 if run.model_cfg.causal else int(L) - 1 for L in lengths if not undefined(run, int(L))}
    short = sorted(L for L, n in need.items() if n > have)
    if short:
        raise UserError(f"the {split} text of {run.name} has {have} tokens"
                        f"{f' (max_tokens {max_tokens})' if max_tokens else ''}, fewer than one window of length "
                        f"{short[0]} needs ({need[short[0]]})", "--lengths", "drop the lengths above what the text "
                        "fills" + (", or raise max_tokens" if max_tokens and max_tokens < len(stream)
                                   else ", or use a longer split"))


def extrapolate(runs: Sequence[common.Run], lengths: Sequence[int], *, mode: str = "nonoverlapping",
                stride: Optional[int] = None, split: str = "validation", seed: int = 0,
                token_budget: int = common.DEFAULT_TOKEN_BUDGET, max_tokens: Optional[int] = None) -> dict:
    """The report of several runs at several lengths (the JSON written by `run`)."""
    if mode not in MODES:
        raise UserError(f"unknown extrapolation mode {mode!r}", "--mode", f"use one of {', '.join(MODES)}")
    if mode == "sliding" and stride is not None and stride < 1:
        raise UserError(f"--stride={stride} must be at least 1", "--stride", "give a positive stride")
    if mode != "sliding" and stride is not None:
        raise UserError(f"--stride={stride} is read by --mode=sliding only (mode {mode} would ignore it)", "--stride",
                        "add --mode=sliding (causal LMs), or drop --stride")
    mlm = [run.name for run in runs if not run.model_cfg.causal]
    if mode != "nonoverlapping" and mlm:   # before any compute: not after the causal runs were scored
        raise UserError(f"--mode={mode} is defined for causal LMs only; '{mlm[0]}' is an MLM encoder", "--mode",
                        "drop --mode (MLM uses nonoverlapping windows)"
                        + (", or extrapolate the MLM runs apart" if len(mlm) < len(runs) else ""))
    for run in runs:   # before any compute: every defined length must fit in memory
        for length in lengths:
            if not undefined(run, int(length)):
                common.check_memory(run.model_cfg, int(length), "--lengths", token_budget)
    report = {"protocol": protocol(mode, stride, split, seed, max_tokens), "lengths": list(lengths), "runs": []}
    streams = [None if all(undefined(run, length) for length in lengths) else common.token_stream(run, split)
               for run in runs]
    for run, stream in zip(runs, streams):   # before any compute: a length longer than the text is no such length
        _check_stream_length(run, stream, lengths, split, max_tokens)
    scored = [(run, s[:max_tokens] if max_tokens else s) for run, s in zip(runs, streams) if s is not None]
    for run, s in scored[1:]:    # one table, one text: perplexities over other tokens are not comparable
        if not _same_tokens(s, scored[0][1]):
            raise UserError(f"{run.name} and {scored[0][0].name} score different {split} tokens (another corpus or "
                            "tokenizer): one table would set incomparable perplexities side by side", "--workdir",
                            "extrapolate runs of one corpus and tokenizer together, the others apart")
    for run, stream in zip(runs, streams):
        results = [evaluate_length(run, int(length), mode=mode, stride=stride, split=split, seed=seed,
                                   token_budget=token_budget, max_tokens=max_tokens, stream=stream)
                   for length in lengths]
        metric = "perplexity" if run.model_cfg.causal else "mlm_loss"
        report["runs"].append({**run.describe(), "metric": metric, "results": results})
    return report


def plot(report: dict, path) -> None:
    """One line per run: perplexity (CLM, log scale) or MLM loss vs length; dotted line at each max_len."""
    plt = common.pyplot()
    kinds = sorted({r["metric"] for r in report["runs"]})
    fig, axes = plt.subplots(1, len(kinds), figsize=(6.4 * len(kinds), 4.4), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for r in (r for r in report["runs"] if r["metric"] == kind):
            pts = [(x["length"], x[kind]) for x in r["results"] if x["defined"]]
            label = f"{r['name']} ({r['pe']})"
            if any(not x["defined"] for x in r["results"]):
                label += ": not defined beyond max_len"
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
            ax.axvline(r["max_len"], color=line.get_color(), linestyle=":", alpha=0.6)
        ax.set_xscale("log", base=2)
        ticks = sorted({x["length"] for r in report["runs"] for x in r["results"]})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        if kind == "perplexity":
            ax.set_yscale("log")
        ax.set_xlabel("evaluation length (tokens)")
        ax.set_ylabel("perplexity" if kind == "perplexity" else "MLM loss (nats)")
        ax.set_title(f"{kind} vs length ({report['protocol']['mode']}; dotted: training max_len)")
        ax.legend(fontsize=8)
    common.save_figure(fig, path)


def run(workdir, lengths: Sequence[int], *, mode: str = "nonoverlapping", stride: Optional[int] = None,
        out: Optional[str] = None, step: Optional[int] = None, split: str = "validation", seed: int = 0,
        token_budget: int = common.DEFAULT_TOKEN_BUDGET, max_tokens: Optional[int] = None,
        runs: Optional[Sequence[common.Run]] = None, data: Optional[Mapping[str, str]] = None) -> dict:
    """Load the run(s), evaluate every length, write `extrapolation.json` + `extrapolation.png` to `out`. `data`:
    `--config.data.*` overrides, another corpus to score (`workdir.corpus_config`; `out` is then required)."""
    common.check_output_dir(workdir, out, data)
    runs = list(runs) if runs is not None else common.load_runs(workdir, step, data)
    report = extrapolate(runs, lengths, mode=mode, stride=stride, split=split, seed=seed,
                         token_budget=token_budget, max_tokens=max_tokens)
    directory = common.output_dir(workdir, out)
    common.write_json(directory / "extrapolation.json", report)
    plot(report, directory / "extrapolation.png")
    for r in report["runs"]:
        cells = [f"{x['length']}: {x[r['metric']]:.3f}" if x["defined"] else f"{x['length']}: not defined"
                 for x in r["results"]]
        print(f"extrapolate {r['name']} ({r['pe']}, {r['metric']}): " + ", ".join(cells))
    print(f"extrapolate: wrote extrapolation.json and extrapolation.png to {common.publish(directory)}")
    return report
