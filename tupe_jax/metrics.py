"""Metrics: `workdir/metrics.jsonl` + TensorBoard (process 0 only), a progress line with ETA, and model FLOPs / MFU.

FLOPs follow the usual "model FLOPs" convention (MaxText, PaLM appendix B): matmul FLOPs only (embedding lookups
are gathers and not counted), forward = 2 · matmul-params · tokens + attention 4 · n_layers · S² · d per sequence,
training = 3 × forward. The attention term is NOT halved for bidirectional (MLM) models; for causal models pass
`causal=True` to halve it (only the lower triangle is useful work). The MLM head (dense d×d + decoder d×V) is
counted on the predicted positions only when the gather form is used (`mlm_predictions=P`), else on every position.
Remat recomputation is not counted (that would be hardware FLOPs).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from typing import Any, Callable, Iterator, Mapping, TextIO

import jax
import numpy as np

from tupe_jax import files, local_staging
from tupe_jax.errors import UserError

# Dense bf16 peak TFLOP/s per device, by `jax.devices()[0].device_kind` substring (lower-cased). 0 = unknown.
PEAK_TFLOPS = (
    ("v6 lite", 918.0), ("v6e", 918.0), ("v5p", 459.0), ("v5 lite", 197.0), ("v5e", 197.0), ("v4", 275.0),
    ("h200", 989.0), ("h100 pcie", 756.0), ("h100", 989.0), ("a100", 312.0), ("l4", 121.0),   # dense bf16
)


def summary_writer_class() -> type:
    """tensorboardX's `SummaryWriter`, imported without torch unless torch is already loaded.

    tensorboardX imports torch at module level when it is installed (only to accept torch tensors, which we never
    pass); with torch present (the `fairseq` and `test` extras, most GPU images) that is ~2.5 s of every launch's
    start-up. A `None` entry in `sys.modules` makes that optional `import torch` raise ImportError, which tensorboardX
    handles; the entry is removed again, so a later `import torch` (fairseq import) loads it as usual.
    """
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
        return SummaryWriter
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel,reimported
    finally:
        del sys.modules["torch"]
    return SummaryWriter


def _scalar(value: Any) -> float | int | str:
    if isinstance(value, (str, bool, int)):
        return value
    array = np.asarray(value)
    if array.size != 1:
        raise ValueError(f"metric value of shape {array.shape} is not a scalar")
    item = array.reshape(()).item()
    return float(item) if isinstance(item, float) else item


def _cut_torn_row(path: str) -> None:
    """A process killed while writing a row left `path` ending inside it: cut that fragment (one line says so), or
    the next row would continue it and neither could be read (a `resumed` row lost that way kept stale rows)."""
    if not files.exists(path):
        return
    if not files.is_remote(path):          # locally the last byte tells; read the whole file only to cut it
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            if size:
                f.seek(-1, os.SEEK_END)
            if not size or f.read(1) == b"\n":
                return
    text = files.read_text(path)
    if text and not text.endswith("\n"):
        keep = text.rfind("\n") + 1
        print(f"{path}: its last row was cut short (a process stopped while writing it); removed its "
              f"{len(text) - keep} bytes", flush=True)
        files.write_text(path, text[:keep])


class MetricsWriter:
    """Append one JSON object per logged step to `workdir/metrics.jsonl` and mirror it to TensorBoard.

    Only process 0 writes (pass `enabled` to override); other processes get a no-op writer. In a bucket
    (`gs://...`), where objects cannot be appended to, rows are buffered and the object is rewritten whole at
    `flush()` (called at every checkpoint and at the end) and at most every `flush_secs` seconds otherwise.
    `owns_folder` (bucket only) is asked before each such rewrite: once it says False (the run's lease was taken
    over by another launch, workdir/lock.py) nothing more is written there, and the rows are dropped with one line.
    """

    def __init__(self, workdir: str, enabled: bool | None = None, tensorboard: bool = True, flush_secs: float = 30,
                 owns_folder: Callable[[], bool] | None = None):
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self._owns_folder, self._lost = owns_folder, False
        self.path = files.join(workdir, "metrics.jsonl")
        self._file: TextIO | None = None
        self._pending: list[str] = []               # rows not yet in the bucket object
        self._remote, self._flush_secs, self._flushed = files.is_remote(workdir), flush_secs, time.time()
        self._tb: Any = None
        self._tb_remote: str | None = None
        self._tb_local = ""
        if not self.enabled:
            return
        files.makedirs(workdir)
        _cut_torn_row(self.path)
        if not self._remote:
            self._file = open(self.path, "a", encoding="utf-8")  # pylint: disable=consider-using-with
        if tensorboard:   # in a bucket: events are written to a local staging folder and uploaded at each flush
            self._tb_remote = files.join(workdir, "tensorboard") if self._remote else None
            self._tb_local = local_staging.make("tb") if self._remote else files.join(workdir,
                                                                                                       "tensorboard")
            self._tb = summary_writer_class()(self._tb_local, flush_secs=30)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Log `metrics` (scalars; jax/numpy arrays are converted) at `step`."""
        if not self.enabled:
            return
        row: dict[str, Any] = {"step": int(step)}
        row.update({k: _scalar(v) for k, v in metrics.items()})
        line = json.dumps(row, sort_keys=False) + "\n"
        if self._remote:
            self._pending.append(line)
            if time.time() - self._flushed >= self._flush_secs:
                self._flush_rows()
        else:
            assert self._file is not None
            self._file.write(line)
            self._file.flush()
        if self._tb is not None and "event" not in row:     # an event row (resumed, init_from) is no curve
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool) \
                        and math.isfinite(value):
                    self._tb.add_scalar(key, value, int(step))

    def write_text(self, tag: str, text: str, step: int = 0) -> None:
        """A text note in TensorBoard (e.g. the resolved config)."""
        if self.enabled and self._tb is not None:
            self._tb.add_text(tag, text, step)

    def _still_ours(self) -> bool:
        """False once `owns_folder` said the bucket folder is another launch's (then this writer stays silent)."""
        if self._lost:
            return False
        if self._owns_folder is not None and not self._owns_folder():
            print(f"error: {self.path}: this run no longer holds its folder (its lease was taken over), "
                  f"{len(self._pending)} metrics rows and later ones are not written, see the run's checkpoint "
                  "error", file=sys.stderr, flush=True)
            self.enabled, self._pending, self._lost = False, [], True
            return False
        return True

    def _flush_rows(self, checked: bool = False) -> None:
        if self._pending and (checked or self._still_ours()):
            files.append_text(self.path, "".join(self._pending))
            self._pending = []
        self._flushed = time.time()

    def flush(self) -> None:
        """Flush both sinks (in a bucket: one look at the folder's lease for both)."""
        ours = not self._remote or self._still_ours()
        if self._remote and self.enabled and ours:
            self._flush_rows(checked=True)
        if self._file is not None:
            self._file.flush()
        if self._tb is not None:
            self._tb.flush()
            if ours:
                self._upload_events(checked=True)

    def _upload_events(self, checked: bool = False) -> None:
        if self._tb_remote and (checked or self._still_ours()):
            files.upload_tree(self._tb_local, self._tb_remote)

    def close(self) -> None:
        """Flush and close."""
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
            self._upload_events()
            if self._tb_remote:
                local_staging.remove(self._tb_local)

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@contextlib.contextmanager
def closed_on_error(writer: "MetricsWriter") -> Iterator["MetricsWriter"]:
    """Close `writer` when the block raises (Ctrl-C): its TensorBoard thread would print a traceback at exit."""
    try:
        yield writer
    except BaseException:
        with contextlib.suppress(Exception):
            writer.close()
        raise


