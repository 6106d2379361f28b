"""Raw text sources: plain-text corpora, WikiText, the embedded corpus and the built-in word-order task.

Everything here is pure Python over local files; the TFDS builders in `builders.py` call it. A *document* is a
string whose lines are the packing units ("sentences") used by FULL-SENTENCES packing; a document never
contains an empty line.

File → split rule (text_files / wikitext): a file's name is cut at `.`, `_`, `-`; a part `train` puts it in
train, `valid`/`validation`/`dev` in validation, `test` in test (`wiki.train.tokens`, `valid.txt`, ...). If no
file is named like that, every file is training text and, with `holdout=h > 0`, document number `i` (0-based,
files in sorted order) goes to validation when `i % h == h - 1` (TUPE's 1-in-200 split); there is no test split.
Named files without a train file (a lone valid.txt) can be scored; pretraining refuses them (`check_train_files`).
"""
from __future__ import annotations

import glob as globlib
import os
import re
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from tupe_jax.data.cache import cache_path
from tupe_jax.errors import UserError, require

TEXT_SUFFIXES = (".txt", ".tokens", ".raw", ".text")
SPLITS = ("train", "validation", "test")
_SPLIT_WORDS = {"train": "train", "valid": "validation", "validation": "validation", "dev": "validation",
                "test": "test"}
EMBEDDED_HOLDOUT = 20  # the embedded corpus is small: paragraph i%20==19 → validation, i%20==9 → test


# ----------------------------------------------------------------------------------------------- files

PATH_NAMES = ("text_files", "wikitext", "prepared")   # the corpora read from data.path
# Line breaks to `str.splitlines` that `read_lines` keeps inside a line (earlier versions cut lines at them), as
# UTF-8 bytes: a file holding one is stamped so (`stamps.file_stamps`), and gets a new cache key.
OTHER_BREAKS = (b"\x0b", b"\x0c", b"\x1c", b"\x1d", b"\x1e", b"\xc2\x85", b"\xe2\x80\xa8", b"\xe2\x80\xa9")


def check_source(data: Any) -> None:
    """The keys that choose the documents (pretraining and `prepare`): a data.path that the corpus would not read
    (data.name left at 'embedded', say) and a negative holdout are refused rather than ignored."""
    name, path = str(data.get("name", "")), str(data.get("path", ""))
    require(not path or name in PATH_NAMES, f"data.path={path!r} is set but data.name={name!r} does not read it",
            "--config.data.name", "set --config.data.name=text_files (or wikitext, prepared) to read data.path, or "
            "leave data.path empty")
    require(int(data.get("holdout", 0)) >= 0, f"data.holdout = {data.holdout} is negative", "--config.data.holdout",
            "use 0 (no validation split) or e.g. 200 (1 document in 200)")
    pattern = str(data.get("file_pattern", "") or "")
    named = "a glob" if any(c in path for c in "*?[") else "a file" if os.path.isfile(os.path.expanduser(path)) else ""
    require(not pattern or not named, f"data.file_pattern={pattern!r} is set but data.path {path!r} is {named}: the "
            "pattern applies inside a data.path folder only", "--config.data.file_pattern",
            "drop data.file_pattern, or point data.path at the folder the pattern applies in")


def check_train_files(data: Any, fix: str = "add a train file or point data.path at the training text") -> None:
    """Pretraining and `prepare` learn from the train split: a local text_files/wikitext corpus whose files are
    named by split but none 'train' is refused before any compute (`evaluate` and the analyses may score one)."""
    name, path = str(data.get("name", "")), str(data.get("path", ""))
    if name not in ("text_files", "wikitext") or not path or "://" in path:
        return                            # a bucket folder is listed once mirrored: `builders` names a missing split
    by_split, named = assign_files(find_files(path, str(data.get("file_pattern", "") or "")))
    require(not named or "train" in by_split, f"data.path {path} has no training file (a name containing 'train'; "
            f"its files are for {' and '.join(sorted(by_split))})", "--config.data.path", fix)


