"""Attention-logit decomposition (TUPE Fig. 2) and TUPE's learned positional correlation (Fig. 6).

Every decomposition is exact: its terms add up to the model's real pre-mask logits of that layer
(`logit_scale · q·k + logit_bias`), computed here in float64 from the raw params.

- **additive** (input-vector schemes: bert_a, sinusoidal, bert_r; layer 0 only — deeper layers mix words and
  positions irrecoverably). The attention input is LN(s), s = w + p (w: token embedding, plus segment 0's row in
  a model with segment embeddings, e.g. an imported BERT; p: the scheme's input vector; LN = `embed_ln` in the MLM
  encoder, the block's `ln_attention` in the pre-LN decoder). With the LN's own statistics of the sum
  (μ_s = μ_w + μ_p, σ_s):

      LN(s) = a_w + a_p,   a_w = γ ⊙ (w − μ_w)/σ_s + β,   a_p = γ ⊙ (p − μ_p)/σ_s

  (β and the q/k projection biases are assigned to the word side). Then q = q_w + q_p with q_w = a_w W^Q + b^Q,
  q_p = a_p W^Q (same for k), and logit = scale·(q_w·k_w + q_w·k_p + q_p·k_w + q_p·k_p) + bias; the four terms
  are word-word, word-position, position-word, position-position (+ the scheme's logit bias, e.g. bert_r's T5
  bias, which is input-independent and assigned to position-position). Note σ_s couples the two sides, so a_p
  depends (through one scalar per token) on the word.
- **disentangled** (bert_ad, any layer): q = (x W^Q + b^Q) + p U^Q, k likewise, with the layer input x; the same
  four terms, scale 1/√(4·d_h).
- **untied** (tupe_a / tupe_r, any layer): word = scale·(x W^Q + b^Q)·(x W^K + b^K) and position = the scheme's
  logit bias (abs correlation after the [CLS] reset, + T5 bias for tupe_r), shared by every layer. The per-head
  position-position correlation is plotted as Fig. 6.
- **other** (rope, alibi, t5, nopos; additive schemes at layers > 0): content = scale·q·k (after any q/k
  transform, so RoPE's rotation stays inside it) and, if the scheme has one, position = its logit bias.

"Noise" numbers per term (over valid query/key pairs; causal models: j ≤ i): std, variance relative to the
word-word (or word/content) term, and `structured_fraction` = the share of the term's variance explained by
(head, i, j) alone (≈1: an input-independent positional pattern; ≈0: input-dependent noise without positional
structure). It is the one-way ANOVA (intraclass) estimate over the B windows, cells c = (head, i, j):
structured = var_c(batch mean) − mean_c(within-cell variance, ddof 1)/B, noise = mean_c(within-cell variance),
fraction = structured/(structured + noise). The batch-mean variance alone over the total has a floor of about 1/B
(iid noise gave 0.126 at B = 8); this estimate is unbiased in both parts, so noise gives ≈0 (by chance slightly
below 0: reported as is, not clipped). None for B = 1 (no within-cell variance to subtract).
"""
from __future__ import annotations

import functools
from typing import Mapping, Optional, Sequence

import jax.numpy as jnp
import numpy as np

from tupe_jax import xla_options
from tupe_jax.analysis import common
from tupe_jax.attention import attention_logits
from tupe_jax.errors import UserError
from tupe_jax.model import Transformer, TransformerLM

FOUR = ("word-word", "word-position", "position-word", "position-position")
MAX_HEADS_SHOWN = 4


def positional_terms(run: common.Run, length: int):
    """The scheme's `PositionalTerms` for `length` (no position offset)."""
    return Transformer(run.model_cfg).apply({"params": run.params["encoder"]}, length,
                                            method=Transformer.positional_terms)


def positional_correlation(run: common.Run, length: int) -> np.ndarray:
    """TUPE's input-independent (H, L, L) position-position correlation after the [CLS] reset (no T5 bias)."""
    if run.pe not in ("tupe_a", "tupe_r"):
        raise UserError(f"'{run.pe}' has no untied positional correlation", "--workdir", "use a tupe_a/tupe_r run")
    return np.asarray(Transformer(run.model_cfg).apply(
        {"params": run.params["encoder"]}, length, method=lambda m, n: m.positional.positional_correlation(n)),
        np.float64)


