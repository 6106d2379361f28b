"""The TUPE authors' tokenizer path (fairseq): their text clean-up, Moses, fastBPE codes and a fairseq dict.txt.

What the official GLUE preprocessing (`preprocess/glue/process.sh` of github.com/guolinke/TUPE) does to a sentence,
step by step, and how it is done here:

1. clean-up (their `precleanup_english.py`): tabs to spaces, runs of spaces collapsed, 4+ dots -> '...', '<<' / '>>'
   -> '«' / '»', ',,' -> ',' and ',.' -> '.', an asterisk glued to the start of a word dropped;
2. Moses `normalize-punctuation.perl en` -> `sacremoses.MosesPunctNormalizer('en')`;
3. Moses `remove-non-printing-char.perl` (every Unicode category-C character becomes a space);
4. their `glue/cleanup.py`: lower-case; backslashes to spaces; '...' and '..' set apart; leading and trailing ASCII
   punctuation of every word split off one character at a time;
5. their `replace_patterns.py`: a word that is a URL, an e-mail address or a file name becomes `<url>`, `<email>`,
   `<file>`; hyphens inside words are set apart (' - ');
   (their `align_text.py` is next in the pipe; it computes substitutions and discards them: a no-op);
6. backslashes to spaces; Moses `tokenizer.perl -l en -no-escape` -> `sacremoses.MosesTokenizer('en')`,
   `escape=False` (no protected patterns: `<url>` comes out as `< url >`, as theirs); lower-case;
7. fastBPE `applybpe` with the released codes, then fairseq's dictionary lookup (unknown symbols -> `<unk>`).

BPE: the `fastBPE` package on PyPI is a C++/Cython extension last released in 2019 that does not build here (no
wheel; `pip install fastBPE` fails to compile), so `apply_bpe` is a small applier of the same algorithm: a word is
split into characters with `</w>` glued to the last one, and the adjacent pair with the lowest rank in the codes
file (its line number) is merged everywhere in the word, until no pair has a rank; every piece but the last gets
`@@`. The tests check it against `subword-nmt` (an independent, maintained implementation of the same merge rule,
codes format 0.2) on GLUE-style sentences.

The dictionary (fairseq's `Dictionary` as the TUPE fork has it): <s>=0 <pad>=1 </s>=2 <unk>=3 <file>=4 <email>=5
<url>=6, then the dict.txt symbols in file order (with fairseq's 'madeupwordNNNN' padding when the file has it),
then `<mask>` (added by the masked_lm task). Sequences: <s> a </s> (single), <s> a </s> </s> b </s> (pairs:
`pair_separators` = 2, fairseq's --separator-token 2 prepended to the second sentence).

A run keeps `tokenizer/vocab.txt` (every symbol, one per line, by id), `tokenizer/bpe-codes` (the released file as
is) and `tokenizer/tokenizer_config.json` ({"tokenizer_class": "fairseq_bpe"}); `tokenizer.Tokenizer.from_file`
opens such a folder as a `FairseqBpeTokenizer`.
"""
from __future__ import annotations

import hashlib
import re
import string
import unicodedata
from typing import Iterable, Sequence

from tupe_jax import files
from tupe_jax.errors import UserError

KIND = "fairseq_bpe"
CODES_NAME = "bpe-codes"
SPECIALS = ("<s>", "<pad>", "</s>", "<unk>", "<file>", "<email>", "<url>")
MASK = "<mask>"
EOW = "</w>"

_EMAIL = re.compile(r"^([a-z0-9_\-\.]+)@((\[[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}\.)|(([a-z0-9\-]+\.)+))"
                    r"([a-z]{2,4}|[0-9]{1,3})(\]?)$")
_URL_SCHEME = re.compile(r"^(?:(?:https?|ftp):\/\/|www\.)[-a-z0-9+&@#\/%?=~_|!:,.;]*[-a-z0-9+&@#\/%=~_|]$")
_URL_DOMAIN = re.compile(r"^[^$s]{3}[^$s]*\.(?:com|net|org|edu|gov)$")
_FILE = re.compile(r"^[a-z_-][a-z0-9_-]{4}[a-z0-9_-]*\.(?:pdf|mp4|mp3|doc|xls|docx|ppt|pptx|wav|wma|csv|tsv|cpp|py|"
                   r"bat|reg|png|jpg|mov|avi|gif|rtf|txt|bmp|mid)$")


def _squeeze(text: str) -> str:
    return " ".join(text.split())