def refuse_inside_corpus(config: Any, folder: str, flag: str, verb: str) -> None:
    """`folder` (a run's or a prepared one, and the data cache) where a recursive data.path (`**`) finds files: what
    is written there (tokenizer/vocab.txt, checkpoint markers, a learned vocabulary) would be read as corpus text,
    from the next read on (a folder, a plain glob or a file never reads below itself)."""
    data = config.data
    path, pattern = str(data.get("path", "") or ""), str(data.get("file_pattern", "") or "")
    if str(data.get("name", "")) not in ("text_files", "wikitext") or "**" not in path + pattern or "://" in path:
        return
    prefix = re.split(r"[*?\[]", path, maxsplit=1)[0]      # a wildcard inside a name: its folder is the base
    base = os.path.realpath(os.path.expanduser(prefix if prefix == path or prefix.endswith("/")
                                               else os.path.dirname(prefix)) or ".")
    for where, here, fix in ((flag, folder, f"{verb} a folder outside the corpus folder"),
                             ("--config.data.cache_dir", str(cache_path(config)), "give a data cache outside it")):
        inside = "://" not in here and (os.path.realpath(os.path.expanduser(here)) + os.sep).startswith(
            base.rstrip(os.sep) + os.sep)
        require(not inside, f"{here} is inside the folder data.path {path} reads recursively: what is written there "
                "would be read as corpus text", where, fix)


def find_files(path: str, pattern: str = "") -> list[Path]:
    """The files named by `path` (a file, a directory or a glob), sorted."""
    if not path:
        raise UserError("data.path is empty", "config.data.path",
                        "set --config.data.path=DIR, a glob or a file")
    if any(c in path for c in "*?["):
        files = [Path(p) for p in globlib.glob(os.path.expanduser(path), recursive=True)]
    else:
        p = Path(os.path.expanduser(path))
        if p.is_file():
            files = [p]
        elif p.is_dir():
            try:
                files = list(p.glob(pattern)) if pattern else [f for f in p.iterdir()
                                                               if f.suffix.lower() in TEXT_SUFFIXES]
            except OSError as err:
                raise unreadable(p, err) from None
        else:
            raise UserError(f"no such file or directory {path!r}", "config.data.path",
                            "point data.path at an existing directory, file or glob")
    broken = sorted(str(f) for f in files if f.is_symlink() and not f.exists())
    if broken:           # a link to nothing (or a loop) is no text; say so rather than read less
        print(f"warning: data.path: {len(broken)} broken link(s) skipped: {', '.join(broken[:3])}", flush=True)
    files = sorted(Path(os.path.abspath(f)) for f in files if f.is_file())   # a link keeps its name (its split)
    seen: dict[Path, Path] = {}
    for f in files:    # a link to a file also found, or a folder loop a `**` glob walks round and round
        first = seen.setdefault(f.resolve(), f)
        require(first == f, f"data.path names one file twice: {first} and {f} are the same file (a link)",
                "--config.data.path", "remove the link, or narrow data.path so each file is found once")
    if not files:
        raise UserError(f"no text files found under {path!r}", "config.data.path",
                        f"put *.txt files there or set data.file_pattern (suffixes tried: {TEXT_SUFFIXES})")
    return files


def split_of_file(f: Path) -> str | None:
    for part in re.split(r"[._\-]", f.name.lower()):
        if part in _SPLIT_WORDS:
            return _SPLIT_WORDS[part]
    return None


def assign_files(files: list[Path]) -> tuple[dict[str, list[Path]], bool]:
    """Map split → files. Returns (mapping, named): named=False means 'all train, use the holdout'."""
    named = {f: split_of_file(f) for f in files}
    if all(s is None for s in named.values()):
        return {"train": list(files)}, False
    stray = [f for f, s in named.items() if s is None]
    if stray:
        raise UserError(f"file {stray[0].name!r} is not named train/valid/test while others are", str(stray[0]),
                        "rename it, remove it, or narrow data.path / data.file_pattern")
    out: dict[str, list[Path]] = {}
    for f, s in named.items():    # no train file is fine where only other splits are read (scoring held-out text)
        out.setdefault(s, []).append(f)
    return out, True