RESUMED = "resumed"  # value of the `event` key of the row a restarted run writes at its checkpoint step


def _after_a_torn_row(line: str) -> dict | None:
    """The whole row at the end of `line` when a torn row precedes it (`{"step": 7, "lo{"step": 4, ...}`: a writer
    before `_cut_torn_row` continued a killed process's last line); None if there is none."""
    start = line.rfind('{"step"')
    try:
        row = json.loads(line[start:]) if start > 0 else None
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) else None


def read_metrics(workdir: str, raw: bool = False) -> list[dict[str, Any]]:
    """The rows of `workdir/metrics.jsonl` (a torn last row skipped; before it, a torn row continued by a whole one
    gives that one, and anything else unreadable is an error), as one history.

    A run killed after its step-N checkpoint and restarted redoes steps N+1..; it first writes a row
    {"step": N, "event": "resumed"}. Such a row drops the earlier rows of steps > N (the file keeps them) and is
    not returned itself. `raw=True` returns every row as written, markers included.
    """
    rows: list[dict[str, Any]] = []
    path = files.join(workdir, "metrics.jsonl")
    lines = files.read_text(path).split("\n")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):     # the row a live run is writing, or a killed one's torn last row
                continue
            row = _after_a_torn_row(line)
            if row is None:
                raise UserError(f"{path} line {number} is not a JSON row ({line[:40]!r})", "--workdir",
                                "restore the file, or delete that line if the rows around it are whole")
        if not raw and row.get("event") == RESUMED:
            rows = [r for r in rows if int(r.get("step", 0)) <= int(row["step"])]
            continue
        rows.append(row)
    return rows


