"""Test fixtures for the Hugging Face interop: BERT-layout vocabularies and random tiny BERTs saved by
`transformers` (its Flax classes: no torch)."""
import os

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_GLUE = os.path.normpath(os.path.join(ROOT, "..", "shared", "data", "glue"))   # the GLUE TSVs, when present
BERT_SPECIALS = ["[PAD]"] + [f"[unused{i}]" for i in range(99)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
TINY_BERT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                 max_position_embeddings=64)

WORDS = ("the a of and to in is was for on that with as by at from cat dog sat mat ran quickly over under "
         "Café naïve Übermensch résumé São Paulo Zürich don't won't it's U.S. e-mail 3.14 1,000 $5 50% "
         "東京 北京 日本語 😀 Ω≈ç √ ∫ ... -- (hello) [world] {x} \"quoted\" 'single' "
         "co-operate ALLCAPS MiXeD").split()


def generated_texts(n: int, seed: int = 0) -> list[str]:
    """Sentences of WORDS with odd spacing, tabs, accents, CJK, emoji and one over-long word."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        words = list(rng.choice(WORDS, rng.integers(1, 25)))
        if i % 17 == 0:
            words.append("x" * 120)          # longer than max_input_chars_per_word: one [UNK]
        sep = ["  ", "\t", " ", " \u00a0"][i % 4]
        out.append(sep.join(words))
    return out


def bert_layout_vocab(texts, pieces: int) -> list[str]:
    """BERT's layout: [PAD] 0, [unused0..98], [UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103, then word pieces learned
    on `texts` (our deterministic WordPiece learner)."""
    from tupe_jax.data.tokenizer import Tokenizer
    return BERT_SPECIALS + Tokenizer.train(texts, pieces + 5).vocab[5:]


def write_vocab(folder, vocab) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "vocab.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(t + "\n" for t in vocab))
    return path


def random_params(params, seed: int):
    """Every leaf of an HF Flax param tree redrawn (biases and LayerNorms too), so no weight is trivially 0 or 1."""
    import jax
    import jax.numpy as jnp
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(lambda x: jnp.asarray(rng.normal(0.0, 0.3, x.shape) + (x == 1) * 1.0,
                                                        jnp.float32), params)


def save_hf_bert(folder, vocab, cls_name="FlaxBertForMaskedLM", seed: int = 0, **config):
    """A random tiny BERT made by transformers and saved with `save_pretrained(safe_serialization=True)`, with
    `vocab` as its vocab.txt. Returns (model, params, BertConfig)."""
    import transformers
    cfg = transformers.BertConfig(vocab_size=len(vocab), **{**TINY_BERT, **config})
    model = getattr(transformers, cls_name)(cfg, seed=seed)
    params = random_params(model.params, seed)
    model.save_pretrained(str(folder), params=params, safe_serialization=True)
    write_vocab(folder, vocab)
    return model, params, cfg


def padded_batch(vocab_size: int, seed: int = 0):
    """(ids, attention mask) of 4 rows of 16 with [CLS] first and 3 rows padded (mask 0, id 0) at the end."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(104, vocab_size, (4, 16)).astype(np.int32)
    ids[:, 0] = 101
    mask = np.ones_like(ids)
    for row, n in ((1, 11), (2, 5), (3, 2)):
        mask[row, n:] = 0
        ids[row, n:] = 0
    return ids, mask