def unreadable(path: Path, err: OSError) -> UserError:
    """The one-line error for a corpus file or folder that cannot be read (permissions, an I/O error)."""
    return UserError(f"cannot read {path} ({err.strerror or type(err).__name__})", "--config.data.path",
                     "fix its permissions, or point data.path elsewhere")


def read_lines(path: Path) -> list[str]:
    """UTF-8 lines (without newline); undecodable bytes are an error naming the file and line.

    Lines end at a newline (`\n`, `\r\n` or a lone `\r`), as Python's text reader (fairseq's) cuts them; BERT's
    reader cuts at `\n` alone and strips what is left. The corpus formats (a sentence per line, a blank line between
    documents) are defined by newlines. `str.splitlines` would also cut at `\v`, `\f`, `\x1c`-`\x1e`, U+0085,
    U+2028 and U+2029 (`OTHER_BREAKS`), which text from the web can hold: a sentence cut in two, and such a break at the
    end of a line read as a blank line after it (a document's end)."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise unreadable(path, err) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise UserError(f"file is not valid UTF-8 ({e.reason} at byte {e.start})", f"{path}:{line}",
                        "re-encode the file as UTF-8") from None
    if text.startswith("\ufeff"):
        text = text[1:]
    if "\r" in text:                   # (no copies of a large file's text where it has none)
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    lines = text.split("\n")
    if lines[-1] == "":                # the newline that ends the last line starts no line
        lines.pop()
    return lines


# ------------------------------------------------------------------------------------------- documents

def blank_line_documents(lines: list[str]) -> Iterator[str]:
    """BERT's pretraining format: one sentence per line, documents separated by blank lines."""
    block: list[str] = []
    for line in lines + [""]:
        line = line.strip()
        if line:
            block.append(line)
        elif block:
            yield "\n".join(block)
            block = []


def file_document(lines: list[str]) -> Iterator[str]:
    kept = [ln.strip() for ln in lines if ln.strip()]
    if kept:
        yield "\n".join(kept)


_WIKI_HEADING = re.compile(r"^(=(?: =)*) ([^=].*?) (=(?: =)*)$")
_WIKI_AT = re.compile(r" @([-,.])@ ")
_WIKI_SENT = re.compile(r"(?<= [.!?]) (?=[A-Z\"'(])")  # WikiText is tokenised: sentences end in " . "


def wikitext_line(line: str) -> str:
    """Undo WikiText's tokenisation marks: ` @-@ ` → `-` (also , .), `<unk>` → the [UNK] token."""
    return _WIKI_AT.sub(r"\1", line).replace("<unk>", "[UNK]")


def wikitext_documents(lines: list[str]) -> Iterator[str]:
    """Articles: a line ` = Title = ` starts one; headings ` = = Sub = = ` become plain lines; paragraphs are
    split into sentences (one per line) at ` . `/` ! `/` ? ` followed by a capital or an opening quote."""
    article: list[str] = []
    for raw in lines:
        line = raw.strip()
        if not line:
            continue
        h = _WIKI_HEADING.match(line)
        h = h if h and h.group(1) == h.group(3) else None
        if h and h.group(1) == "=" and article:
            yield "\n".join(article)
            article = []
        if h:
            article.append(wikitext_line(h.group(2).strip()))
        else:  # a paragraph: one line per sentence (the packing unit)
            article.extend(wikitext_line(s) for s in _WIKI_SENT.split(line))
    if article:
        yield "\n".join(article)


def corpus_documents(files_by_split: dict[str, list[Path]], named: bool, split: str, split_by: str,
                     holdout: int, wikitext: bool = False) -> Iterator[str]:
    """Documents of one split (see the module docstring for the file → split rule)."""
    if split_by not in ("blank_line", "file"):
        raise UserError(f"unknown data.split_by {split_by!r}", "config.data.split_by",
                        "use 'blank_line' or 'file'")
    source = "train" if not named else split
    files = files_by_split.get(source, [])
    for_holdout = not named and split in ("train", "validation")
    i = 0
    for f in files:
        lines = read_lines(f)
        if wikitext:
            docs = wikitext_documents(lines)
        elif split_by == "file":
            docs = file_document(lines)
        else:
            docs = blank_line_documents(lines)
        for doc in docs:
            if for_holdout and holdout > 0:
                held = i % holdout == holdout - 1
                if held == (split == "validation"):
                    yield doc
            else:
                yield doc
            i += 1


