"""TFDS builders (array_record, no TensorFlow) and the readers the rest of the data layer uses.

Every local source (`embedded`, `text_files`, `wikitext`, GLUE TSVs, the built-in `wordorder` task) becomes a
`tfds.core.GeneratorBasedBuilder` prepared once under `<cache_dir>/tfds/<builder>/<config>/1.0.0/` with
`file_format='array_record'` and `disable_shuffling=True` (records keep source order). The builder config name
is a digest of everything the examples depend on (each file's relative path, size and sha256, the options, the
Python version for the embedded corpus), so a changed source builds a new dataset and never reads a stale one,
and a copy of the same files (new mtimes) is the same dataset. `tfds:<name>`
reads a dataset the user prepared (array_record) under TFDS_DATA_DIR through `tfds.data_source`; nothing is
ever downloaded.

TensorFlow is not needed: tfds 4.9.x writes ArrayRecord and serialises examples with its own protobuf path
when TF is absent (the tests assert `tensorflow` is never imported).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterator

import numpy as np

from tupe_jax.data import glue_tsv, sources, stamps
from tupe_jax.data.cache import _tfds, cache_dir, digest, file_lock, local_builder, local_input  # noqa: F401
from tupe_jax.errors import UserError

CORPORA = ("embedded", "text_files", "wikitext")


def _doc_features():
    return _tfds().features.FeaturesDict({"text": _tfds().features.Text()})


def _glue_features(regression: bool):
    tfds = _tfds()
    return tfds.features.FeaturesDict({"idx": np.int32, "sentence1": tfds.features.Text(),
                                       "sentence2": tfds.features.Text(),
                                       "label": np.float32 if regression else np.int32})


def _corpus_spec(config, legacy: bool = False, lines: bool = True) -> tuple[str, dict, bool, dict]:
    """(local path, files by split, named, spec) of a text_files/wikitext corpus; the spec is what the examples
    depend on (its digest names the prepared dataset). `legacy`: the spec of data format 1 (mtime stamps);
    `lines=False`: as versions that cut lines at `sources.OTHER_BREAKS` stamped the files (`stamps.file_stamps`)."""
    d = config.data
    path = local_input(config, d.get("path", ""), "--config.data.path")   # a bucket folder: mirrored once
    by_split, named = sources.assign_files(sources.find_files(path, d.get("file_pattern", "")))
    by_file = {s: (stamps.legacy_file_stamps(f) if legacy else stamps.file_stamps(f, path, lines))
               for s, f in sorted(by_split.items())}
    split_by = d.get("split_by", "blank_line")
    spec = {"kind": d.get("name"), "files": by_file, "named": named, "holdout": int(d.get("holdout", 200)),
            "split_by": "wikitext" if d.get("name") == "wikitext" else split_by, "format": 1 if legacy else 2}
    return path, by_split, named, spec


def corpus_builder(config):
    """The prepared builder for `config.data.name` in embedded | text_files | wikitext."""
    d = config.data
    name = d.get("name", "embedded")
    if name == "embedded":
        spec = {"kind": "embedded", "python": sys.version_info[:2], "format": 1}
        return local_builder(config, "embedded", spec, list(sources.SPLITS), _doc_features(),
                             lambda s: ({"text": t} for t in sources.embedded_documents(s)))
    if name not in ("text_files", "wikitext"):
        raise UserError(f"unknown data.name {name!r}", "config.data.name",
                        "use embedded, text_files, wikitext or tfds:<name>")
    path, by_split, named, spec = _corpus_spec(config)
    holdout, split_by, wiki = spec["holdout"], d.get("split_by", "blank_line"), name == "wikitext"
    splits = sources.available_splits(by_split, named, holdout)
    if split_by not in ("blank_line", "file"):
        raise UserError(f"unknown data.split_by {split_by!r}", "config.data.split_by", "use 'blank_line' or 'file'")

    def make(split):
        n = 0
        for t in sources.corpus_documents(by_split, named, split, split_by, holdout, wikitext=wiki):
            n += 1
            yield {"text": t}
        if n == 0:   # tfds would fail with a bare AssertionError ("No examples were yielded")
            held = not named and split == "validation"
            every = not named and split == "train" and holdout == 1     # every document is held out
            raise UserError(f"the {split} split of data.name={name} is empty (" + (
                "data.holdout=1 puts every document in validation)" if every else "no non-blank text"
                + (f"; {split} gets document i when i % data.holdout == {holdout - 1})" if held else ")")),
                "--config.data.holdout" if every else str(d.get("path", "")) or "config.data.path",
                "lower --config.data.holdout or set it to 0" if held else "give data.holdout > 1 (e.g. 200)" if every
                else "put text in the files (blank lines separate documents) or fix data.path")

    return local_builder(config, name, spec, splits, _doc_features(), make)


def _check_split(builder, split: str, where: str,
                 fix: str = "add a file for that split, or set data.holdout > 0 for a validation split") -> None:
    have = list(builder.info.splits.keys())
    if split not in have:
        raise UserError(f"split {split!r} is not available (have {sorted(have)})", where, fix)


# -------------------------------------------------------------------------------------- tfds:<name>

def tfds_source(config, name: str, split: str):
    """`tfds.data_source` over a dataset the user prepared as array_record (never downloads)."""
    tfds = _tfds()
    data_dir = config.data.get("tfds_data_dir", "") or os.environ.get("TFDS_DATA_DIR") or None
    try:
        return tfds.data_source(name, split=split, data_dir=data_dir, download=False)
    except Exception as e:  # tfds raises several types for "not prepared" / "no such split"
        raise UserError(f"cannot open tfds dataset {name!r} split {split!r} ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:160] if str(e) else ''})", f"data_dir={data_dir or '~/tensorflow_datasets'}",
                        f"prepare it with `tfds build {name} --file_format=array_record` and set TFDS_DATA_DIR") from None


def _tfds_text_key(config, source) -> str:
    key = config.data.get("tfds_text_key", "")
    feats = source.dataset_info.features if hasattr(source, "dataset_info") else None
    if key:
        return key
    if feats is not None:
        keys = list(feats.keys())
        if "text" in keys:
            return "text"
        tfds = _tfds()
        texts = [k for k in keys if isinstance(feats[k], tfds.features.Text)]
        if texts:
            return texts[0]
    raise UserError("cannot tell which feature holds the text", f"config.data.name={config.data.name}",
                    "set --config.data.tfds_text_key=FEATURE")


def _as_str(v) -> str:
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)


# ---------------------------------------------------------------------------------------- documents

def resume_keys(config, split: str) -> tuple[str, str]:
    """(key, older key or ''): what a data-iterator state holds the documents of `split` by, and what an earlier
    version held them by. text_files/wikitext: their files' content (`corpus_fingerprint`); earlier, mtime stamps.
    tfds: the dataset's full name, text feature and split sizes as its info records them, so the same dataset
    resumes from another folder (`data.tfds_data_dir` is resumable); earlier, its name and folder. Others: their
    cache key."""
    name = config.data.get("name", "embedded")
    key, _ = corpus_fingerprint(config, split)
    if not name.startswith("tfds:"):
        return key, legacy_corpus_key(config)
    src = tfds_source(config, name[5:], split)
    info = src.dataset_info
    sizes = [[s, int(v.num_bytes), [int(n) for n in v.shard_lengths]] for s, v in sorted(info.splits.items())]
    return f"tfds/{name[5:].replace('/', '_')}/i{digest([info.full_name, _tfds_text_key(config, src), sizes])}", key


def resume_key(config, split: str) -> str:
    """`resume_keys`' first key, without preparing a text_files/wikitext corpus (the digest of its spec: the name
    its prepared dataset gets)."""
    name = config.data.get("name", "embedded")
    if name in ("text_files", "wikitext"):
        return _spec_key(config)
    return resume_keys(config, split)[0]


def _spec_key(config, **spec_options) -> str:
    return f"tupe_{config.data.name}/c{digest(_corpus_spec(config, **spec_options)[3])}"


def legacy_corpus_key(config) -> str:
    """The key data format 1 gave a text_files/wikitext corpus (its mtime stamps as they are now), '' for others:
    an iterator state saved by that version is accepted when it matches (same files, untouched since)."""
    if config.data.get("name", "embedded") not in ("text_files", "wikitext"):
        return ""
    return _spec_key(config, legacy=True)


def key_before_newline_only(config) -> str:
    """The key of a text_files/wikitext corpus as versions that cut lines at `sources.OTHER_BREAKS` gave it, where
    that differs from `resume_key` (a file holds such a break); '' elsewhere."""
    if config.data.get("name", "embedded") not in ("text_files", "wikitext"):
        return ""
    before = _spec_key(config, lines=False)
    return before if before != _spec_key(config) else ""


def corpus_fingerprint(config, split: str) -> tuple[str, str]:
    """(relative cache key, description) identifying the documents of a split, for derived caches."""
    name = config.data.get("name", "embedded")
    if name.startswith("tfds:"):
        data_dir = config.data.get("tfds_data_dir", "") or os.environ.get("TFDS_DATA_DIR", "")
        return f"tfds/{name[5:].replace('/', '_')}/{digest([name, data_dir, config.data.get('tfds_text_key', '')])}", name
    b = corpus_builder(config)
    return f"{b.name}/{b.builder_config.name}", b.builder_config.description


def iter_documents(config, split: str) -> Iterator[str]:
    """Documents of `split` (train | validation | test) of the corpus `config.data.name`, in source order."""
    name = config.data.get("name", "embedded")
    if name.startswith("tfds:"):
        src = tfds_source(config, name[5:], split)
        key = _tfds_text_key(config, src)
        for rec in _records(src):
            yield _as_str(rec[key])
        return
    builder = corpus_builder(config)
    _check_split(builder, split, f"data.name={name} path={config.data.get('path', '')}",
                 "add a file whose name contains 'train', or point data.path at the training text" if split == "train"
                 else "add a file for that split (a name containing valid or dev, or test), or, when no file is named "
                 "by split, set data.holdout > 0 for a validation split")
    for rec in _records(builder.as_data_source(split=split)):
        yield _as_str(rec["text"])


def _records(src, step: int = 4096) -> Iterator[dict]:
    """All records of a random-access source, read in batches (much faster than one `src[i]` at a time)."""
    for start in range(0, len(src), step):
        idx = list(range(start, min(start + step, len(src))))
        yield from (src.__getitems__(idx) if hasattr(src, "__getitems__") else (src[i] for i in idx))


def load_documents(config, split: str) -> list[str]:
    """All documents of a split as strings (lines inside a document are its sentences)."""
    return list(iter_documents(config, split))


# --------------------------------------------------------------------------------------------- GLUE

_TFDS_GLUE_FIELDS = {"cola": ("sentence", None), "sst2": ("sentence", None), "mrpc": ("sentence1", "sentence2"),
                     "stsb": ("sentence1", "sentence2"), "qqp": ("question1", "question2"),
                     "mnli": ("premise", "hypothesis"), "qnli": ("question", "sentence"),
                     "rte": ("sentence1", "sentence2"), "wnli": ("sentence1", "sentence2")}


def glue_builder(config, task: str):
    """Prepared builder for a GLUE task from `data.glue_dir` TSVs, or for the built-in `wordorder` task."""
    if task == "wordorder":
        spec = {"kind": "wordorder", "python": sys.version_info[:2], "format": 4}
        return local_builder(config, "wordorder", spec, list(sources.SPLITS), _glue_features(False),
                             sources.wordorder_examples)
    glue_dir = local_input(config, config.data.get("glue_dir", ""), "--config.data.glue_dir")
    glue_tsv.task_spec(task)
    splits = glue_tsv.available_splits(glue_dir, task)
    if not splits:
        raise UserError(f"no GLUE files for {task}", str(Path(glue_dir).expanduser() / glue_tsv.TASKS[task].dir),
                        "set data.glue_dir to the directory made by download_glue_data.py")
    files = [glue_tsv.split_file(glue_dir, task, s) for s in splits]
    for split, path in zip(splits, files):
        glue_tsv.check_has_rows(path, task, split)
    spec = {"kind": "glue_tsv", "task": task, "files": stamps.file_stamps(files, str(Path(glue_dir).expanduser())),
            "format": 2}

    def make(split):
        return glue_tsv.parse_tsv(glue_tsv.split_file(glue_dir, task, split), task, split)

    return local_builder(config, "glue_tsv", spec, splits, _glue_features(task == "stsb"), make)


def check_glue_task(config, task: str, where: str) -> None:
    """Before any compute: a task read from data.glue_dir has its train and dev TSVs there (a bucket folder is
    mirrored first); one read from tfds has data.name to match (`glue_source_name`)."""
    if glue_source_name(config, task) != "tsv":
        return
    if not glue_tsv.has_train_and_dev(local_glue_dir(config), task):
        raise UserError(f"no train and dev files of GLUE task {task!r} in data.glue_dir {config.data.glue_dir}",
                        where, "point data.glue_dir at the folder download_glue_data.py made, or drop the task")


def local_glue_dir(config) -> str:
    """data.glue_dir as a local folder (a bucket folder mirrored once); refused when there is no such folder."""
    given = str(config.data.glue_dir)
    glue_dir = os.path.expanduser(local_input(config, given, "--config.data.glue_dir"))
    if not os.path.isdir(glue_dir):
        raise UserError(f"data.glue_dir {given} is not a folder", "--config.data.glue_dir",
                        "point it at the folder download_glue_data.py made (SST-2/, RTE/, ...)")
    return glue_dir


def glue_fingerprint(config, task: str) -> str:
    """What a task's examples are, as a key: the prepared builder's (its spec digests the TSVs' contents) or the
    TFDS dataset's name and data_dir. A fine-tune stores it and refuses to resume on other examples."""
    if glue_source_name(config, task).startswith("tfds:"):
        data_dir = config.data.get("tfds_data_dir", "") or os.environ.get("TFDS_DATA_DIR", "")
        return f"tfds:glue/{task}/{digest([data_dir])}"
    b = glue_builder(config, task)
    return f"{b.name}/{b.builder_config.name}"


def glue_source_name(config, task: str) -> str:
    """Where a task's examples come from: 'wordorder', 'tsv' (data.glue_dir) or 'tfds:glue/<task>'."""
    if task == "wordorder":
        return "wordorder"
    glue_tsv.task_spec(task)
    if config.data.get("glue_dir", ""):
        return "tsv"
    name = config.data.get("name", "")
    if name.startswith("tfds:glue/") and name[len("tfds:glue/"):] != task:
        raise UserError(f"data.name is {name} but the task is {task}", "config.data.name",
                        f"use --config.data.name=tfds:glue/{task}")
    return f"tfds:glue/{task}"


def glue_examples(config, task: str, split: str) -> list[dict]:
    """Examples {'idx', 'sentence1', 'sentence2' ('' if single), 'label' (-1 on test)} of a GLUE split."""
    canon = "train" if task == "wordorder" and split == "train" else (
        {"dev": "validation"}.get(split, split) if task == "wordorder" else glue_tsv.canonical_split(task, split))
    source = glue_source_name(config, task)
    if source.startswith("tfds:"):
        a, b = _TFDS_GLUE_FIELDS[task]
        src = tfds_source(config, source[5:], canon)
        out = []
        for i, r in enumerate(_records(src)):
            out.append({"idx": int(r.get("idx", i)), "sentence1": _as_str(r[a]),
                        "sentence2": _as_str(r[b]) if b else "",
                        "label": float(r["label"]) if task == "stsb" else int(r["label"])})
        return out
    builder = glue_builder(config, task)
    _check_split(builder, canon, f"GLUE {task} in {config.data.get('glue_dir', '')}",
                 "add the task's file for that split (download_glue_data.py layout)")
    src = builder.as_data_source(split=canon)
    regression = task == "stsb"
    return [{"idx": int(r["idx"]), "sentence1": _as_str(r["sentence1"]), "sentence2": _as_str(r["sentence2"]),
             "label": float(r["label"]) if regression else int(r["label"])}
            for r in _records(src)]
