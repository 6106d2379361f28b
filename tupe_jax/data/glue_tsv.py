"""GLUE TSV parsing for the standard `download_glue_data.py` layout.

    <glue_dir>/CoLA/{train,dev,test}.tsv     (train/dev: no header, 4 columns, label in column 2)
    <glue_dir>/SST-2/ MRPC/ STS-B/ QQP/ QNLI/ RTE/ WNLI/  {train,dev,test}.tsv (with a header row)
    <glue_dir>/MNLI/{train,dev_matched,dev_mismatched,test_matched,test_mismatched}.tsv

Fields are read by header name, never by quoting rules (GLUE text contains bare quotes). Every row must have
exactly the header's column count; a wrong count, an unknown label or undecodable bytes raise `UserError` naming
`file:line`. Labels follow the tfds `glue` convention (class index; STS-B a float 0..5; -1 on test splits).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterator

from tupe_jax.errors import UserError

_FIX = "check the file is the standard download_glue_data.py layout"


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    dir: str
    text_a: str               # header name of the first sentence
    text_b: str | None        # header name of the second sentence (None: single-sentence task)
    label: str                # header name of the label (train/dev)
    classes: tuple[str, ...]  # raw label strings in class-index order; () = regression (float)
    idx: str | None = "index"  # header name of the example id (None: row number; a test file's "index" still)
    no_header: tuple[str, ...] = ()  # column names for train/dev files without a header row


TASKS: dict[str, TaskSpec] = {
    "cola": TaskSpec("CoLA", "sentence", None, "label", ("0", "1"), idx=None,
                     no_header=("source", "label", "original_label", "sentence")),
    "sst2": TaskSpec("SST-2", "sentence", None, "label", ("0", "1"), idx=None),
    "mrpc": TaskSpec("MRPC", "#1 String", "#2 String", "Quality", ("0", "1"), idx=None),
    "stsb": TaskSpec("STS-B", "sentence1", "sentence2", "score", ()),
    "qqp": TaskSpec("QQP", "question1", "question2", "is_duplicate", ("0", "1"), idx="id"),
    "mnli": TaskSpec("MNLI", "sentence1", "sentence2", "gold_label", ("entailment", "neutral", "contradiction")),
    "qnli": TaskSpec("QNLI", "question", "sentence", "label", ("entailment", "not_entailment")),
    "rte": TaskSpec("RTE", "sentence1", "sentence2", "label", ("entailment", "not_entailment")),
    "wnli": TaskSpec("WNLI", "sentence1", "sentence2", "label", ("0", "1")),
}

# split name → file stem. `validation`/`test` of MNLI mean the matched sets.
_SPLIT_FILES = {"train": "train", "validation": "dev", "dev": "dev", "test": "test"}
_MNLI_SPLIT_FILES = {"train": "train", "validation": "dev_matched", "dev": "dev_matched", "test": "test_matched",
                     "validation_matched": "dev_matched", "dev_matched": "dev_matched",
                     "validation_mismatched": "dev_mismatched", "dev_mismatched": "dev_mismatched",
                     "test_matched": "test_matched", "test_mismatched": "test_mismatched"}


def canonical_split(task: str, split: str) -> str:
    """User split name → canonical name (`train`, `validation[_matched|_mismatched]`, `test[_...]`)."""
    table = _MNLI_SPLIT_FILES if task == "mnli" else _SPLIT_FILES
    if split not in table:
        raise UserError(f"unknown split {split!r} for GLUE task {task!r}", "glue split",
                        f"use one of {sorted(table)}")
    stem = table[split]
    return stem.replace("dev", "validation")


def task_spec(task: str) -> TaskSpec:
    if task not in TASKS:
        raise UserError(f"unknown GLUE task {task!r}", "task", f"use one of {sorted(TASKS)} or wordorder")
    return TASKS[task]


def split_file(glue_dir: str | Path, task: str, split: str) -> Path:
    spec = task_spec(task)
    canon = canonical_split(task, split)
    return Path(glue_dir).expanduser() / spec.dir / (canon.replace("validation", "dev") + ".tsv")


def available_splits(glue_dir: str | Path, task: str) -> list[str]:
    names = (["train", "validation_matched", "validation_mismatched", "test_matched", "test_mismatched"]
             if task == "mnli" else ["train", "validation", "test"])
    return [s for s in names if split_file(glue_dir, task, s).is_file()]


def has_train_and_dev(glue_dir: str | Path, task: str) -> bool:
    """The task's train file and a dev file (MNLI: dev_matched) are in `glue_dir`."""
    splits = set(available_splits(glue_dir, task))
    return {"train", "validation"} <= splits or {"train", "validation_matched"} <= splits


def check_has_rows(path: str | Path, task: str, split: str) -> None:
    """A GLUE file must hold at least one example row (below its header, where it has one)."""
    spec = task_spec(task)
    header = 0 if spec.no_header and not canonical_split(task, split).startswith("test") else 1
    with open(path, "rb") as fh:
        rows = sum(1 for line in fh if line.strip()) - header
    if rows < 1:
        raise UserError("GLUE file has a header and no rows" if header and rows == 0 else "GLUE file is empty",
                        str(path),
                        "give the task's file with its examples (download_glue_data.py layout)")