def available_splits(files_by_split: dict[str, list[Path]], named: bool, holdout: int) -> list[str]:
    if named:
        return [s for s in SPLITS if s in files_by_split]
    return ["train", "validation"] if holdout > 0 else ["train"]


# -------------------------------------------------------------------------------------- embedded corpus

def _reflow(paragraph: str) -> str:
    return " ".join(w for w in paragraph.split())


def embedded_topics() -> list[tuple[str, str]]:
    """(name, text) of the documentation topics CPython ships in `pydoc_data.topics`, sorted by name."""
    from pydoc_data.topics import topics  # part of the standard library; no download
    return sorted(topics.items())


def embedded_documents(split: str) -> Iterator[str]:
    """One document per paragraph of the pydoc topics (reflowed to one line), paragraphs numbered in topic
    order; paragraph i goes to validation if i % 20 == 19, to test if i % 20 == 9, else to train."""
    h = EMBEDDED_HOLDOUT
    i = 0
    for _, text in embedded_topics():
        for para in re.split(r"\n\s*\n", text):
            para = _reflow(para)
            if not para:
                continue
            where = "validation" if i % h == h - 1 else "test" if i % h == h // 2 - 1 else "train"
            i += 1
            if where == split:
                yield para


_SENT_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


def _is_prose(sentence: str) -> bool:
    words = sentence.split()
    if not 8 <= len(words) <= 40 or ">>>" in sentence or "::" in sentence:
        return False
    letters = sum(c.isalpha() or c in " ,.;'-" for c in sentence)
    return letters >= 0.9 * len(sentence)


def local_shuffle(words: list[str], rng: np.random.Generator, window: int = 3) -> list[str]:
    """Permute the words inside every consecutive window of `window` words (never the identity when the window
    has two distinct words), so the bag of words is kept but most neighbours change; always differs from the
    input when any window holds two distinct words."""
    out: list[str] = []
    for start in range(0, len(words), window):
        chunk = words[start:start + window]
        shuffled = list(chunk)
        if len(set(chunk)) > 1:
            while shuffled == chunk:
                shuffled = [chunk[i] for i in rng.permutation(len(chunk))]
        out.extend(shuffled)
    return out


def wordorder_examples(split: str) -> Iterator[dict]:
    """The built-in GLUE-style task: is this sentence in its original word order (1) or locally shuffled (0)?

    Every prose sentence (8–40 words) of the embedded corpus split of the same name appears twice: once as it
    is (label 1) and once with the words of every 3-word window permuted (label 0). The two classes hold exactly
    the same words, so only word order separates them (a bidirectional model without positions is at chance).
    Validation/test sentences were never seen in pretraining: the pydoc topics repeat some sentences word for
    word, so a held-out sentence that occurs anywhere in the train split's text is dropped, as is a repeat within
    the split. The shuffle is a fixed function of the sentence number; examples come in a fixed order (training
    shuffles them). Like GLUE, the test split has label -1.
    """
    seen_in_train = "\n".join(embedded_documents("train")) if split != "train" else ""
    held_out: set[str] = set()
    k = 0
    for doc in embedded_documents(split):
        for para in doc.split("\n"):
            for sentence in _SENT_END.split(para):
                words = sentence.split()
                if not _is_prose(sentence) or len(set(words)) < 2:
                    continue
                if split != "train":
                    if sentence in held_out or sentence in seen_in_train:
                        continue
                    held_out.add(sentence)
                rng = np.random.default_rng([0x30D0, k])
                shuffled = " ".join(local_shuffle(words, rng))
                for label, text in ((1, sentence), (0, shuffled)):
                    yield {"idx": k, "sentence1": text, "sentence2": "", "label": -1 if split == "test" else label}
                    k += 1