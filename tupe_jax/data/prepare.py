"""`python -m launch prepare`: tokenize a corpus once, in parallel, into sharded ArrayRecord files + a manifest.

    python -m launch prepare --config=configs/prepare.py:objective=mlm --workdir=DIR \
        --config.data.name=wikitext --config.data.path=../shared/data/wikitext-2 --config.model.max_len=128

DIR (the `--workdir`) then holds
    config.json                          the prepare config (the launcher's gate refuses another one here)
    tokenizer/vocab.txt                  the vocabulary (learned once here, or `data.vocab_file`: a WordPiece
                                         vocab.txt, or an import-fairseq run's tokenizer/vocab.txt, whose
                                         fairseq BPE codes are copied beside it)
    <split>/shard-00000.array_record     one record per packed example, raw little-endian uint16/int32 ids
    <split>/shard-00000.json             the shard's sidecar, written after its records (= "this shard is done")
    manifest.json                        written last: settings, tokenizer fingerprint, per-shard counts and sizes

Shards: the documents of a split, in source order, cut every `prepare.shard_mb` MB of text; shard k is
tokenized and packed by one of `data.num_threads` worker processes (0 = all cores), exactly as the pipeline packs
a token stream (`pipeline.example_windows`: MLM FULL-SENTENCES / contiguous blocks of <= max_len-1 tokens without
[CLS], CLM windows of max_len+1 every max_len), restarting at each shard boundary. Records hold no [CLS] and no
masks: masking happens at read time, keyed by (seed, example, epoch) as for every other corpus.

Resumable: a killed prepare (kill -9, power loss) reruns with the same command and writes only the shards
without a sidecar. Refusals (one line, before anything is written): another config (the gate), a different
tokenizer, a changed source or other settings recorded in the sidecars, an empty corpus or split. Neither Ctrl-C
nor kill -9 removes finished shards (the launcher cleans up after errors only).
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import ml_collections
import numpy as np

from tupe_jax import files
from tupe_jax.config import require_finite, require_one_of, require_positive
from tupe_jax.data import builders, pipeline, pool, sources, stamps
from tupe_jax.data.prepared import MANIFEST, load_manifest
from tupe_jax.data.tokenizer import Tokenizer, check_learned_vocab_size
from tupe_jax.errors import UserError, require

FORMAT = 1


def validate(config: ml_collections.ConfigDict, num_devices: int = 1) -> None:
    """The prepare command's validator: every key checked before anything is read or written."""
    del num_devices
    require_one_of(config.model.objective, ("mlm", "clm"), "model.objective")
    require(config.model.max_len >= 8, f"model.max_len = {config.model.max_len} is too small",
            "--config.model.max_len", "use at least 8")
    require_finite(config)
    require_positive(config, ("model.vocab_size", "prepare.shard_mb"))
    require_positive(config, ("data.num_threads",), allow_zero=True)
    sources.check_source(config.data)
    require_one_of(config.data.packing, ("full_sentences", "contiguous"), "data.packing")
    if not config.data.vocab_file:
        check_learned_vocab_size(config.model.vocab_size)
        sources.check_train_files(config.data, "add one, or give --config.data.vocab_file to prepare the others")
    asked = [s.strip() for s in config.prepare.splits.split(",") if s.strip()]
    require(len(set(asked)) == len(asked), f"prepare.splits = {config.prepare.splits!r} names a split twice",
            "--config.prepare.splits", "give each split once")
    require(not config.data.name == "prepared", "data.name=prepared is a prepared directory already",
            "--config.data.name", "give the raw corpus: embedded, text_files, wikitext or tfds:<name>")


def refuse_unread_keys(config: ml_collections.ConfigDict, arg_keys: frozenset, override_keys: frozenset,
                       workdir: str = "") -> list:
    """The launcher's hook: a key prepare does not read, given on the command line, is refused rather than written
    into config.json beside a manifest that says otherwise: masking (pretraining masks as it reads) and, for a causal
    LM, packing (its examples are contiguous windows)."""
    del arg_keys, workdir
    unread = {"data.mask_prob": "pretraining masks as it reads", "data.max_predictions": "pretraining masks as it reads",
              **({"data.packing": "a causal LM's examples are contiguous windows"}
                 if config.model.objective == "clm" else {})}
    for key in sorted(override_keys & set(unread)):
        raise UserError(f"prepare does not read {key} ({unread[key]})", f"--config.{key}", "drop it")
    return []


# ------------------------------------------------------------------------------------------ documents

def _local_files(config):
    return sources.assign_files(sources.find_files(config.data.path, config.data.file_pattern))