@functools.lru_cache(maxsize=32)
def _logits_fn(model_cfg, layer: int):
    model, encoder = TransformerLM(model_cfg), Transformer(model_cfg)

    @xla_options.jit
    def logits(params, tokens):
        _, state = model.apply({"params": params}, tokens, deterministic=True,
                               capture_intermediates=lambda mdl, method: method == "__call__" and mdl.name == "qkv",
                               mutable=["intermediates"])
        qkv = state["intermediates"]["encoder"][f"blocks_{layer}"]["attention"]["qkv"]["__call__"][0]
        terms = encoder.apply({"params": params["encoder"]}, tokens.shape[1], method=Transformer.positional_terms)
        q, k = qkv[:, :, 0], qkv[:, :, 1]
        if terms.qk_transform is not None:
            q, k = terms.qk_transform(q, k)
        return attention_logits(q, k, terms, None)

    return logits


def model_logits(run: common.Run, tokens: np.ndarray, layer: int) -> np.ndarray:
    """The model's own pre-mask logits (B, H, L, L) at `layer`, from its captured q/k projections."""
    return np.asarray(_logits_fn(run.model_cfg, layer)(run.params, jnp.asarray(tokens, jnp.int32)), np.float32)


def _ln_stats(x: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    mu = x.mean(-1, keepdims=True)
    return mu, np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps)


def _layer_norm(x: np.ndarray, p: dict, eps: float) -> np.ndarray:
    mu, sigma = _ln_stats(x, eps)
    return (x - mu) / sigma * np.asarray(p["scale"], np.float64) + np.asarray(p["bias"], np.float64)


def _project(x: np.ndarray, qkv: dict, which: int, with_bias: bool = True) -> np.ndarray:
    """(B, L, d) -> (B, L, H, d_h) through slot `which` (0 q, 1 k) of the fused projection."""
    kernel = np.asarray(qkv["kernel"], np.float64)[:, which]
    out = np.einsum("bld,dhe->blhe", x, kernel)
    return out + np.asarray(qkv["bias"], np.float64)[which] if with_bias else out


def _dot(q: np.ndarray, k: np.ndarray, scale: float) -> np.ndarray:
    return np.einsum("bqhe,bkhe->bhqk", q, k) * scale


def attention_input(run: common.Run, tokens: np.ndarray, layer: int) -> np.ndarray:
    """(B, L, d) float64 input of `layer`'s attention (after the pre-LN in the decoder)."""
    hs = common.hidden_states(run, tokens)[layer].astype(np.float64)
    if run.model_cfg.causal:
        return _layer_norm(hs, run.params["encoder"][f"blocks_{layer}"]["ln_attention"], run.model_cfg.layer_norm_eps)
    return hs


def decompose(run: common.Run, tokens: np.ndarray, layer: int = 0) -> dict:
    """{'kind', 'terms': {name: (B, H, L, L) float64}, 'note'}; the terms sum to `model_logits` (pre-mask)."""
    cfg = run.model_cfg
    if not 0 <= layer < cfg.num_layers:
        raise UserError(f"--layer={layer} is out of range", "--layer", f"use 0..{cfg.num_layers - 1}")
    length = tokens.shape[1]
    terms = positional_terms(run, length)
    enc = run.params["encoder"]
    qkv = enc[f"blocks_{layer}"]["attention"]["qkv"]
    scale = float(terms.logit_scale)
    bias = None if terms.logit_bias is None else np.asarray(terms.logit_bias, np.float64)
    note = ""
    if terms.input_vector is not None and terms.qk_transform is None and layer == 0:
        w = np.asarray(enc["embed"]["embedding"], np.float64)[tokens]
        if "token_type" in enc:    # segment 0's row, which the model adds to every token here: on the word side
            w = w + np.asarray(enc["token_type"]["embedding"], np.float64)[0]
        p = np.asarray(terms.input_vector, np.float64)[None]
        ln = enc[f"blocks_{layer}"]["ln_attention"] if cfg.causal else enc["embed_ln"]
        _, sigma = _ln_stats(w + p, cfg.layer_norm_eps)
        gamma, beta = np.asarray(ln["scale"], np.float64), np.asarray(ln["bias"], np.float64)
        a_w = (w - w.mean(-1, keepdims=True)) / sigma * gamma + beta
        a_p = (p - p.mean(-1, keepdims=True)) / sigma * gamma
        qw, kw = _project(a_w, qkv, 0), _project(a_w, qkv, 1)
        qp, kp = _project(a_p, qkv, 0, False), _project(a_p, qkv, 1, False)
        kind = "additive"
    elif run.pe == "bert_ad":
        x = attention_input(run, tokens, layer)
        zero = jnp.zeros((1, length, cfg.num_heads, cfg.head_dim), jnp.float32)
        qp, kp = (np.asarray(t, np.float64) for t in terms.qk_transform(zero, zero))
        qw, kw = _project(x, qkv, 0), _project(x, qkv, 1)
        kind = "disentangled"
    else:
        x = attention_input(run, tokens, layer)
        q, k = _project(x, qkv, 0), _project(x, qkv, 1)
        if terms.qk_transform is not None:
            q, k = (np.asarray(t, np.float64) for t in terms.qk_transform(jnp.asarray(q), jnp.asarray(k)))
        kind = "untied" if run.pe in ("tupe_a", "tupe_r") else "other"
        name = "word" if kind == "untied" else "content"
        out = {name: _dot(q, k, scale)}
        if bias is not None:
            out["position"] = np.broadcast_to(bias, out[name].shape)
        if kind == "other":
            note = (f"'{run.pe}' at layer {layer}: no word/position split; content = scale*q.k"
                    + (" (q/k rotated by position)" if terms.qk_transform is not None else "")
                    + (" and position = the scheme's logit bias" if bias is not None else ""))
        return {"kind": kind, "terms": out, "note": note, "scale": scale}
    out = {"word-word": _dot(qw, kw, scale), "word-position": _dot(qw, kp, scale),
           "position-word": _dot(qp, kw, scale), "position-position": _dot(qp, kp, scale)}
    if bias is not None:
        out["position-position"] = out["position-position"] + bias
        note = "the scheme's logit bias is included in position-position"
    return {"kind": kind, "terms": out, "note": note, "scale": scale}