def pre_cleanup(line: str) -> str:
    """Step 1 (see the module docstring)."""
    line = _squeeze(line.replace("\t", " "))
    line = re.sub(r"\.{4,}", "...", line)
    line = line.replace("<<", "«").replace(">>", "»")
    line = re.sub(r" (,:\.\)\]»)", r"\1", line)      # as theirs: only the literal sequence ' ,:.)]»'
    line = re.sub(r"(\[\(«) ", r"\1", line)          # and '[(« '
    line = line.replace(",,", ",").replace(",.", ".")
    line = re.sub(r" \*([^\s])", r" \1", line)
    return _squeeze(line)


def remove_non_printing(line: str) -> str:
    """Step 3: Unicode category C (control, format, private use, unassigned, surrogates) -> ' '."""
    return "".join(" " if unicodedata.category(ch)[0] == "C" else ch for ch in line)


def split_punctuation(line: str) -> str:
    """Step 4 (after lower-casing)."""
    line = line.replace("\\", " ")
    line = re.sub(r"\s\s+", " ", line)
    line = line.replace("...", " ... ")
    line = line.replace("..", " .. ")
    pieces: list[str] = []
    for word in line.split():
        core = word.lstrip(string.punctuation)
        lead = len(word) - len(core)
        core = core.rstrip(string.punctuation)
        pieces.extend(word[:lead])
        if core:
            pieces.append(core)
        pieces.extend(word[lead + len(core):])
    return " ".join(pieces)


def replace_patterns(line: str) -> str:
    """Step 5."""
    out = []
    for word in line.split():
        for pattern, token in ((_URL_SCHEME, "<url>"), (_URL_DOMAIN, "<url>"), (_EMAIL, "<email>"), (_FILE, "<file>")):
            word = pattern.sub(token, word)
        out.append(" - ".join(word.split("-")))
    return " ".join(out)


class _Moses:
    """sacremoses objects, built once (the `fairseq` extra)."""
    normalizer = tokenizer = None

    @classmethod
    def get(cls):
        if cls.tokenizer is None:
            try:
                import sacremoses
            except ImportError:
                raise UserError("the fairseq tokenizer needs sacremoses, which is not installed", "tokenizer",
                                "pip install -e .[fairseq]") from None
            cls.normalizer = sacremoses.MosesPunctNormalizer(lang="en")
            cls.tokenizer = sacremoses.MosesTokenizer(lang="en")
        return cls.normalizer, cls.tokenizer


def moses_words(text: str) -> list[str]:
    """Steps 1-6: the lower-cased Moses tokens of one sentence, as the official GLUE preprocessing makes them."""
    normalizer, tokenizer = _Moses.get()
    line = remove_non_printing(normalizer.normalize(pre_cleanup(text)))
    line = replace_patterns(split_punctuation(line.strip().lower())).replace("\\", " ")
    return tokenizer.tokenize(line, escape=False, return_str=True).lower().split()


def _lines(text: str) -> list[str]:
    """The file's lines as fairseq and fastBPE cut them: at newlines only (a text-mode read has made "\r\n" and "\r"
    one), not at the other breaks `str.splitlines` knows (U+2028, U+0085, \x1c...), which a symbol may hold."""
    lines = text.split("\n")
    return lines[:-1] if lines[-1] == "" else lines


def read_codes(text: str, source: str = "bpe codes") -> dict[tuple[str, str], int]:
    """fastBPE codes ('a b count' per line; 'a b' accepted) -> {(a, b): rank}, rank = line number."""
    ranks: dict[tuple[str, str], int] = {}
    for n, line in enumerate(_lines(text), 1):
        parts = line.split(" ")          # fastBPE splits at spaces only: \x1c or U+2028 can be part of a symbol
        if len(parts) not in (2, 3):
            raise UserError(f"line {n} of the BPE codes is not 'left right count' ({line[:60]!r})", source,
                            "give the codes file released with the checkpoint (fastBPE learnbpe output)")
        ranks.setdefault((parts[0], parts[1]), len(ranks))
    return ranks