def splits_of(config) -> list[str]:
    """The splits to prepare: `prepare.splits`, or every split the corpus has ('' ; tfds: train)."""
    asked = [s.strip() for s in config.prepare.splits.split(",") if s.strip()]
    name = config.data.name
    if name.startswith("tfds:"):
        return asked or ["train"]
    if name == "embedded":
        have = list(sources.SPLITS)
    else:
        by_split, named = _local_files(config)
        have = sources.available_splits(by_split, named, int(config.data.holdout))
    for s in asked:
        require(s in have, f"split {s!r} is not in the corpus (have {have})", "--config.prepare.splits",
                f"use some of {','.join(have)}")
    return asked or have


def documents(config, split: str) -> Iterator[str]:
    """The split's documents in source order, read from the source itself (no intermediate copy)."""
    name = config.data.name
    if name == "embedded":
        return sources.embedded_documents(split)
    if name.startswith("tfds:"):
        return builders.iter_documents(config, split)
    require(name in ("text_files", "wikitext"), f"unknown data.name {name!r}", "--config.data.name",
            "use embedded, text_files, wikitext or tfds:<name>")
    by_split, named = _local_files(config)
    return sources.corpus_documents(by_split, named, split, config.data.split_by, int(config.data.holdout),
                                    wikitext=name == "wikitext")


def source_stamp(config, legacy: bool = False) -> list:
    """What the documents depend on: corpus name and options, and each input file's path under data.path, size and
    sha256 (`stamps.file_stamps`: the same files with other times, copied back to a fresh VM, say, are the
    same corpus, so an interrupted prepare resumes on them; an edited file is another corpus). `legacy`: the stamp
    of folders prepared before that (absolute path, size and mtime), recognised so that they still resume."""
    d = config.data
    stamp = [d.name, d.path, d.file_pattern, d.split_by, int(d.holdout), d.tfds_text_key, d.tfds_data_dir]
    if d.name in ("text_files", "wikitext"):
        by_split, _ = _local_files(config)
        if legacy:
            stamp.append([[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns]
                          for s in sorted(by_split) for f in by_split[s]])
        else:
            listed = [f for s in sorted(by_split) for f in by_split[s]]
            stamp.append(stamps.file_stamps(listed, os.path.expanduser(d.path), lines=True))
    elif d.name == "embedded":
        stamp.append(list(sys.version_info[:2]))
    return stamp


def _nonempty(docs: Iterator[str], config, split: str) -> Iterator[str]:
    """`docs`, after checking there is a non-blank one (an empty split is refused before anything is written)."""
    docs = iter(docs)
    first = next((doc for doc in docs if doc.strip()), None)
    require(first is not None, f"the {split} split of data.name={config.data.name} has no text",
            config.data.path or "--config.data.name", "check data.path / data.file_pattern / data.holdout")
    yield first
    yield from docs


# ------------------------------------------------------------------------------------------- workers

_WORKER: dict = {}


def _init_worker(tokenizer_file: str, fingerprint: str, settings: dict) -> None:
    """A worker's tokenizer is the one saved in DIR/tokenizer, of whatever kind (WordPiece, or the fairseq BPE of an
    import-fairseq run: `Tokenizer.from_file` reads the folder's kind), checked against the parent's fingerprint."""
    pool.orphan_guard()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")   # one core per worker process
    _WORKER.clear()
    try:
        tok = Tokenizer.from_file(tokenizer_file)
        if tok.fingerprint != fingerprint:
            raise ValueError(f"its fingerprint is {tok.fingerprint}, not the {fingerprint} prepare started with")
    except Exception as err:  # pylint: disable=broad-exception-caught
        # an initializer that raises makes multiprocessing.Pool start another worker, forever: the first shard
        # given to this worker raises instead, and the parent stops with it
        _WORKER["error"] = f"a prepare worker could not load {tokenizer_file}: {type(err).__name__}: {err}"
        return
    _WORKER.update(tok=tok, settings=settings)


def pack(docs: list[str], tok: Tokenizer, settings: dict) -> tuple[list[np.ndarray], int]:
    """Documents -> the examples (token arrays, [CLS] not included) and their token count."""
    parts = list(pipeline._encode_documents(docs, tok))   # pylint: disable=protected-access
    if not parts:
        return [], 0
    stream = np.concatenate([p[0] for p in parts])
    ends = np.cumsum(np.concatenate([p[1] for p in parts]))
    view = SimpleNamespace(data={"packing": settings["packing"]})
    starts, stops = pipeline.example_windows(view, len(stream), ends, settings["objective"], settings["max_len"])
    dtype = np.dtype(settings["dtype"])
    return [stream[a:b].astype(dtype) for a, b in zip(starts.tolist(), stops.tolist()) if b > a], len(stream)


