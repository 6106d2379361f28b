"""Lower-cased WordPiece tokenizer (HF `tokenizers` for encoding), trained offline or loaded from a vocab.txt.

Training counts words with HF's BERT normaliser/pre-tokeniser and learns the word pieces with our own BPE-style
loop (`learn_wordpiece`) because HF's WordPiece trainer is not deterministic across processes (ties broken by
hash-map order); every host and every run on the same text gets the same vocabulary.

A vocabulary trained here starts with [PAD]=0 [UNK]=1 [CLS]=2 [SEP]=3 [MASK]=4 (the `*_ID` constants); a loaded
one may hold the five anywhere (BERT's vocab.txt: [PAD]=0, [UNK]=100, [CLS]=101, [SEP]=102, [MASK]=103), and
`Tokenizer.pad_id`/`cls_id`/... are read from it. Lower-casing and accent stripping (BERT's `do_lower_case`,
`strip_accents`) come from a `tokenizer_config.json` next to the vocab.txt, when there is one (default: lower-case,
accents stripped, as BERT uncased). `encode` never adds special tokens; the pipelines add [CLS]/[SEP] themselves.
The literal strings "[UNK]" etc. in text map to their ids (the WikiText reader uses this for `<unk>`).
"""
from __future__ import annotations

import hashlib
import heapq
import json
import logging
import os
from collections import Counter, defaultdict
from pathlib import Path
from typing import Callable, Iterable, Sequence

from tupe_jax import files
from tupe_jax.data.cache import cache_dir
from tupe_jax.errors import UserError, require

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = range(5)   # in a vocabulary trained here
NUM_SPECIALS = len(SPECIALS)
MIN_LEARNED_VOCAB = NUM_SPECIALS + 31   # the specials and room for the characters of a tiny corpus


def check_learned_vocab_size(vocab_size: int) -> None:
    """A vocabulary learned here (no data.vocab_file) needs `MIN_LEARNED_VOCAB` tokens (checked before compute)."""
    require(int(vocab_size) >= MIN_LEARNED_VOCAB, f"model.vocab_size = {vocab_size} is too small to learn a "
            "vocabulary", "--config.model.vocab_size", f"use at least {MIN_LEARNED_VOCAB} (e.g. 8192), or give "
            "--config.data.vocab_file")
CONFIG_NAME = "tokenizer_config.json"   # HF's name; the keys read are do_lower_case and strip_accents

log = logging.getLogger(__name__)


def _build(vocab: dict[str, int] | None, lowercase: bool = True, strip_accents: bool | None = None):
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, normalizers, pre_tokenizers
    model = models.WordPiece(vocab=vocab, unk_token="[UNK]", max_input_chars_per_word=100) if vocab \
        else models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=100)
    tok = HFTokenizer(model)
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                strip_accents=strip_accents, lowercase=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    if vocab:
        tok.add_special_tokens(list(SPECIALS))
    return tok


