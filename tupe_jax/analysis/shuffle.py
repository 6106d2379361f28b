"""Attention of a sentence vs its shuffle (NoPos, Haviv et al. 2022: the opening experiment; causal vs bidirectional).

A bidirectional encoder without positional information is permutation-equivariant: shuffling the tokens only
permutes its attention (A_shuffled[i, j] = A[π(i), π(j)]). A causal decoder is not, even without positional
encodings — the causal mask tells each token how many predecessors it has. For every run we compute the attention
probabilities of the sentence and of a seeded shuffle (an MLM's [CLS] stays at index 0), map the shuffled maps
back to the original order and report the equivariance gap max |A_back − A| per layer (≈ 0 only for a
position-free bidirectional model), plus, for causal LMs, the mean next-token NLL of both orders.
"""
from __future__ import annotations

from typing import Optional, Sequence

import jax
import numpy as np

from tupe_jax.analysis import common
from tupe_jax.errors import UserError

DEFAULT_TEXT = ("the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat "
                "and the bird sings in the tall tree")


def encode(run: common.Run, text: str, announce: bool = True) -> tuple[np.ndarray, bool]:
    """Model input ids (MLM: [CLS] first), cut to max_len; returns (ids, truncated)."""
    ids = run.tokenizer.encode(text)
    if not run.model_cfg.causal:
        ids = [run.tokenizer.cls_id] + ids
    limit = run.model_cfg.max_len
    truncated = len(ids) > limit
    if truncated and announce:
        print(f"shuffle-attention {run.name}: the text has {len(ids)} tokens; only the first {limit} (model.max_len) "
              "are used", flush=True)
    ids = ids[:limit]
    first = 0 if run.model_cfg.causal else 1
    if len(ids) - first < 2:
        raise UserError(f"--text={text!r} has fewer than 2 tokens to shuffle", "--text", "give a longer sentence")
    return np.asarray(ids, np.int32), truncated


def shuffle_order(length: int, fixed: int, seed: int) -> np.ndarray:
    """A seeded permutation π of 0..length−1 (not the identity) that keeps the first `fixed` indices."""
    rng = np.random.default_rng(seed)
    tail = np.arange(fixed, length)
    for _ in range(100):
        perm = rng.permutation(tail)
        if not np.array_equal(perm, tail):
            break
    return np.concatenate([np.arange(fixed), perm]).astype(np.int64)


def analyse(run: common.Run, text: str = DEFAULT_TEXT, seed: int = 0) -> dict:
    """{'result': JSON-able numbers, 'arrays': attention maps} for one run."""
    ids, truncated = encode(run, text)
    perm = shuffle_order(len(ids), 0 if run.model_cfg.causal else 1, seed)
    tokens = np.stack([ids, ids[perm]])
    out = common.forward_fn(run.model_cfg, return_attention=True)(run.params, tokens)
    att = np.stack([np.asarray(a, np.float64) for a in out["attentions"]])   # (layers, 2, H, L, L)
    original, shuffled = att[:, 0], att[:, 1]
    inv = np.argsort(perm)
    back = shuffled[..., inv, :][..., inv]                                   # back[., π(i), π(j)] = shuffled[., i, j]
    gap = np.abs(back - original).max(axis=(1, 2, 3))
    result = {**run.describe(), "text": text, "truncated": truncated,
              "tokens": [run.tokenizer.id_to_token(int(i)) for i in ids], "permutation": perm.tolist(),
              "equivariance_gap": [float(g) for g in gap]}
    if run.model_cfg.causal:
        logp = np.asarray(jax.nn.log_softmax(out["logits"], axis=-1), np.float64)
        nll = [-float(np.mean(logp[b, np.arange(len(ids) - 1), tokens[b, 1:]])) for b in range(2)]
        result["nll_original"], result["nll_shuffled"] = nll
    return {"result": result, "arrays": {"original": original, "shuffled": shuffled, "back": back,
                                         "perm": perm, "ids": ids}}


