"""Shared pieces of the analysis tools: loaded runs, jitted forwards, token windows, atomic JSON/PNG output.

A `Run` (= `workdir.LoadedRun`) is everything a tool needs about one trained model: the run's config
(ml_collections, for `config.data`), its `ModelConfig`, unboxed params, tokenizer, step and workdir.
"""
from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tupe_jax import files, local_staging, plots, xla_options
from tupe_jax import workdir as workdir_lib
from tupe_jax import data as data_lib
from tupe_jax.errors import UserError
from tupe_jax.model import ModelConfig, TransformerLM
from tupe_jax.workdir import LoadedRun

# Forward-pass memory bounds: tokens per forward (bounds activations and the (tokens, vocab) logits) and attention
# matrix elements per layer (B·H·L·L). A length whose single row exceeds them still runs with batch 1.
DEFAULT_TOKEN_BUDGET = 8192
ATTENTION_BUDGET = 1 << 27


# One loaded-run type for every tool (evaluate, fine-tuning, analysis): tools take `Run`s, so tests build them in
# memory; `load_runs(workdirs)` reads them from disk.
Run = LoadedRun
load_runs = workdir_lib.load_runs


_STAGED: dict[str, str] = {}   # local staging folder -> its bucket folder (see `output_dir`, `publish`)


def _target(workdirs: str | Sequence[str], out: Optional[str]) -> str:
    if out:
        return str(out)
    first = workdirs if isinstance(workdirs, (str, os.PathLike)) else workdirs[0]
    return files.join(str(first), "analysis")


def check_output_dir(workdirs: str | Sequence[str], out: Optional[str] = None,
                     data: Optional[Mapping[str, str]] = None) -> None:
    """Before any compute: the output folder (`out`, or `<first workdir>/analysis/`) is not a file and, locally,
    can be written. Scoring another corpus (`data`: `--config.data.*`) needs `out`: its outputs would replace those
    of the run's own corpus."""
    if out is not None and not str(out).strip():
        raise UserError("--out is empty", "--out", "give a folder for the analysis outputs, or leave --out out for "
                        "<workdir>/analysis/")
    if data and out is None:
        raise UserError("--config.data.* scores another corpus than the run's: its outputs would replace the run's "
                        "own in <workdir>/analysis/", "--out", "give them a folder of their own with --out=DIR")
    if data:      # nor into a run's own folder or its analysis/ (another corpus's files would replace the run's)
        runs = [workdirs] if isinstance(workdirs, (str, os.PathLike)) else list(workdirs)
        remote = files.is_remote(str(out))
        same = (lambda p: p.rstrip("/")) if remote else os.path.realpath
        own = {same(files.join(str(w), sub)) for w in runs for sub in ("", "analysis")
               if files.is_remote(str(w)) == remote}
        if same(str(out)) in own:
            raise UserError(f"--out={out} is a run's own folder or its analysis/: the outputs of another corpus "
                            "would replace that run's own", "--out", "give them a folder of their own, e.g. "
                            "<workdir>/analysis-<corpus>")
    target = _target(workdirs, out)
    workdir_lib.refuse_in_checkpoints(target, workdirs, "--out")
    if files.exists(target) and not files.isdir(target):
        raise UserError(f"{target} is a file, not a folder", "--out", "give a folder for the analysis outputs")
    if files.is_remote(target):
        return
    existing = Path(target)
    while not existing.exists():
        existing = existing.parent
    if not os.access(existing, os.W_OK):
        raise UserError(f"{existing} is not writable", "--out", "give an output folder you can write")


def layer_tag(layer: int) -> str:
    """An analysis's output names' suffix for `layer`: '' for the first (the default), `_layer<L>` past it (another
    layer's analysis keeps its own files)."""
    return f"_layer{layer}" if layer else ""


def check_layer(runs: Sequence["Run"], layer: int) -> None:
    """Before any output is written: `layer` is a block of every run."""
    for run in runs:
        if not 0 <= layer < run.model_cfg.num_layers:
            raise UserError(f"--layer={layer} is out of range for '{run.name}'", "--layer",
                            f"use 0..{run.model_cfg.num_layers - 1}")


def output_dir(workdirs: str | Sequence[str], out: Optional[str] = None) -> Path:
    """`out`, or `<first workdir>/analysis/`, created. A bucket target (`gs://...`) gets a local staging folder:
    the tool writes there and `publish` uploads it."""
    check_output_dir(workdirs, out)
    target = _target(workdirs, out)
    if files.is_remote(target):
        staging = local_staging.make("analysis")
        _STAGED[staging] = target
        return Path(staging)
    Path(target).mkdir(parents=True, exist_ok=True)
    return Path(target)


def publish(directory: Path) -> str:
    """Where `directory`'s files live now: itself, or (a staging folder) its bucket folder, after uploading them.
    On several processes (a pod: every host runs the analysis and computes the same) process 0 alone uploads: the
    others' uploads of the same objects at once would race (a bucket limits how often one object changes)."""
    target = _STAGED.pop(str(directory), None)
    if target is None:
        return str(directory)
    if jax.process_index() == 0:
        for name in sorted(os.listdir(directory)):
            files.upload(os.path.join(directory, name), files.join(target, name))
    local_staging.remove(str(directory))
    return target