def _structured_fraction(vals: np.ndarray) -> Optional[float]:
    """The ANOVA share of the variance of `vals` (B, ...) that the cell (its trailing indices) explains."""
    b = vals.shape[0]
    if b < 2:
        return None
    cells = vals.reshape(b, -1).astype(np.float64)
    noise = float(cells.var(0, ddof=1).mean())
    structured = float(cells.mean(0).var(ddof=1)) - noise / b
    return structured / (structured + noise) if structured + noise > 0 else 0.0


def noise_stats(terms: dict, causal: bool) -> dict:
    """Per term: mean, std, variance relative to the word term, structured (position-only) variance fraction (the
    ANOVA estimate of the module docstring: ≈0 for input-dependent noise at any batch size, may dip below 0)."""
    first = next(iter(terms.values()))
    length = first.shape[-1]
    valid = np.tril(np.ones((length, length), bool)) if causal else np.ones((length, length), bool)
    base = next(v for k, v in terms.items() if k in ("word-word", "word", "content"))
    base_var = float(base[..., valid].var())
    stats = {}
    for name, t in terms.items():
        vals = t[..., valid]                                       # (B, H, n_valid)
        total = float(vals.var())
        structured = _structured_fraction(vals) if total > 0 else 0.0
        stats[name] = {"mean": float(vals.mean()), "std": float(np.sqrt(total)),
                       "variance_vs_word": total / base_var if base_var > 0 else None,
                       "structured_fraction": structured}
    return stats


def analyse(run: common.Run, layer: int = 0, batch: int = 8, split: str = "validation", seed: int = 0) -> dict:
    """Decompose `layer` on `batch` validation windows of length max_len; includes a consistency check."""
    tokens = common.model_windows(run, split, run.model_cfg.max_len, count=batch, seed=seed)
    dec = decompose(run, tokens, layer)
    real = model_logits(run, tokens, layer)
    total = sum(dec["terms"].values())
    result = {**run.describe(), "layer": layer, "kind": dec["kind"], "note": dec["note"], "batch": batch,
              "logit_scale": dec["scale"], "max_abs_error_vs_model": float(np.abs(total - real).max()),
              "terms": noise_stats(dec["terms"], run.model_cfg.causal)}
    arrays = {"terms": dec["terms"], "total": real, "tokens": tokens}
    if dec["kind"] == "untied":
        arrays["correlation"] = positional_correlation(run, run.model_cfg.max_len)
    return {"result": result, "arrays": arrays}


