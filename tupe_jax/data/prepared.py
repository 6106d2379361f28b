"""Reading a directory made by `launch prepare` (`--config.data.name=prepared --config.data.path=DIR`).

`open_split(config, split)` checks the manifest against the run (objective, max_len, packing) and against its
shards (every shard present, its size and record count as the manifest says) before any compute, and returns a
`PreparedSplit`: example i of the split is record i - offset[k] of shard k. `rows(index, real, width)` reads the
records of exactly the given examples (one `ArrayRecordReader.read` per shard touched; padding rows read
nothing), so a process reads only the records of its own rows: its memory does not grow with the corpus (bar the
8 bytes per example of the epoch permutation, see `pipeline`). Readers are opened on first use.
`prepared_tokenizer` is the run's tokenizer: the directory's vocab.txt, copied into the run folder.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np

from tupe_jax import files
from tupe_jax.data.cache import cache_dir, file_lock
from tupe_jax.data.tokenizer import PAD_ID, Tokenizer, writes_tokenizer
from tupe_jax.errors import UserError, require

MANIFEST = "manifest.json"


def root_of(config) -> Path:
    path = str(config.data.get("path", ""))
    require(bool(path), "data.name=prepared needs data.path", "--config.data.path",
            "give the directory written by `python -m launch prepare`")
    require("://" not in path, f"{path} is a bucket path; a prepared directory is read from a local folder",
            "--config.data.path", "copy it to each host first (`gcloud storage cp -r`; docs/tpu.md, section 3)")
    return Path(path).expanduser()


SETTINGS = ("objective", "max_len", "packing", "tokenizer", "vocab_size", "dtype", "fingerprint")


def load_manifest(path: Path, fix: str) -> dict:
    """The manifest at `path`, with the fields a reader relies on; a UserError naming `path` and `fix` when it cannot
    be read or is not a manifest (damaged, or another file of that name)."""
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise UserError(f"cannot read {path} ({err.strerror})", str(path), "fix its permissions") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{path} is not valid JSON ({err})", str(path), fix) from None
    settings = manifest.get("settings") if isinstance(manifest, dict) else None
    missing = [k for k in SETTINGS if not isinstance(settings, dict) or k not in settings]
    require(not missing and isinstance(manifest.get("splits"), dict) and "tokenizer_file" in manifest,
            f"{path} is not a prepare manifest (no {', '.join(['settings.' + k for k in missing][:3]) or 'splits'})",
            str(path), fix)
    return manifest


def read_manifest(config) -> dict:
    """DIR/manifest.json (UserError when DIR is not a finished prepared directory)."""
    root = root_of(config)
    path = root / MANIFEST
    require(path.is_file(), f"{root} holds no {MANIFEST} (not a prepared directory, or its prepare did not finish)",
            "--config.data.path", "run (or rerun, it resumes) `python -m launch prepare` with that --workdir")
    return load_manifest(path, "rerun `launch prepare` into a fresh directory")


def check_settings(config, manifest: dict | None = None) -> dict:
    """The directory's settings against `config.model`/`config.data`; returns the manifest."""
    manifest = manifest or read_manifest(config)
    s = manifest["settings"]
    root = root_of(config)
    objective = config.model.get("objective", "mlm")
    want = {"model.objective": objective, "model.max_len": int(config.model.max_len)}
    if objective == "mlm":
        want["data.packing"] = config.data.get("packing", "full_sentences")
    for key, value in want.items():
        have = s[key.split(".")[1]]
        require(have == value, f"{root} was prepared with {key}={have!r} (this run: {value!r})",
                f"--config.{key}", f"use {key}={have!r}, or prepare another directory with {key}={value!r}")
    require(s["vocab_size"] <= int(config.model.vocab_size),
            f"{root} has a {s['vocab_size']}-token vocabulary but model.vocab_size is {config.model.vocab_size}",
            "--config.model.vocab_size", f"set --config.model.vocab_size={s['vocab_size']}")
    return manifest


def prepared_tokenizer(config, workdir) -> Tokenizer:
    """The run's saved vocab.txt (resume) or the directory's; either must be the one the records were made with."""
    manifest = read_manifest(config)
    root = root_of(config)
    saved = files.join(str(workdir), "tokenizer", "vocab.txt") if workdir else None   # the run's: local or bucket
    source = saved if saved is not None and files.isfile(saved) else root / manifest["tokenizer_file"]
    require(files.isfile(source), f"the tokenizer of the prepared directory {root} is missing", str(source),
            "restore it from a copy of the directory, or prepare the corpus again into a fresh directory")
    tok = Tokenizer.from_file(source)
    require(tok.fingerprint == manifest["settings"]["tokenizer"],
            f"{source} is not the tokenizer {root} was prepared with", "--config.data.path",
            "use the prepared directory this run started with, or a fresh workdir")
    if config.data.get("vocab_file", ""):
        given = Tokenizer.from_file(config.data.vocab_file)
        require(given.fingerprint == tok.fingerprint, f"data.vocab_file differs from the tokenizer of {root}",
                "--config.data.vocab_file", "leave data.vocab_file empty with data.name=prepared")
    if saved is not None and source != saved and writes_tokenizer():
        tok.save(files.join(str(workdir), "tokenizer"))
    return tok