def plot(results: Sequence[dict], arrays: Sequence[dict], layer: int, path) -> None:
    """Rows = runs; columns = original, shuffled, shuffled mapped back; head-mean attention at `layer`."""
    plt = common.pyplot()
    fig, axes = plt.subplots(len(results), 3, figsize=(12, 3.9 * len(results)), squeeze=False)
    for row, (res, arr) in enumerate(zip(results, arrays)):
        names = res["tokens"]
        shuffled_names = [names[i] for i in arr["perm"]]
        panels = (("original", arr["original"], names), ("shuffled", arr["shuffled"], shuffled_names),
                  ("shuffled, mapped back to original order", arr["back"], names))
        for col, (title, maps, labels) in enumerate(panels):
            ax = axes[row, col]
            im = ax.imshow(maps[layer].mean(0), cmap="viridis", aspect="auto")
            kind = "causal" if res["objective"] == "clm" else "bidirectional"
            ax.set_title(f"{res['name']} ({res['pe']}, {kind}): {title}", fontsize=8)
            if len(labels) <= 48:
                ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=6)
                ax.set_yticks(range(len(labels)), labels, fontsize=6)
            plt.colorbar(im, ax=ax, fraction=0.046).ax.tick_params(labelsize=6)
        axes[row, 2].set_xlabel(f"max |back - original| = {res['equivariance_gap'][layer]:.2e}", fontsize=8)
    fig.suptitle(f"attention (mean over heads), layer {layer}: sentence vs shuffle")
    fig.tight_layout()
    common.save_figure(fig, path)


def shuffle_attention(runs: Sequence[common.Run], text: str = DEFAULT_TEXT, layer: int = 0, seed: int = 0,
                      path=None) -> dict:
    for run in runs:
        if not 0 <= layer < run.model_cfg.num_layers:
            raise UserError(f"--layer={layer} is out of range for '{run.name}'", "--layer",
                            f"use 0..{run.model_cfg.num_layers - 1}")
    outs = [analyse(run, text, seed) for run in runs]
    report = {"protocol": __doc__.split("\n\n")[1].replace("\n", " "), "layer": layer, "seed": seed,
              "runs": [o["result"] for o in outs]}
    if path is not None:
        plot(report["runs"], [o["arrays"] for o in outs], layer, path)
    return report


def run(workdir, *, text: Optional[str] = None, layer: int = 0, seed: int = 0, out: Optional[str] = None,
        step: Optional[int] = None, runs: Optional[Sequence[common.Run]] = None) -> dict:
    """Load the run(s), write `shuffle_attention.json` + `shuffle_attention.png` to `out` (`_layer<L>` before the
    extension past the first layer)."""
    common.check_output_dir(workdir, out)
    if text is not None and not text.strip():
        raise UserError("--text is empty", "--text", "give a sentence, or leave --text out for the built-in one")
    runs = list(runs) if runs is not None else common.load_runs(workdir, step)
    common.check_layer(runs, layer)
    for r in runs:          # a text too short to shuffle is refused before anything is written
        encode(r, text or DEFAULT_TEXT, announce=False)
    directory = common.output_dir(workdir, out)
    name = f"shuffle_attention{common.layer_tag(layer)}"    # another layer's analysis keeps its own files
    report = shuffle_attention(runs, text or DEFAULT_TEXT, layer, seed, directory / f"{name}.png")
    common.write_json(directory / f"{name}.json", report)
    for r in report["runs"]:
        extra = (f"; NLL original {r['nll_original']:.3f} vs shuffled {r['nll_shuffled']:.3f}"
                 if "nll_original" in r else "")
        gaps = ", ".join(f"{g:.2e}" for g in r["equivariance_gap"])
        print(f"shuffle-attention {r['name']} ({r['pe']}, {r['objective']}): equivariance gap per layer [{gaps}]"
              + extra)
    print(f"shuffle-attention: wrote {name}.json and {name}.png to {common.publish(directory)}")
    return report