def _write_shard(task: tuple[str, int, list[str]]) -> dict:
    """Tokenize + pack one shard, write its records (temporary name, then rename), then its sidecar."""
    from array_record.python.array_record_module import ArrayRecordWriter
    folder, k, docs = task
    if "error" in _WORKER:
        raise RuntimeError(_WORKER["error"])
    settings = _WORKER["settings"]
    examples, tokens = pack(docs, _WORKER["tok"], settings)
    path = Path(folder) / f"shard-{k:05d}.array_record"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    writer = ArrayRecordWriter(str(tmp), "group_size:1")
    for ex in examples:
        writer.write(ex.tobytes())
    writer.close()
    os.replace(tmp, path)
    side = {"file": path.name, "examples": len(examples), "tokens": tokens, "documents": len(docs),
            "bytes": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "settings": settings["fingerprint"]}
    files.write_json(path.with_suffix(".json"), side)
    return side


# ------------------------------------------------------------------------------------------- command

def workers(config) -> int:
    return int(config.data.num_threads) or os.cpu_count() or 1


LEARNED_FROM = "learned_from.json"   # beside a learned tokenizer/vocab.txt: the source stamp of its text


def _tokenizer(config, out: Path) -> Tokenizer:
    """DIR/tokenizer/vocab.txt on a resume; else `data.vocab_file`, else learned on the train split."""
    saved = out / "tokenizer" / "vocab.txt"
    given = Tokenizer.from_file(config.data.vocab_file) if config.data.vocab_file else None
    learned_from = saved.parent / LEARNED_FROM
    if saved.is_file():
        tok = Tokenizer.from_file(saved)
        require(given is None or given.fingerprint == tok.fingerprint,
                f"{out} was prepared with another tokenizer ({tok.fingerprint}; data.vocab_file is "
                f"{given.fingerprint if given else ''})", "--workdir", "use a fresh directory for another tokenizer")
        require(given is not None or not learned_from.is_file()       # (folders from before the record: not checked)
                or files.read_json(learned_from) == json.loads(files.to_json(source_stamp(config))),
                f"{saved} was learned on other text than data.path holds now (data.path as given, or its files, "
                "changed since that prepare began)", "--config.data.path", "give data.path and its files as then, "
                "or prepare into a fresh directory")
        return tok
    if given is not None:
        tok = given
    else:
        print(f"prepare: learning a {config.model.vocab_size}-token WordPiece vocabulary on the train split",
              flush=True)
        tok = pool.learn(_nonempty(documents(config, "train"), config, "train"), int(config.model.vocab_size),
                         workers(config), max(1, int(config.prepare.shard_mb * 1e6) // 8))
    require(tok.vocab_size <= int(config.model.vocab_size),
            f"the tokenizer has {tok.vocab_size} tokens but model.vocab_size is {config.model.vocab_size}",
            config.data.vocab_file or "--config.model.vocab_size", f"set --config.model.vocab_size={tok.vocab_size}")
    if given is None:   # before vocab.txt: a learned vocabulary on disk always says what it was learned on
        files.write_json(learned_from, source_stamp(config))
    tok.save(saved.parent)
    return tok


def settings_of(config, tok: Tokenizer, legacy: bool = False) -> dict:
    """What every record depends on; its fingerprint is stored in each sidecar and in the manifest. `legacy`: with
    the source stamp of folders prepared before content stamps (`source_stamp`)."""
    s = {"format": FORMAT, "objective": config.model.objective, "max_len": int(config.model.max_len),
         "packing": config.data.packing if config.model.objective == "mlm" else "contiguous",
         "tokenizer": tok.fingerprint, "vocab_size": tok.vocab_size,
         "dtype": "<u2" if tok.vocab_size <= 65535 else "<i4", "shard_mb": float(config.prepare.shard_mb),
         "source": source_stamp(config, legacy)}
    s["fingerprint"] = builders.digest(s)
    return s


def _done(folder: Path, k: int, accepted: tuple[str, ...]) -> dict | None:
    """The sidecar of shard k when it and its records are complete; refuses one from other settings (a fingerprint
    not in `accepted`: these settings', and the same settings' under the legacy source stamp)."""
    side_path = folder / f"shard-{k:05d}.json"
    if not side_path.is_file():
        return None
    try:
        side = json.loads(side_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):   # a damaged sidecar: the shard is written again
        print(f"prepare: {side_path} is damaged; writing that shard again", flush=True)
        return None
    require(isinstance(side, dict) and side.get("settings") in accepted,
            f"{side_path} was written with other settings (tokenizer, length, packing or source changed)",
            "--workdir", "use a fresh directory, or restore the settings and source it was prepared with")
    rec = folder / str(side.get("file"))
    return side if rec.is_file() and rec.stat().st_size == side.get("bytes") else None


def prepare_split(config, out: Path, split: str, tok: Tokenizer, settings: dict, num_workers: int,
                  accepted: tuple[str, ...] = ()) -> dict:
    accepted = accepted or (settings["fingerprint"],)
    folder = out / split
    folder.mkdir(parents=True, exist_ok=True)
    for side in sorted(folder.glob("shard-*.json")):   # refuse other settings before any work starts
        _done(folder, int(side.stem.split("-")[1]), accepted)
    for tmp in folder.glob(".shard-*.tmp"):             # half-written records of a killed prepare
        tmp.unlink()
    groups = pool.groups(_nonempty(documents(config, split), config, split), int(config.prepare.shard_mb * 1e6))
    sides: dict[int, dict] = {}

    def todo():
        for k, docs in enumerate(groups):
            done = _done(folder, k, accepted)
            if done is not None:
                sides[k] = done
            yield k, None if done is not None else (str(folder), k, docs)

    tokenizer_file = str(out / "tokenizer" / "vocab.txt")      # saved by `_tokenizer` before any split
    with pool.spawn_pool(num_workers, _init_worker, (tokenizer_file, tok.fingerprint, settings)) as workers_:
        for k, side in pool.bounded(workers_, _write_shard, todo(), num_workers):
            sides[k] = side
    ordered = [sides[k] for k in sorted(sides)]
    return {"shards": [{key: s[key] for key in ("file", "examples", "tokens", "bytes", "sha256")} for s in ordered],
            "examples": sum(s["examples"] for s in ordered), "tokens": sum(s["tokens"] for s in ordered),
            "documents": sum(s["documents"] for s in ordered)}


def prepare(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Prepare `config.data`'s corpus into `workdir` (see the module docstring); returns the manifest."""
    validate(config)
    require(not files.is_remote(workdir), f"{workdir} is a bucket path; prepare writes a local folder", "--workdir",
            "prepare into a local folder, then copy it (`gcloud storage cp -r`; docs/tpu.md, section 3)")
    out = Path(workdir)
    sources.refuse_inside_corpus(config, str(out), "--workdir", "prepare into")
    splits = splits_of(config)
    for split in splits:   # an empty split is refused before anything is written
        next(_nonempty(documents(config, split), config, split))
    t0 = time.perf_counter()
    tok = _tokenizer(config, out)
    settings = settings_of(config, tok)
    accepted = (settings["fingerprint"], settings_of(config, tok, legacy=True)["fingerprint"])
    old = out / MANIFEST
    if old.is_file():
        manifest = load_manifest(old, f"delete {old} and rerun: the finished shards are kept")
        require(manifest["settings"]["fingerprint"] in accepted,
                f"{old} was written with other settings", "--workdir", "use a fresh directory")
        missing = [f"{split}/{shard['file']}" for split in splits for shard in manifest["splits"].get(split, {})
                   .get("shards", []) if not (out / split / shard["file"]).is_file()
                   or (out / split / shard["file"]).stat().st_size != shard["bytes"]]
        if set(splits) <= set(manifest["splits"]) and not missing:
            print(f"prepare: {out} is complete ({', '.join(manifest['splits'])})", flush=True)
            return manifest
        if missing:
            print(f"prepare: {out}: {len(missing)} shards missing or changed ({', '.join(missing[:3])}); "
                  "writing them again", flush=True)
    result = {}
    for split in splits:
        with pool.sigterm_interrupts():   # finished shards are kept: a rerun writes the rest
            result[split] = prepare_split(config, out, split, tok, settings, workers(config), accepted)
        print(f"prepare: {split}: {result[split]['examples']} examples, {result[split]['tokens']} tokens in "
              f"{len(result[split]['shards'])} shards", flush=True)
    manifest = {"format": FORMAT, "settings": settings, "splits": result, "tokenizer_file": "tokenizer/vocab.txt"}
    files.write_json(str(old), manifest)        # what the data is, byte-identical on every rerun (no timing in it)
    print(f"prepare: done in {time.perf_counter() - t0:.1f} s with {workers(config)} workers", flush=True)
    return manifest


__all__ = ["prepare", "validate", "pack", "settings_of", "documents", "MANIFEST"]
