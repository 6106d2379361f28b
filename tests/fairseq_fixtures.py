"""Fixtures for import-fairseq: sentences, a reference tokenizer (sacremoses + subword-nmt, called directly), BPE
codes and a dict.txt learned here, and a checkpoint in the format of the TUPE authors' fairseq code (their parameter
names and shapes, the `args` Namespace, optimizer history, extra_state with fairseq meters) for a tiny config.

Nothing is downloaded: the text is hand-written GLUE-style sentences, the fixture GLUE rows and lines of the CPython
documentation that `pydoc_data` ships (the project's embedded corpus).
"""
from __future__ import annotations

import argparse
import collections
import io
import os
import sys
import types
import unicodedata

import numpy as np

from tupe_jax.data import fairseq_bpe

SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<file>", "<email>", "<url>"]

HANDWRITTEN = [
    "The cat didn't sit on the mat; it sat on the sofa instead.",
    "\"I can't believe it's not butter!\" she exclaimed.",
    "Visit https://www.example.com/page?id=3 or write to jane.doe@example.org for details.",
    "He downloaded report_final.pdf and slides-v2.pptx before the meeting.",
    "The U.S. economy grew 3.5% in Q2, according to the Commerce Dept.",
    "Prices rose from $1,000 to $1,250 -- a 25 percent jump.",
    "Mr. O'Neil's dog -- a well-known troublemaker -- ran away again...",
    "Is this the state-of-the-art model? Yes, it is.",
    "She said: «bonjour» and left.",
    "Café owners in Zürich raised prices by 5€ (about $5.40).",
    "The film, which premiered in 1999, was a box-office hit.",
    "Tom's brother isn't coming, but Mary's sister is.",
    "They were <<very>> happy,, and so were we,.",
    "Email me at info@acme.co.uk or see www.acme.com.",
    "A backslash \\ in text and a tab\there.",
    "Wait.... what happened??? Nobody knows!!!",
    "The ratio is 3:1, not 2:1; see p. 45 (fig. 3b).",
    "Straße and naïve façades are spelled with diacritics.",
    "I'd've gone if you'd asked — really, I would have.",
    "“Smart quotes” and ‘single ones’ should be normalised.",
    "Temperatures hit 40°C on 2020-07-15 in some areas.",
    "Ms. Smith, Ph.D., works at the U.N. in New York City.",
    "The word *emphasis* and _underscore_ appear here.",
    "It costs 10 dollars & 50 cents @ the store #42.",
    "No one expected the Spanish Inquisition!",
    "RT @user: check this out http://t.co/abc123 #news",
    "Zero-width\u200bspace and soft\u00adhyphen inside words.",
    "He scored 7/10, i.e. above average, e.g. better than last year.",
    "The company's Q3 revenue was $2.3bn, up 12% y/y.",
    "Quotes 'inside' \"nested 'quotes'\" are tricky.",
]