def apply_bpe(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """One word -> its BPE pieces, '@@' on every piece but the last (fastBPE's applybpe)."""
    symbols = list(word[:-1]) + [word[-1] + EOW]
    while len(symbols) > 1:
        best = min(zip(symbols, symbols[1:]), key=lambda pair: ranks.get(pair, len(ranks) + 1))
        if best not in ranks:
            break
        merged, i = [], 0
        while i < len(symbols):
            if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                merged.append(symbols[i] + symbols[i + 1])
                i += 2
            else:
                merged.append(symbols[i])
                i += 1
        symbols = merged
    return [s + "@@" for s in symbols[:-1]] + [symbols[-1][:-len(EOW)]]


def read_dictionary(text: str, source: str = "dict.txt") -> list[str]:
    """A fairseq dict.txt ('symbol count' per line) -> the full symbol list by id: specials, the file, <mask>."""
    symbols, seen = list(SPECIALS), {s: 0 for s in (*SPECIALS, MASK)}
    for n, line in enumerate(_lines(text), 1):
        cut = line.rfind(" ")
        if cut <= 0 or not line[cut + 1:].strip().lstrip("-").isdigit():
            raise UserError(f"line {n} of {source} is not '<symbol> <count>' ({line[:60]!r})", source,
                            "give the dict.txt released with the checkpoint")
        symbol = line[:cut]
        if symbol in seen:
            raise UserError(f"line {n} of {source} repeats the symbol {symbol!r}" + (
                f" of line {seen[symbol]}" if seen[symbol] else " (a special symbol fairseq adds itself)"), source,
                "give the dict.txt released with the checkpoint")
        seen[symbol] = n
        symbols.append(symbol)
    return symbols + [MASK]


class FairseqBpeTokenizer:
    """The official tokenizer with the interface of `tokenizer.Tokenizer` (ids, `encode`, `save`, `fingerprint`)."""

    pair_separators = 2        # <s> a </s> </s> b </s>
    lowercase, strip_accents, default_casing = True, False, False

    def __init__(self, vocab: Sequence[str], codes: str, source: str = "tokenizer"):
        self.vocab = list(vocab)
        self.index = {t: i for i, t in enumerate(self.vocab)}
        if len(self.index) != len(self.vocab):
            dup = next(t for i, t in enumerate(self.vocab) if self.index[t] != i)
            raise UserError(f"the dictionary has the symbol {dup!r} twice", source, "give the released dict.txt")
        if tuple(self.vocab[:len(SPECIALS)]) != SPECIALS or MASK not in self.index:
            raise UserError(f"the vocabulary does not start with {' '.join(SPECIALS)} or lacks {MASK}", source,
                            "import the checkpoint again with `launch import-fairseq`")
        self.codes = codes
        self.ranks = read_codes(codes, source)
        self.cls_id, self.pad_id, self.sep_id, self.unk_id = 0, 1, 2, 3
        self.mask_id = self.index[MASK]
        self.special_ids = tuple(sorted({0, 1, 2, 3, self.mask_id} |
                                        {i for i, t in enumerate(self.vocab) if t.startswith("madeupword")}))
        self.fingerprint = hashlib.sha256(("\n".join(self.vocab) + "\n\0" + codes).encode()).hexdigest()[:16]
        self._cache: dict[str, list[str]] = {}

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def pieces(self, text: str) -> list[str]:
        out: list[str] = []
        for word in moses_words(text):
            if word not in self._cache:
                if len(self._cache) > 200_000:
                    self._cache.clear()
                self._cache[word] = apply_bpe(word, self.ranks)
            out.extend(self._cache[word])
        return out

    def encode(self, text: str) -> list[int]:
        return [self.index.get(p, self.unk_id) for p in self.pieces(text)]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        skip = set(self.special_ids) if skip_special_tokens else set()
        text = " ".join(self.vocab[int(i)] for i in ids if int(i) not in skip)
        return text.replace("@@ ", "").removesuffix("@@")

    def id_to_token(self, i: int) -> str:
        return self.vocab[i]

    def casing_config(self) -> dict:
        return {"tokenizer_class": KIND, "do_lower_case": True}

    def save(self, directory) -> str:
        files.write_text(files.join(directory, CODES_NAME), self.codes)
        files.write_json(files.join(directory, "tokenizer_config.json"), self.casing_config())
        return files.write_text(files.join(directory, "vocab.txt"), "".join(t + "\n" for t in self.vocab))

    @classmethod
    def from_folder(cls, directory: str) -> "FairseqBpeTokenizer":
        vocab_path, codes_path = files.join(directory, "vocab.txt"), files.join(directory, CODES_NAME)
        for path in (vocab_path, codes_path):
            if not files.isfile(path):
                raise UserError(f"the fairseq tokenizer folder has no {path}", directory,
                                "import the checkpoint again with `launch import-fairseq`")
        lines = files.read_text(vocab_path).split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        return cls(lines, files.read_text(codes_path), source=directory)
