"""Lower-cased WordPiece tokenizer (HF `tokenizers` for encoding), trained offline or loaded from a vocab.txt.

Training counts words with HF's BERT normaliser/pre-tokeniser and learns the word pieces with our own BPE-style
loop (`learn_wordpiece`) because HF's WordPiece trainer is not deterministic across processes (ties broken by
hash-map order); every host and every run on the same text gets the same vocabulary.

The vocabulary always starts with [PAD]=0 [UNK]=1 [CLS]=2 [SEP]=3 [MASK]=4. `encode` never adds special tokens;
the pipelines add [CLS]/[SEP] themselves. The literal strings "[UNK]" etc. in text map to their ids (the WikiText
reader uses this for `<unk>`).
"""
from __future__ import annotations

import hashlib
import heapq
import logging
import os
from collections import Counter, defaultdict
from pathlib import Path
from typing import Iterable, Sequence

from tupe_jax import files
from tupe_jax.errors import UserError

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = range(5)
NUM_SPECIALS = len(SPECIALS)

log = logging.getLogger(__name__)


def _build(vocab: dict[str, int] | None):
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, normalizers, pre_tokenizers
    model = models.WordPiece(vocab=vocab, unk_token="[UNK]", max_input_chars_per_word=100) if vocab \
        else models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=100)
    tok = HFTokenizer(model)
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                                lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    if vocab:
        tok.add_special_tokens(list(SPECIALS))
    return tok


class Tokenizer:
    """WordPiece tokenizer with the project's fixed special ids."""

    pad_id, unk_id, cls_id, sep_id, mask_id = PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID

    def __init__(self, vocab: Sequence[str], source: str = ""):
        vocab = list(vocab)
        if tuple(vocab[:NUM_SPECIALS]) != SPECIALS:
            raise UserError(f"vocabulary must start with {' '.join(SPECIALS)} (found {vocab[:NUM_SPECIALS]})",
                            source or "vocab", "use a vocab.txt trained by tupe_jax or reorder its first five lines")
        if len(set(vocab)) != len(vocab):
            dup = next(t for i, t in enumerate(vocab) if t in vocab[:i])
            raise UserError(f"vocabulary has duplicate token {dup!r}", source or "vocab", "remove the duplicate line")
        self.vocab = vocab
        self._tok = _build({t: i for i, t in enumerate(vocab)})
        self.fingerprint = hashlib.sha256("\n".join(vocab).encode()).hexdigest()[:16]

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str:
        return self.vocab[i]

    def save(self, directory: str | Path) -> Path:
        """Write `directory/vocab.txt` atomically; returns its path."""
        return Path(files.write_text(Path(directory) / "vocab.txt", "".join(t + "\n" for t in self.vocab)))

    @classmethod
    def from_file(cls, path: str | Path) -> "Tokenizer":
        path = Path(path).expanduser()
        if not path.is_file():
            raise UserError(f"vocab file {str(path)!r} not found", "config.data.vocab_file",
                            "point data.vocab_file at a vocab.txt, or leave it empty to train one")
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError:
            raise UserError("vocab file is not UTF-8", str(path), "re-encode it as UTF-8") from None
        if lines and lines[-1] == "":
            lines.pop()
        return cls(lines, source=str(path))

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> "Tokenizer":
        """Train lower-cased WordPiece on `texts`; the result depends only on the text (see `learn_wordpiece`)."""
        if vocab_size <= NUM_SPECIALS + 30:
            raise UserError(f"vocab_size {vocab_size} is too small", "config.model.vocab_size", "use at least 100")
        tok = _build(None)
        counts: Counter = Counter()
        for text in texts:
            for special in SPECIALS:
                text = text.replace(special, " ")
            counts.update(w for w, _ in tok.pre_tokenizer.pre_tokenize_str(tok.normalizer.normalize_str(text)))
        vocab = learn_wordpiece(counts, vocab_size)
        if len(vocab) < vocab_size:
            log.warning("tokenizer: corpus supports only %d of the requested %d word pieces", len(vocab), vocab_size)
        return cls(vocab)