def available_memory() -> int:
    """Bytes of memory this machine can still give (MemAvailable), or 0 when unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def forward_bytes(model_cfg: ModelConfig, rows: int, length: int) -> int:
    """A lower bound on the memory of one deterministic forward: per layer the (rows, H, L, L) float32 logits and
    probabilities (and a shared (H, L, L) bias), plus the (rows, L, V) float32 output logits."""
    attention = 2 * rows * model_cfg.num_heads * length * length + model_cfg.num_heads * length * length
    return 4 * (attention + rows * length * model_cfg.vocab_size)


def check_memory(model_cfg: ModelConfig, length: int, where: str, token_budget: int = DEFAULT_TOKEN_BUDGET) -> None:
    """Refuse a length whose smallest forward cannot fit in the memory this machine has available."""
    need, have = forward_bytes(model_cfg, batch_rows(length, model_cfg, token_budget), length), available_memory()
    if have and need > 0.8 * have:
        raise UserError(f"length {length} needs at least {need / 2**30:.1f} GiB for one forward ({model_cfg.num_heads}"
                        f" heads x {length}² attention), this machine has {have / 2**30:.1f} GiB available", where,
                        "evaluate shorter lengths")


def write_json(path: str | Path, obj: Any) -> Path:
    """Write `obj` as indented JSON atomically (NaN/inf as null)."""
    return Path(files.write_json(path, obj, sort_keys=False))


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    return plots.plt


def save_figure(fig, path: str | Path, dpi: int = 120) -> Path:
    """Save a matplotlib figure atomically and close it."""
    return Path(plots.save_figure(fig, str(path), dpi=dpi))


class Progress:
    """Throttled progress lines on stderr: `<label>: i/n (elapsed)`."""

    def __init__(self, label: str, total: int, every_s: float = 5.0, stream=None):
        self.label, self.total, self.every_s = label, total, every_s
        self.stream = stream or sys.stderr
        self.start = self.last = time.time()

    def update(self, done: int) -> None:
        now = time.time()
        if done >= self.total or now - self.last >= self.every_s:
            self.last = now
            print(f"{self.label}: {done}/{self.total} ({now - self.start:.1f}s)", file=self.stream, flush=True)


def batch_rows(length: int, model_cfg: ModelConfig, token_budget: int = DEFAULT_TOKEN_BUDGET) -> int:
    """Rows per forward at `length` so tokens and attention matrices stay within the budgets (at least 1)."""
    by_tokens = token_budget // max(length, 1)
    by_attention = ATTENTION_BUDGET // max(model_cfg.num_heads * length * length, 1)
    return max(1, min(by_tokens, by_attention))


@functools.lru_cache(maxsize=32)
def forward_fn(model_cfg: ModelConfig, return_hidden: bool = False, return_attention: bool = False):
    """Jitted deterministic `TransformerLM.apply(params, tokens, input_mask, mlm_positions)`, compiled as `evaluate`
    compiles the model (`xla_options.jit`; the dot library is read when a forward is first built in the process)."""
    model = TransformerLM(model_cfg)

    @xla_options.jit
    def forward(params, tokens, input_mask=None, mlm_positions=None):
        return model.apply({"params": params}, tokens, input_mask=input_mask, mlm_positions=mlm_positions,
                           deterministic=True, return_hidden=return_hidden, return_attention=return_attention)

    return forward


def token_stream(run: Run, split: str) -> np.ndarray:
    """The flat token stream of a split of the run's corpus ([SEP] after every document)."""
    return data_lib.token_stream(run.config, run.tokenizer, split)


def model_windows(run: Run, split: str, length: int, count: Optional[int] = None, seed: int = 0) -> np.ndarray:
    """(n, length) int32 full-length model inputs cut from the split's token stream (unmasked text).

    CLM: `length` consecutive tokens. MLM: [CLS] + `length`−1 consecutive tokens (as the MLM pipeline lays out an
    example). Windows are contiguous and non-overlapping; with `count`, that many are drawn at random (`seed`),
    cycling over the windows if there are fewer (said in a line: the same text then counts more than once).
    """
    stream = token_stream(run, split)
    text = length if run.model_cfg.causal else length - 1
    n = len(stream) // text
    if n == 0:
        raise UserError(f"split {split!r} has {len(stream)} tokens, fewer than one window of {length}",
                        "config.data", "use a larger corpus or a shorter length")
    idx = np.arange(n)
    if count is not None:
        if count > n:
            print(f"{run.name}: the {split} split holds {n} windows of {length} tokens; the {count} drawn repeat "
                  f"them ({count / n:.1f} times each on average)", flush=True)
        rng = np.random.default_rng(seed)
        idx = np.concatenate([rng.permutation(n) for _ in range(-(-count // n))])[:count]
    rows = np.stack([np.asarray(stream[i * text:(i + 1) * text]) for i in idx]).astype(np.int32)
    if not run.model_cfg.causal:
        rows = np.concatenate([np.full((len(rows), 1), run.tokenizer.cls_id, np.int32), rows], axis=1)
    return rows


def hidden_states(run: Run, tokens: np.ndarray, token_budget: int = DEFAULT_TOKEN_BUDGET) -> np.ndarray:
    """(num_layers + 1, n, L, d) float32: layer 0 = embedding output, then after each block (frozen model)."""
    forward = forward_fn(run.model_cfg, return_hidden=True)
    rows = batch_rows(tokens.shape[1], run.model_cfg, token_budget)
    out = []
    for i in range(0, len(tokens), rows):
        chunk = tokens[i:i + rows]
        pad = rows - len(chunk)
        batch = np.pad(chunk, ((0, pad), (0, 0))) if pad else chunk
        hs = forward(run.params, jnp.asarray(batch))["hidden_states"]
        out.append(np.stack([np.asarray(h, np.float32) for h in hs])[:, :len(chunk)])
    return np.concatenate(out, axis=1)


def attention_probs(run: Run, tokens: np.ndarray) -> np.ndarray:
    """(num_layers, n, H, L, L) float32 attention probabilities."""
    forward = forward_fn(run.model_cfg, return_attention=True)
    out = forward(run.params, jnp.asarray(tokens, jnp.int32))
    return np.stack([np.asarray(a, np.float32) for a in out["attentions"]])