def has_eval_at(workdir: str, step: int) -> bool:
    """Whether the training loop wrote its evaluation row at `step` (rows of `launch evaluate`, which name their
    split, do not count); False where there is no metrics.jsonl."""
    path = files.join(workdir, "metrics.jsonl")
    return files.exists(path) and any(int(r.get("step", -1)) == step and "eval_loss" in r and "split" not in r
                                      for r in read_metrics(workdir))


def rows_past(workdir: str, step: int) -> bool:
    """Whether `workdir/metrics.jsonl` holds rows past `step`: a process that stopped before its first checkpoint
    wrote them, and a run starting again at `step` redoes them (it writes a `resumed` row there first)."""
    path = files.join(workdir, "metrics.jsonl")
    return files.exists(path) and any(int(r.get("step", 0)) > step for r in read_metrics(workdir))


def format_duration(seconds: float) -> str:
    """H:MM:SS."""
    seconds = max(int(seconds), 0)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Progress:
    """A periodic one-line progress report with rate and ETA (printed on process 0 only)."""

    def __init__(self, total_steps: int, start_step: int = 0, stream: TextIO | None = None):
        self.total_steps = total_steps
        self._last_step = start_step
        self._last_time = time.perf_counter()
        self._start_time = self._last_time
        self._stream = stream if stream is not None else sys.stdout
        self.enabled = jax.process_index() == 0

    def line(self, step: int, metrics: Mapping[str, Any]) -> str:
        """Format the line for `step` and reset the rate window; returns it (and prints it when enabled)."""
        now = time.perf_counter()
        rate = (step - self._last_step) / max(now - self._last_time, 1e-9)
        self._last_step, self._last_time = step, now
        eta = (self.total_steps - step) / rate if rate > 0 else float("nan")
        parts = [f"step {step}/{self.total_steps}"]
        for key, value in metrics.items():
            value = _scalar(value)
            parts.append(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}")
        parts.append(f"{rate:.2f} steps/s")
        parts.append("ETA " + (format_duration(eta) if math.isfinite(eta) else "?"))
        text = " | ".join(parts)
        if self.enabled:
            print(text, file=self._stream, flush=True)
        return text


def transformer_training_flops(num_layers: int, hidden_size: int, mlp_dim: int, vocab_size: int, seq_len: int,
                               batch_size: int, causal: bool = False, mlm_predictions: int | None = None,
                               extra_forward_flops: float = 0.0, last_layer_predictions: bool = False) -> float:
    """Model FLOPs of ONE training step (forward + backward = 3 × forward) for a batch of `batch_size` sequences.

    Per layer: QKV + output projections 4·d² params, MLP 2·d·mlp params → 2 FLOPs per param per token; attention
    scores and weighted sum 4·S²·d per sequence (halved if `causal`). Head: MLM (d² transform + d·V decoder) on
    `mlm_predictions` positions per sequence when given, else on all S; causal LM head d·V on all S.
    `last_layer_predictions` (MLM, P = mlm_predictions < S; `model.last_layer_rows="predicted"`): the last layer's
    keys and values on all S, its queries, output projection, MLP and attention rows (4·P·S·d) on the P only.
    """
    d, s, b = hidden_size, seq_len, batch_size
    tokens = b * s
    layer_params = 4 * d * d + 2 * d * mlp_dim
    forward = 2.0 * num_layers * layer_params * tokens
    attention = 4.0 * num_layers * s * s * d * b
    forward += attention / 2 if causal else attention
    if causal:
        forward += 2.0 * d * vocab_size * tokens
    else:
        head_positions = b * (mlm_predictions if mlm_predictions is not None else s)
        forward += 2.0 * (d * d + d * vocab_size) * head_positions
    if last_layer_predictions and not causal and mlm_predictions is not None and mlm_predictions < s:
        skipped = s - mlm_predictions       # rows of the last layer not computed, per sequence
        forward -= b * skipped * (2.0 * (2 * d * d + 2 * d * mlp_dim) + 4.0 * s * d)
    return 3.0 * (forward + extra_forward_flops)


def peak_tflops(configured: float = 0.0, device_kind: str | None = None) -> float:
    """Per-device peak TFLOP/s: `configured` if > 0, else a lookup by device kind; 0.0 when unknown."""
    if configured > 0:
        return float(configured)
    kind = (device_kind if device_kind is not None else jax.devices()[0].device_kind).lower()
    for key, value in PEAK_TFLOPS:
        if key in kind:
            return value
    return 0.0


def mfu(flops_per_step: float, step_time_s: float, num_devices: int, peak_tflops_per_device: float) -> float:
    """Model FLOPs utilisation = achieved FLOP/s ÷ (devices × peak); NaN when the peak is unknown."""
    if peak_tflops_per_device <= 0 or step_time_s <= 0:
        return float("nan")
    return flops_per_step / step_time_s / (num_devices * peak_tflops_per_device * 1e12)