class Tokenizer:
    """WordPiece tokenizer; the special ids (`pad_id`, `unk_id`, `cls_id`, `sep_id`, `mask_id`) are where the
    vocabulary holds [PAD] [UNK] [CLS] [SEP] [MASK]. `lowercase`/`strip_accents` as BERT's normaliser (None: strip
    accents when lower-casing)."""

    def __init__(self, vocab: Sequence[str], source: str = "", lowercase: bool = True,
                 strip_accents: bool | None = None):
        vocab = list(vocab)
        index = {t: i for i, t in enumerate(vocab)}
        if len(index) != len(vocab):
            dup = next(t for i, t in enumerate(vocab) if index[t] != i)
            raise UserError(f"vocabulary has duplicate token {dup!r}", source or "vocab", "remove the duplicate line")
        missing = [t for t in SPECIALS if t not in index]
        if missing:
            raise UserError(f"vocabulary lacks the special token(s) {' '.join(missing)}", source or "vocab",
                            f"use a vocab.txt that holds all of {' '.join(SPECIALS)} (e.g. one trained by tupe_jax)")
        self.vocab = vocab
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (index[t] for t in SPECIALS)
        # ids text never produces bar [UNK]: the five and reserved "[...]" tokens such as BERT's [unusedN] (the
        # pre-tokenizer splits off brackets); MLM masking neither masks nor samples them. (0..4) in our own layout.
        self.special_ids = tuple(i for i, t in enumerate(vocab) if len(t) > 2 and t[0] == "[" and t[-1] == "]")
        self.lowercase, self.strip_accents = bool(lowercase), strip_accents
        self._tok = _build(index, self.lowercase, strip_accents)
        text = "\n".join(vocab) + ("" if self.default_casing else f"\n{self.casing_config()}")
        self.fingerprint = hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def default_casing(self) -> bool:
        """Lower-casing with accents stripped (BERT uncased, and every vocabulary trained here)."""
        return self.lowercase and self.strip_accents in (None, True)

    def casing_config(self) -> dict:
        """The `tokenizer_config.json` keys that say how text is normalised (HF's names)."""
        return {"do_lower_case": self.lowercase, "strip_accents": self.strip_accents}

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

    def save(self, directory: str | Path) -> Path | str:
        """Write `directory/vocab.txt` (and `tokenizer_config.json` unless the casing is the default) atomically,
        locally or in a bucket; returns the vocab.txt path."""
        if not self.default_casing:
            files.write_json(files.join(directory, CONFIG_NAME), self.casing_config())
        path = files.write_text(files.join(directory, "vocab.txt"), "".join(t + "\n" for t in self.vocab))
        return path if files.is_remote(path) else Path(path)

    @classmethod
    def from_file(cls, path: str | Path) -> "Tokenizer":
        path = str(path) if files.is_remote(path) else os.path.expanduser(str(path))
        if not files.isfile(path):
            raise UserError(f"vocab file {path!r} not found", "config.data.vocab_file",
                            "point data.vocab_file at a vocab.txt, or leave it empty to train one")
        folder = path.rsplit("/", 1)[0] if "/" in path else "."
        if read_kind(files.join(folder, CONFIG_NAME)) == "fairseq_bpe":   # an import-fairseq run (fairseq_bpe.py)
            from tupe_jax.data.fairseq_bpe import FairseqBpeTokenizer
            return FairseqBpeTokenizer.from_folder(folder)  # type: ignore[return-value]
        try:
            lines = files.read_text(path).removeprefix("\ufeff").split("\n")   # a BOM is no part of [PAD]
        except UnicodeDecodeError:
            raise UserError("vocab file is not UTF-8", path, "re-encode it as UTF-8") from None
        lines = [line.removesuffix("\r") for line in lines]
        while lines and lines[-1] == "":                 # blank lines at the end are no tokens
            lines.pop()
        if "" in lines:
            raise UserError(f"vocab file line {lines.index('') + 1} is empty (an empty token)", path,
                            "remove the blank line (token ids are line numbers: check the ids after it)")
        return cls(lines, source=path, **read_casing(files.join(path.rsplit("/", 1)[0] if "/" in path else ".",
                                                                  CONFIG_NAME)))

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> "Tokenizer":
        """Train lower-cased WordPiece on `texts`; the result depends only on the text (see `learn_wordpiece`)."""
        check_learned_vocab_size(vocab_size)
        tok = _build(None)
        counts: Counter = Counter()
        for text in texts:
            for special in SPECIALS:
                text = text.replace(special, " ")
            counts.update(w for w, _ in tok.pre_tokenizer.pre_tokenize_str(tok.normalizer.normalize_str(text)))
        return cls(learn_wordpiece(counts, vocab_size))


def read_kind(path: str | Path) -> str:
    """`tokenizer_class` of a `tokenizer_config.json` ('' if there is none or it does not say)."""
    if not files.isfile(path):
        return ""
    try:
        return str(json.loads(files.read_text(path)).get("tokenizer_class", ""))
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return ""


def read_casing(path: str | Path) -> dict:
    """{'lowercase', 'strip_accents'} from an HF `tokenizer_config.json` ({} if there is none)."""
    if not files.isfile(path):
        return {}
    try:
        data = json.loads(files.read_text(path))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{path} is not valid JSON ({err})", str(path), "fix or remove it") from None
    require(isinstance(data, dict), f"{path} holds a JSON {type(data).__name__}, not an object", str(path),
            "fix or remove it")
    out = {}
    if "do_lower_case" in data:
        out["lowercase"] = bool(data["do_lower_case"])
    if data.get("strip_accents") is not None:
        out["strip_accents"] = bool(data["strip_accents"])
    return out