def _heat(ax, data, causal, title, plt):
    data = np.array(data, np.float64)
    if causal:
        data[np.triu_indices(data.shape[0], 1)] = np.nan
    im = ax.imshow(data, cmap="viridis", aspect="auto")
    ax.set_title(title, fontsize=8)
    ax.set_xlabel("key j", fontsize=7)
    ax.set_ylabel("query i", fontsize=7)
    ax.tick_params(labelsize=6)
    plt.colorbar(im, ax=ax, fraction=0.046).ax.tick_params(labelsize=6)


def plot_terms(result: dict, arrays: dict, path) -> None:
    """Rows = heads (≤ 4), columns = terms + the model's total, for the first window."""
    plt = common.pyplot()
    names = list(arrays["terms"]) + ["total (model)"]
    heads = min(MAX_HEADS_SHOWN, result["num_heads"])
    fig, axes = plt.subplots(heads, len(names), figsize=(3.2 * len(names), 2.8 * heads), squeeze=False)
    for h in range(heads):
        for c, name in enumerate(names):
            data = arrays["total"][0, h] if name == "total (model)" else arrays["terms"][name][0, h]
            _heat(axes[h, c], data, result["objective"] == "clm", f"{name}, head {h}", plt)
    fig.suptitle(f"{result['name']} ({result['pe']}): attention-logit terms, layer {result['layer']}")
    fig.tight_layout()
    common.save_figure(fig, path)


def plot_correlation(result: dict, corr: np.ndarray, path) -> None:
    """TUPE Fig. 6: the learned position-position correlation of every head."""
    plt = common.pyplot()
    heads = corr.shape[0]
    cols = min(heads, 4)
    rows = -(-heads // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.8 * rows), squeeze=False)
    for h in range(rows * cols):
        ax = axes[h // cols, h % cols]
        if h < heads:
            _heat(ax, corr[h], result["objective"] == "clm", f"head {h}", plt)
        else:
            ax.axis("off")
    fig.suptitle(f"{result['name']} ({result['pe']}): learned positional correlation (input-independent)")
    fig.tight_layout()
    common.save_figure(fig, path)


def correlations(runs: Sequence[common.Run], layer: int = 0, batch: int = 8, seed: int = 0,
                 directory=None) -> dict:
    """Analyse each run; with `directory`, write its PNGs there (suffixed by run name when several, and by the layer
    past the first: `layer_tag`)."""
    report = {"protocol": __doc__.split("\n\n")[0].replace("\n", " "), "runs": []}
    for run in runs:
        out = analyse(run, layer, batch, seed=seed)
        result = out["result"]
        if directory is not None:
            suffix = (f"_{run.name}" if len(runs) > 1 else "") + common.layer_tag(layer)
            plot_terms(result, out["arrays"], directory / f"correlations{suffix}.png")
            result["png"] = [f"correlations{suffix}.png"]
            if "correlation" in out["arrays"]:
                name = f"positional_correlation{suffix}.png"
                plot_correlation(result, out["arrays"]["correlation"], directory / name)
                result["png"].append(name)
        report["runs"].append(result)
    return report


def run(workdir, *, layer: int = 0, out: Optional[str] = None, step: Optional[int] = None, batch: int = 8,
        seed: int = 0, runs: Optional[Sequence[common.Run]] = None, data: Optional[Mapping[str, str]] = None) -> dict:
    """Load the run(s), decompose `layer`, write `correlations.json` (`correlations_layer<L>.json` past the first
    layer) + heatmap PNGs to `out`. `data`: `--config.data.*` overrides, another corpus (`out` is then required)."""
    common.check_output_dir(workdir, out, data)
    runs = list(runs) if runs is not None else common.load_runs(workdir, step, data)
    common.check_layer(runs, layer)
    for r in runs:     # the text read before the folder is made: a corpus without a window is refused leaving none
        common.model_windows(r, "validation", r.model_cfg.max_len, count=1, seed=seed)
    directory = common.output_dir(workdir, out)
    report = correlations(runs, layer, batch, seed, directory)
    name = f"correlations{common.layer_tag(layer)}.json"    # another layer's analysis keeps its own files
    common.write_json(directory / name, report)
    for r in report["runs"]:
        ratios = ", ".join(f"{k}: {v['variance_vs_word']:.3g}" for k, v in r["terms"].items()
                           if v["variance_vs_word"] is not None)
        print(f"correlations {r['name']} ({r['pe']}, {r['kind']}, layer {r['layer']}): variance vs word term "
              f"[{ratios}]; max |sum - model| = {r['max_abs_error_vs_model']:.2e}")
    print(f"correlations: wrote {name} and heatmaps to {common.publish(directory)}")
    return report