class PreparedSplit:
    """The examples of one split of a prepared directory, read record by record."""

    def __init__(self, root: Path, split: str, manifest: dict):
        entry = manifest["splits"][split]
        self.root, self.split = root, split
        self.paths = [root / split / s["file"] for s in entry["shards"]]
        counts = np.asarray([s["examples"] for s in entry["shards"]], np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(counts)])
        self.n = int(self.offsets[-1])
        self.dtype = np.dtype(manifest["settings"]["dtype"])
        self.key = f"{manifest['settings']['fingerprint']}/{split}"
        self._readers: dict[int, object] = {}
        self._locks = [threading.Lock() for _ in self.paths]
        self._open_lock = threading.Lock()
        self.reads: list | None = None   # set to [] to record every example index read (tests)
        for path, shard in zip(self.paths, entry["shards"]):
            require(path.is_file(), f"shard {path.name} of {split} is missing", str(path),
                    "restore it, or rerun `launch prepare` on the directory (it rewrites what is missing)")
            try:
                with open(path, "rb"):
                    pass
            except OSError as err:    # the record reader would count 0 records: not a damaged shard
                raise UserError(f"cannot read shard {path.name} of {split} ({err.strerror})", str(path),
                                "fix its permissions") from None
            require(path.stat().st_size == shard["bytes"],
                    f"shard {path.name} has {path.stat().st_size} bytes but the manifest says {shard['bytes']}",
                    str(path), "rerun the `launch prepare` command that made the directory: it writes such a shard "
                    "again")
        for k, shard in enumerate(entry["shards"]):
            got = self._reader(k).num_records()
            require(got == shard["examples"], f"shard {self.paths[k].name} has {got} records but the manifest "
                    f"says {shard['examples']}", str(self.paths[k]), "prepare it again into a fresh directory")
        self.close()

    def _reader(self, k: int):
        with self._open_lock:
            if k not in self._readers:
                from array_record.python.array_record_module import ArrayRecordReader
                self._readers[k] = ArrayRecordReader(str(self.paths[k]), "readahead_buffer_size:0")
            return self._readers[k]

    def close(self) -> None:
        with self._open_lock:
            for r in self._readers.values():
                r.close()
            self._readers.clear()

    def rows(self, index: np.ndarray, real: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens int32, valid) of shape (B, width) for examples `index` where `real`; other rows are [PAD]."""
        out = np.full((len(index), width), PAD_ID, np.int32)
        valid = np.zeros((len(index), width), bool)
        rows = np.nonzero(real)[0]
        shard = np.searchsorted(self.offsets, index[rows], side="right") - 1
        for k in np.unique(shard).tolist():
            mine = rows[shard == k]
            local = (index[mine] - self.offsets[k]).tolist()
            with self._locks[k]:
                records = self._reader(k).read(local)
            if self.reads is not None:
                self.reads.extend(int(i) for i in index[mine])
            for r, rec in zip(mine.tolist(), records):
                toks = np.frombuffer(rec, self.dtype)[:width]
                out[r, :len(toks)] = toks
                valid[r, :len(toks)] = True
        return out, valid


def token_stream(config, split: str) -> np.ndarray:
    """The split's flat token stream ([SEP] after every document), read back from its records and cached in the
    data cache (`<cache>/streams/prepared/`, int32, memory-mapped): the analyses' windows cut across examples. The
    records tile the stream each shard packed: MLM blocks back to back; a CLM window's last token is the next
    window's first, so every window but a shard's last gives its first max_len tokens."""
    part = open_split(config, split)
    path = cache_dir(config) / "streams" / "prepared" / f"{part.key.replace('/', '.')}.tokens.int32"
    if not path.is_file():
        with file_lock(path.with_name(path.name + ".lock")):
            if not path.is_file():
                _write_stream(part, int(config.model.max_len) if config.model.get("objective") == "clm" else 0,
                              path)
    return np.memmap(path, np.int32, mode="r") if path.stat().st_size else np.zeros(0, np.int32)


def _write_stream(part: PreparedSplit, window: int, path: Path, chunk: int = 65536) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as out:
        for k in range(len(part.paths)):
            count = int(part.offsets[k + 1] - part.offsets[k])
            for first in range(0, count, chunk):
                local = list(range(first, min(first + chunk, count)))
                with part._locks[k]:  # pylint: disable=protected-access
                    records = part._reader(k).read(local)  # pylint: disable=protected-access
                for i, rec in zip(local, records):
                    toks = np.frombuffer(rec, part.dtype)
                    out.write((toks[:window] if window and i < count - 1 else toks).astype(np.int32).tobytes())
    part.close()
    os.replace(tmp, path)


def open_split(config, split: str) -> PreparedSplit:
    manifest = check_settings(config)
    require(split in manifest["splits"], f"split {split!r} is not in the prepared directory {root_of(config)} "
            f"(have {sorted(manifest['splits'])})", "--config.data.path",
            f"prepare it with --config.prepare.splits including {split}")
    return PreparedSplit(root_of(config), split, manifest)