def learn_wordpiece(counts: dict[str, int], vocab_size: int, max_alphabet: int = 1000,
                    max_word_chars: int = 100) -> list[str]:
    """WordPiece vocabulary by BPE merges over word counts (as HF's WordPiece trainer), deterministic.

    HF's trainer breaks ties through hash-map order, so two runs on the same text give different vocabularies;
    here ties go to the lexicographically smallest pair. Symbols: a word's first character as is, the others
    '##'-prefixed; the alphabet is the most frequent symbols that fit (at most `max_alphabet`; a warning says when
    some do not). Vocab = specials, alphabet (sorted), then merged symbols in merge order, until `vocab_size`.
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
    if not sym_count:     # e.g. only control or zero-width characters, which the normaliser removes
        raise UserError("the text has no word the tokenizer keeps (after lower-casing, accent stripping and removing "
                        "control and zero-width characters)", "--config.data.path", "point data.path at real text")
    room = min(max_alphabet, max(0, vocab_size - NUM_SPECIALS))
    alphabet = sorted(sorted(sym_count, key=lambda x: (-sym_count[x], x))[:room])   # the most frequent symbols
    if len(sym_count) > room:
        log.warning("tokenizer: the text has %d distinct symbols (a word's first character, '##' + a later one); "
                    "the vocabulary keeps the %d most frequent, and words with any other become [UNK] (%s)",
                    len(sym_count), room, "raise vocab_size" if room < max_alphabet else f"at most {max_alphabet}")
    keep = set(alphabet)
    kept = [(w, f) for w, f in zip(words, freqs) if all(x in keep for x in w)]
    words, freqs = [w for w, _ in kept], [f for _, f in kept]
    vocab = list(SPECIALS) + alphabet
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
    if len(vocab) < vocab_size:
        log.warning("tokenizer: corpus supports only %d of the requested %d word pieces", len(vocab), vocab_size)
    return vocab


def learned(documents: Callable[[], Iterable[str]], vocab_size: int, root: Path) -> Tokenizer:
    """`Tokenizer.train(documents(), vocab_size)`, learned once per text, vocabulary size and version of this module.

    Learning takes ~45 s per 100 MB of text on one core (benchmarks/results_tokenizer_learning.json) and gives the
    same vocabulary every time, so each run of a comparison would otherwise repeat it. The cache key is a sha256 over
    this file's source (any change to the learning code makes new entries), the size and every document; the entry
    `root/<key>/` holds vocab.txt and meta.json with its fingerprint, and one whose vocab.txt no longer matches that
    fingerprint is learned again. Written atomically, so concurrent runs may both learn and write it."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update(f"\0{vocab_size}\0".encode())
    for text in documents():
        digest.update(text.encode("utf-8"))
        digest.update(b"\0")
    entry = root / digest.hexdigest()[:32]
    if (entry / "meta.json").is_file():
        try:
            tok = Tokenizer.from_file(entry / "vocab.txt")
            if tok.fingerprint == files.read_json(entry / "meta.json").get("fingerprint"):
                return tok
        except (UserError, ValueError, OSError, AttributeError):   # unreadable: learned again below
            pass
        log.warning("tokenizer: the cached vocabulary in %s does not match its fingerprint; learning it again", entry)
    tok = Tokenizer.train(documents(), vocab_size)
    tok.save(entry)
    files.write_json(entry / "meta.json", {"fingerprint": tok.fingerprint, "vocab_size": vocab_size})
    return tok


def get_tokenizer(config, workdir: str | Path | None) -> Tokenizer:
    """The run's tokenizer: `workdir/tokenizer/vocab.txt` (resume) > `config.data.vocab_file` > train one.

    A trained tokenizer uses `config.model.vocab_size` and the training split of `config.data` (learned once per
    text in the data cache: `learned`); it is saved to `workdir/tokenizer/` (by process 0) so a resumed run reuses
    it. With workdir=None nothing is saved in a workdir.
    """
    saved = files.join(workdir, "tokenizer", "vocab.txt") if workdir else None
    if saved is not None and files.isfile(saved):
        return Tokenizer.from_file(saved)
    if config.data.get("vocab_file", ""):
        tok = Tokenizer.from_file(config.data.vocab_file)
    else:
        from tupe_jax.data.builders import iter_documents  # local import: builders import tfds
        tok = learned(lambda: iter_documents(config, "train"), int(config.model.vocab_size),
                      cache_dir(config) / "tokenizers")
    model_vocab = int(config.model.get("vocab_size", tok.vocab_size))
    if tok.vocab_size > model_vocab:
        raise UserError(f"tokenizer has {tok.vocab_size} tokens but model.vocab_size is {model_vocab}",
                        str(config.data.get("vocab_file", "")) or "config.model.vocab_size",
                        f"set --config.model.vocab_size={tok.vocab_size} or use a smaller vocab")
    if saved is not None and writes_tokenizer():
        tok.save(files.join(workdir, "tokenizer"))
    return tok


def writes_tokenizer() -> bool:
    """Whether this process writes the run's tokenizer: process 0 alone (every process of a pod makes the same one,
    and a bucket rate-limits writes of one object)."""
    import jax  # local import: the tokenizer itself needs no jax
    return jax.process_index() == 0