def doc_lines(n: int = 260) -> list[str]:
    """`n` lines of English prose from CPython's pydoc_data (always installed with Python)."""
    from pydoc_data.topics import topics
    out = []
    for key in sorted(topics):
        for line in topics[key].splitlines():
            line = line.strip()
            if len(line.split()) >= 6 and not line.startswith((">>>", "...")):
                out.append(line)
    step = max(1, len(out) // n)
    return out[::step][:n]


def glue_sentences() -> list[str]:
    from tests.glue_fixtures import _pair
    rng = np.random.default_rng(5)
    return [s for i in range(40) for s in _pair(rng, i % 2)]


def sentences() -> list[str]:
    return HANDWRITTEN + glue_sentences() + doc_lines()


# ------------------------------------------------------------------------------------------------ reference
_MOSES = {}


def reference_words(text: str) -> list[str]:
    """The official GLUE pipeline with sacremoses called directly (the clean-up scripts' semantics are ours)."""
    import sacremoses
    if not _MOSES:
        _MOSES["n"] = sacremoses.MosesPunctNormalizer(lang="en")
        _MOSES["t"] = sacremoses.MosesTokenizer(lang="en")
    line = _MOSES["n"].normalize(fairseq_bpe.pre_cleanup(text))
    line = "".join(" " if unicodedata.category(c).startswith("C") else c for c in line)
    line = fairseq_bpe.split_punctuation(line.strip().lower())
    line = fairseq_bpe.replace_patterns(line).replace("\\", " ")
    return _MOSES["t"].tokenize(line, escape=False, return_str=True).lower().split()


def subword_nmt_bpe(codes_fastbpe: str):
    """subword-nmt's BPE object for fastBPE codes ('a b count' -> its 0.2 format 'a b')."""
    from subword_nmt.apply_bpe import BPE
    lines = ["#version: 0.2"] + [" ".join(line.split()[:2]) for line in codes_fastbpe.splitlines()]
    return BPE(io.StringIO("\n".join(lines) + "\n"))


def reference_ids(text: str, bpe, vocab: list[str]) -> list[int]:
    index = {t: i for i, t in enumerate(vocab)}
    return [index.get(p, 3) for p in bpe.segment_tokens(reference_words(text))]


def learn_codes(lines: list[str], merges: int = 400) -> str:
    """fastBPE-format codes ('left right count') learned with subword-nmt on the reference words of `lines`."""
    from subword_nmt.learn_bpe import learn_bpe
    out = io.StringIO()
    learn_bpe(io.StringIO("\n".join(" ".join(reference_words(x)) for x in lines) + "\n"), out, merges,
              min_frequency=2)
    pairs = [x for x in out.getvalue().splitlines() if x and not x.startswith("#")]
    return "".join(f"{p} {10 * (len(pairs) - i) + 2}\n" for i, p in enumerate(pairs))


def make_dict(lines: list[str], codes: str) -> str:
    """A fairseq dict.txt of the BPE pieces of `lines`, by count, padded with madeupwords as fairseq pads."""
    bpe = subword_nmt_bpe(codes)
    counts = collections.Counter(p for x in lines for p in bpe.segment_tokens(reference_words(x)))
    symbols = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    i = 0
    while (len(SPECIALS) + len(symbols)) % 8:
        symbols.append((f"madeupword{i:04d}", 0))
        i += 1
    return "".join(f"{s} {c}\n" for s, c in symbols)


# ------------------------------------------------------------------------------------------------ checkpoint
TINY_ARGS = dict(encoder_layers=2, encoder_embed_dim=32, encoder_ffn_embed_dim=64, encoder_attention_heads=4,
                 max_positions=64, rel_pos=True, embedding_normalize=True)


def official_state_dict(vocab_rows: int, *, encoder_layers: int, encoder_embed_dim: int, encoder_ffn_embed_dim: int,
                        encoder_attention_heads: int, max_positions: int, rel_pos: bool, seed: int = 0,
                        **_) -> dict[str, np.ndarray]:
    """Random float32 weights with the TUPE code's names and shapes (BertModel: decoder.sentence_encoder.*)."""
    rng = np.random.default_rng(seed)
    d, f = encoder_embed_dim, encoder_ffn_embed_dim

    def w(*shape, scale=0.2):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def ln(name):
        return {f"{name}.weight": (1 + w(d, scale=0.1)), f"{name}.bias": w(d, scale=0.1)}

    s = "decoder.sentence_encoder."
    sd = {f"{s}embed_tokens.weight": w(vocab_rows, d, scale=0.5), **ln(f"{s}emb_layer_norm"),
          f"{s}pos.weight": w(max_positions + 1, d, scale=0.5), **ln(f"{s}pos_ln"),
          f"{s}pos_q_linear.weight": w(d, d), f"{s}pos_q_linear.bias": w(d),
          f"{s}pos_k_linear.weight": w(d, d), f"{s}pos_k_linear.bias": w(d)}
    sd[f"{s}embed_tokens.weight"][1] = 0.0     # padding_idx row, as nn.Embedding(padding_idx=1) keeps it
    if rel_pos:
        sd[f"{s}relative_attention_bias.weight"] = w(33, encoder_attention_heads, scale=1.0)
    for i in range(encoder_layers):
        p = f"{s}layers.{i}."
        sd.update({f"{p}self_attn.in_proj_weight": w(3 * d, d), f"{p}self_attn.in_proj_bias": w(3 * d),
                   f"{p}self_attn.out_proj.weight": w(d, d), f"{p}self_attn.out_proj.bias": w(d),
                   **ln(f"{p}self_attn_layer_norm"), f"{p}fc1.weight": w(f, d), f"{p}fc1.bias": w(f),
                   f"{p}fc2.weight": w(d, f), f"{p}fc2.bias": w(d), **ln(f"{p}final_layer_norm")})
    sd.update({"decoder.lm_head.dense.weight": w(d, d), "decoder.lm_head.dense.bias": w(d),
               **ln("decoder.lm_head.layer_norm"), "decoder.lm_head.bias": w(vocab_rows)})
    sd["decoder.lm_head.weight"] = sd[f"{s}embed_tokens.weight"]
    return sd


def _fake_fairseq_meters():
    """A stand-in `fairseq.meters` module so the checkpoint pickles meters by fairseq's names (removed after)."""
    module = types.ModuleType("fairseq.meters")

    class AverageMeter:
        def __init__(self):
            self.val, self.avg, self.sum, self.count = 2.5, 2.5, 25.0, 10

    AverageMeter.__module__ = "fairseq.meters"
    AverageMeter.__qualname__ = "AverageMeter"
    module.AverageMeter = AverageMeter
    return module


def write_checkpoint(folder: str, lines: list[str] | None = None, *, codes: str | None = None,
                     dict_txt: str | None = None, args: dict | None = None, extra: dict | None = None,
                     tensors: dict | None = None, seed: int = 0, name: str = "checkpoint_best.pt",
                     legacy_format: bool = False, half: bool = False) -> dict[str, np.ndarray]:
    """An extracted-checkpoint folder (`name`, dict.txt, bpe-code) in the official format; returns the weights.

    `args` overrides the stored args, `extra` adds top-level checkpoint entries, `tensors` replaces/adds weights;
    `half`: float16 weights (a --fp16 run's state dict; the returned arrays are the float16 values as float32).
    """
    import torch
    os.makedirs(folder, exist_ok=True)
    lines = lines if lines is not None else sentences()
    codes = codes if codes is not None else learn_codes(lines)
    dict_txt = dict_txt if dict_txt is not None else make_dict(lines, codes)
    with open(os.path.join(folder, "bpe-code"), "w", encoding="utf-8") as f:
        f.write(codes)
    with open(os.path.join(folder, "dict.txt"), "w", encoding="utf-8") as f:
        f.write(dict_txt)
    vocab_rows = len(SPECIALS) + len(dict_txt.splitlines()) + 1      # + <mask>
    a = {**TINY_ARGS, "arch": "bert_base", "task": "masked_lm", "criterion": "masked_lm", "activation_fn": "gelu",
         "dropout": 0.1, "attention_dropout": 0.1, "activation_dropout": 0.0, "pooler_activation_fn": "tanh",
         "encoder_normalize_before": False, "tokens_per_sample": 64, "lr": [0.0001], "adam_betas": "(0.9, 0.999)",
         "seed": 1, "fp16": True, "mask_prob": 0.15, **(args or {})}
    sd = official_state_dict(vocab_rows, seed=seed, **{k: a[k] for k in TINY_ARGS})
    sd.update(tensors or {})
    if half:
        sd = {k: v.astype(np.float16).astype(np.float32) for k, v in sd.items()}
    model = collections.OrderedDict((k, torch.from_numpy(np.ascontiguousarray(v))) for k, v in sd.items())
    if half:
        model = collections.OrderedDict((k, v.half()) for k, v in model.items())
    model["decoder.lm_head.weight"] = model["decoder.sentence_encoder.embed_tokens.weight"]   # tied, shared
    meters, package = _fake_fairseq_meters(), types.ModuleType("fairseq")
    package.meters = meters
    assert "fairseq" not in sys.modules, "the fixture must not shadow a real fairseq"
    sys.modules.update({"fairseq": package, "fairseq.meters": meters})
    try:
        state = {"args": argparse.Namespace(**a), "model": model,
                 "optimizer_history": [{"criterion_name": "MaskedLmLoss", "optimizer_name": "FairseqAdam",
                                        "lr_scheduler_state": {"best": 2.31}, "num_updates": 1000}],
                 "extra_state": {"epoch": 3, "val_loss": 2.31, "train_iterator": {"epoch": 3, "iterations_in_epoch": 7},
                                 "train_meters": collections.OrderedDict(train_loss=meters.AverageMeter())},
                 "last_optimizer_state": {"state": {0: {"step": 1000, "exp_avg": torch.zeros(3)}},
                                          "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.999), "params": [0]}]},
                 **(extra or {})}
        torch.save(state, os.path.join(folder, name), _use_new_zipfile_serialization=not legacy_format)
    finally:
        del sys.modules["fairseq.meters"], sys.modules["fairseq"]
    return sd