def learn_wordpiece(counts: dict[str, int], vocab_size: int, max_alphabet: int = 1000,
                    max_word_chars: int = 100) -> list[str]:
    """WordPiece vocabulary by BPE merges over word counts (as HF's WordPiece trainer), deterministic.

    HF's trainer breaks ties through hash-map order, so two runs on the same text give different vocabularies;
    here ties go to the lexicographically smallest pair. Symbols: a word's first character as is, the others
    '##'-prefixed; the alphabet is the `max_alphabet` most frequent symbols. Vocab = specials, alphabet (sorted),
    then merged symbols in merge order, until `vocab_size`.
    """
    words, freqs = [], []
    sym_count: Counter = Counter()
    for w in sorted(counts):
        if len(w) > max_word_chars:
            continue
        syms = [w[0]] + ["##" + ch for ch in w[1:]]
        words.append(syms)
        freqs.append(counts[w])
        for sym in syms:
            sym_count[sym] += counts[w]
    alphabet = sorted(sorted(sym_count, key=lambda x: (-sym_count[x], x))[:max_alphabet])
    keep = set(alphabet)
    kept = [(w, f) for w, f in zip(words, freqs) if all(x in keep for x in w)]
    words, freqs = [w for w, _ in kept], [f for _, f in kept]
    vocab = list(SPECIALS) + alphabet[:max(0, vocab_size - NUM_SPECIALS)]
    known = set(vocab)
    pair_count: dict[tuple[str, str], int] = defaultdict(int)
    where: dict[tuple[str, str], set[int]] = defaultdict(set)
    for i, (w, f) in enumerate(zip(words, freqs)):
        for pair in zip(w, w[1:]):
            pair_count[pair] += f
            where[pair].add(i)
    heap = [(-c, a, b) for (a, b), c in pair_count.items()]
    heapq.heapify(heap)
    while len(vocab) < vocab_size and heap:
        negc, a, b = heapq.heappop(heap)
        if pair_count.get((a, b), 0) != -negc or negc == 0:
            continue  # stale heap entry
        new = a + b[2:]
        if new not in known:
            vocab.append(new)
            known.add(new)
        changed = set()
        for i in sorted(where.pop((a, b), ())):
            w, f = words[i], freqs[i]
            out, j = [], 0
            while j < len(w):
                if j + 1 < len(w) and w[j] == a and w[j + 1] == b:
                    out.append(new)
                    j += 2
                else:
                    out.append(w[j])
                    j += 1
            if len(out) == len(w):
                continue
            for pair in zip(w, w[1:]):
                pair_count[pair] -= f
                changed.add(pair)
            for pair in zip(out, out[1:]):
                pair_count[pair] += f
                where[pair].add(i)
                changed.add(pair)
            words[i] = out
        pair_count.pop((a, b), None)
        for pair in changed:
            if pair_count.get(pair, 0) > 0:
                heapq.heappush(heap, (-pair_count[pair], pair[0], pair[1]))
    return vocab


def get_tokenizer(config, workdir: str | Path | None) -> Tokenizer:
    """The run's tokenizer: `workdir/tokenizer/vocab.txt` (resume) > `config.data.vocab_file` > train one.

    A trained tokenizer uses `config.model.vocab_size` and the training split of `config.data`; it is saved to
    `workdir/tokenizer/` so a resumed run reuses it. With workdir=None nothing is saved.
    """
    saved = Path(workdir) / "tokenizer" / "vocab.txt" if workdir else None
    if saved is not None and saved.is_file():
        return Tokenizer.from_file(saved)
    if config.data.get("vocab_file", ""):
        tok = Tokenizer.from_file(config.data.vocab_file)
    else:
        from tupe_jax.data.builders import iter_documents  # local import: builders import tfds
        vocab_size = int(config.model.vocab_size)
        tok = Tokenizer.train(iter_documents(config, "train"), vocab_size)
    model_vocab = int(config.model.get("vocab_size", tok.vocab_size))
    if tok.vocab_size > model_vocab:
        raise UserError(f"tokenizer has {tok.vocab_size} tokens but model.vocab_size is {model_vocab}",
                        str(config.data.get("vocab_file", "")) or "config.model.vocab_size",
                        f"set --config.model.vocab_size={tok.vocab_size} or use a smaller vocab")
    if saved is not None:
        tok.save(saved.parent)
    return tok