def _decoded_lines(path: Path) -> Iterator[tuple[int, str]]:
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UserError(f"GLUE row is not valid UTF-8 ({e.reason})", f"{path}:{lineno}",
                                "re-encode the file as UTF-8") from None
            if lineno == 1 and line.startswith("\ufeff"):
                line = line[1:]
            yield lineno, line.rstrip("\r\n")


def parse_tsv(path: str | Path, task: str, split: str) -> Iterator[dict]:
    """Yield {'idx', 'sentence1', 'sentence2', 'label'} for every row of one GLUE file."""
    path = Path(path)
    spec = task_spec(task)
    is_test = canonical_split(task, split).startswith("test")
    if not path.is_file():
        raise UserError(f"GLUE file for {task} {split} not found", str(path),
                        "set data.glue_dir to the directory made by download_glue_data.py")
    yield from _rows(path, spec, is_test)


def _rows(path: Path, spec: TaskSpec, is_test: bool) -> Iterator[dict]:
    """The examples of a GLUE file laid out as `spec` says (a test file: labels -1, its ids required)."""
    lines = _decoded_lines(path)
    if spec.no_header and not is_test:
        header = list(spec.no_header)
    else:
        first = next(lines, None)
        if first is None:
            raise UserError("GLUE file is empty", f"{path}:1", _FIX)
        header = first[1].split("\t")
    cols = {name: i for i, name in enumerate(header)}
    id_name = spec.idx or ("index" if is_test else None)   # a test row's id is its line of the submission file
    needed = [spec.text_a] + ([spec.text_b] if spec.text_b else []) + ([] if is_test else [spec.label]) + \
        ([id_name] if is_test else [])
    twice = sorted({n for n in header if header.count(n) > 1})
    if twice:
        raise UserError(f"GLUE header names column {twice[0]!r} twice", f"{path}:1", _FIX)
    missing = [n for n in needed if n not in cols]
    if missing:
        raise UserError(f"GLUE header lacks column(s) {missing} (has {header})", f"{path}:1", _FIX)
    if not is_test and spec.no_header and len(header) != 4:
        raise UserError("bad built-in header", str(path), _FIX)
    idx_col = cols.get(id_name) if id_name else None
    seen: dict[int, int] = {}                              # a test id -> its line (a submission has each once)
    ncol = len(header)
    for k, (lineno, line) in enumerate(lines):
        if not line.strip():
            raise UserError("GLUE file has an empty row", f"{path}:{lineno}", _FIX)
        row = line.split("\t")
        if len(row) != ncol:
            raise UserError(f"GLUE row has {len(row)} columns, expected {ncol}", f"{path}:{lineno}", _FIX)
        if is_test:
            label: int | float = -1.0 if not spec.classes else -1
        elif spec.classes:
            raw = row[cols[spec.label]].strip()
            if raw not in spec.classes:
                raise UserError(f"GLUE label {raw!r} is not one of {list(spec.classes)}", f"{path}:{lineno}", _FIX)
            label = spec.classes.index(raw)
        else:
            raw = row[cols[spec.label]].strip()
            try:
                label = float(raw)
            except ValueError:
                raise UserError(f"GLUE label {raw!r} is not a number", f"{path}:{lineno}", _FIX) from None
            if not 0.0 <= label <= 5.0:
                raise UserError(f"STS-B score {label} is outside 0..5", f"{path}:{lineno}", _FIX)
        idx = k
        if idx_col is not None:
            try:
                idx = int(row[idx_col])
            except ValueError:
                raise UserError(f"GLUE id {row[idx_col]!r} is not an integer", f"{path}:{lineno}", _FIX) from None
            if not 0 <= idx < 2 ** 31:
                raise UserError(f"GLUE id {idx} is outside 0..2^31-1", f"{path}:{lineno}", _FIX)
            if is_test and seen.setdefault(idx, lineno) != lineno:
                raise UserError(f"GLUE test id {idx} is on line {seen[idx]} too", f"{path}:{lineno}",
                                "give each test row its own id (the submission file has one line per id)")
        yield {"idx": idx, "sentence1": row[cols[spec.text_a]],
               "sentence2": row[cols[spec.text_b]] if spec.text_b else "", "label": label}


def diagnostic_path(glue_dir: str | Path) -> Path:
    """MNLI's diagnostic set (GLUE's AX), predicted with MNLI's test splits."""
    return Path(glue_dir).expanduser() / "diagnostic" / "diagnostic.tsv"


# MNLI's diagnostic set (GLUE's AX) is read as a test file of this layout
DIAGNOSTIC = TaskSpec("diagnostic", "sentence1", "sentence2", "", TASKS["mnli"].classes, idx="index")


def parse_diagnostic(path: str | Path) -> list[dict]:
    """The examples of diagnostic.tsv (header index, sentence1, sentence2; labels -1), with `parse_tsv`'s checks:
    a short row, a non-integer index, bad bytes or no rows is an error naming the file (and line)."""
    path = Path(path)
    examples = list(_rows(path, DIAGNOSTIC, True))
    if not examples:
        raise UserError("GLUE diagnostic file has a header and no rows", str(path), "use the GLUE diagnostic.tsv")
    return examples


def num_labels(task: str) -> int:
    """Classes of a task; 1 for the STS-B regression."""
    if task == "wordorder":
        return 2
    return len(task_spec(task).classes) or 1
