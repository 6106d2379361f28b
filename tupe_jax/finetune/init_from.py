"""`init_from`: resolve the pretraining run, adopt its tokenizer, refuse an incompatible one (scheme, model keys,
param shapes), and restore its encoder (a fine-tune) or all its params (`pretrain` continuing a run or an import).

A pretraining checkpoint's state item is `{'step', 'params', 'opt_state', 'rng'}` with params of a `TransformerLM`
(`{'encoder', 'head_dense', 'head_ln', 'head_bias'}`). A `SequenceClassifier` has the same `encoder` subtree, so
a fine-tune reads only `params['encoder']` (an Orbax partial restore straight onto the fine-tune shardings);
`pooler` and `classifier` keep their fresh initialisation. A continued pretraining reads every param. Either way
the optimizer state, the schedule and the data order start fresh.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
import ml_collections

from tupe_jax import checkpoint as ckpt_lib
from tupe_jax import files
from tupe_jax import workdir as workdir_lib
from tupe_jax.errors import UserError, require
from tupe_jax.positional import canonical_name

# Model keys that must equal the pretraining run's (they change parameter shapes or what the parameters mean).
# dtype, dropout rates and the attention backend may differ.
MUST_MATCH = ("pe", "objective", "num_layers", "hidden_size", "num_heads", "mlp_dim", "vocab_size", "max_len",
              "untie_cls", "rel_num_buckets", "rel_max_distance", "rope_base", "rope_style", "rope_fraction",
              "layer_norm_eps", "tupe_form", "sinusoidal_style", "type_vocab_size")
WHERE = "--config.init_from"
WHERE_STEP = "--config.init_step"   # a step of the run that does not read names this
# The model keys each key of the config arg (configs/glue.py:pe=...,size=...,objective=...) sets when it is given.
ARG_KEYS = {"pe": ("pe",), "objective": ("objective", "untie_cls"),
            "size": ("num_layers", "hidden_size", "num_heads", "mlp_dim", "vocab_size", "max_len")}


# ------------------------------------------------------------------------------------------------ init_from
def validate_keys(config: ml_collections.ConfigDict) -> None:
    """`init_step` is a step (or -1, the newest), and only with `init_from`."""
    step = int(config.get("init_step", -1))
    require(step >= -1, f"init_step = {step} is not a step", WHERE_STEP,
            "give a checkpoint step of init_from, or -1 (the default) for its newest")
    require(step == -1 or str(config.get("init_from", "")), f"init_step = {step} without "
            "init_from (a run from scratch reads no checkpoint)", WHERE_STEP,
            "give --config.init_from=RUN too, or drop init_step")


@dataclasses.dataclass(frozen=True)
class InitSource:
    workdir: str          # the pretraining run
    step: int             # the checkpoint step to read
    meta: dict[str, Any]  # the checkpoint's meta item
    follow: bool = True   # no step was asked for: if a run still training there deletes `step`, read its newest


def resolve_init_from(path: str, init_step: int = -1) -> tuple[str, int | None]:
    """(pretraining workdir, step or None = latest) from a workdir, its checkpoints dir, or checkpoints/<step>."""
    path = files.absolute(path if files.is_remote(path) else os.path.expanduser(path)).rstrip("/")
    if files.is_remote(path):      # a transport failure is one line naming it, not "not a pretraining run"
        files.check_bucket(path, WHERE)
    base, _, name = path.rpartition("/")
    step = None if init_step < 0 else int(init_step)
    if files.isdir(files.join(path, "checkpoints")):
        workdir = path
    elif name.isdigit() and base.rpartition("/")[2] == "checkpoints" and files.isdir(path):
        workdir, step = base.rpartition("/")[0], int(name)
        if 0 <= init_step != step:
            raise UserError(f"init_from names step {step} but init_step is {init_step}", WHERE_STEP,
                            "give the step once: in init_from (.../checkpoints/STEP) or as init_step")
    elif name == "checkpoints" and files.isdir(path):
        workdir = base
    elif not files.exists(path):
        raise UserError(f"init_from {path} does not exist", WHERE, "point it at a `launch pretrain` workdir (or an "
                        "import's), or leave it empty to train from scratch")
    else:
        raise UserError(f"init_from {path} is not a pretraining run (no checkpoints/ there)", WHERE,
                        "point it at a `launch pretrain` workdir or its checkpoints/<step>, or leave it empty to "
                        "train from scratch")
    config = workdir_lib.config_path(workdir)
    try:
        task = files.read_json(config).get("task") if files.isfile(config) else None
    except (ValueError, AttributeError):
        task = None       # read (and refused, if need be) with the run's checkpoints
    if task:
        raise UserError(f"init_from {workdir} is a fine-tuning run ({task}), not a pretraining run", WHERE,
                        "point it at the pretraining run that fine-tune started from (its results.json names it)")
    return workdir, step


def open_init_source(config: ml_collections.ConfigDict) -> InitSource:
    """Resolve `config.init_from`, pick the step, read its meta and refuse another scheme or model shape."""
    workdir, requested = resolve_init_from(str(config.init_from), int(config.init_step))
    step, meta = workdir_lib.read_kept_step(workdir, requested, functools.partial(workdir_lib.read_meta, workdir,
                                                                                   where=WHERE_STEP),
                                            WHERE_STEP if int(config.init_step) >= 0 else WHERE,
                                            follow=requested is None, where_run=WHERE)
    workdir_lib.check_compatible(meta, canonical_name(str(config.model.pe)), where=WHERE)
    check_model_keys(workdir, config)
    return InitSource(workdir, int(step), meta, follow=requested is None)


def adopt_model_keys(config: ml_collections.ConfigDict, arg_keys: frozenset[str] = frozenset(),
                     override_keys: frozenset[str] = frozenset(), workdir: str = "") -> list[str]:
    """With `config.init_from`, set the MUST_MATCH model keys that the command line left to their presets to the
    pretraining run's values (its config.json); return them as `model.key=value`. A key counts as given when
    `override_keys` holds `model.<key>` or `arg_keys` holds a config-arg key that sets it (`ARG_KEYS`: `pe`,
    `objective`, `size`); a given key is kept, and `check_model_keys` refuses it if it differs from the run's.
    Without init_from, or a run without a readable config.json, nothing changes. `workdir` (the command's own
    folder, from the launcher): a run already started there from the same init_from took the keys at its start, and
    its config.json gives them (init_from may be gone by then: a continued pretraining reads it no more); a new
    run there may not lie inside init_from's folder."""
    if not config.init_from:
        return []
    theirs = _started_from(workdir, str(config.init_from))
    if theirs is None:
        source, _ = resolve_init_from(str(config.init_from), int(config.init_step))
        inside = workdir and files.absolute(workdir).startswith(files.absolute(source).rstrip("/") + "/")
        require(not inside, f"--workdir {workdir} is inside the folder of init_from's run {source}", "--workdir",
                "give the new run a folder of its own, outside the run it starts from")
        path = workdir_lib.config_path(source)
        if not files.isfile(path):
            return []
        try:
            theirs = files.read_json(path).get("model", {})
        except ValueError:
            return []
    given = {k[len("model."):] for k in override_keys if k.startswith("model.")}
    given |= {key for arg in arg_keys for key in ARG_KEYS.get(arg, ())}
    adopted = []
    for key in MUST_MATCH:
        if key in theirs and key in config.model and key not in given and theirs[key] != config.model[key]:
            config.model[key] = theirs[key]
            adopted.append(f"model.{key}={theirs[key]!r}")
    return adopted


def _started_from(workdir: str, init_from: str) -> dict | None:
    """The model keys of a run already started in `workdir` from `init_from` (its config.json), else None."""
    path = workdir_lib.config_path(workdir) if workdir else ""
    try:
        stored = files.read_json(path) if path and files.isfile(path) else {}
    except ValueError:
        return None            # the gate reads it again, and refuses it in one line
    same = isinstance(stored, dict) and stored.get("init_from") == init_from
    return stored.get("model", {}) if same else None


def check_model_keys(pretrain_workdir: str, config: ml_collections.ConfigDict) -> None:
    """Refuse a pretraining run whose config.json has other shape-defining model keys, naming both values."""
    path = workdir_lib.config_path(pretrain_workdir)
    if not files.isfile(path):
        return  # the param-shape check in `check_param_shapes` still runs
    try:
        old = files.read_json(path).get("model", {})
    except ValueError:
        return
    diffs = [(k, old[k], config.model[k]) for k in MUST_MATCH if k in old and k in config.model
             and old[k] != config.model[k]]
    if diffs:
        theirs = ", ".join(f"model.{k}={a!r}" for k, a, _ in diffs)
        ours = ", ".join(f"model.{k}={b!r}" for k, _, b in diffs)
        raise UserError(f"init_from {pretrain_workdir} was pretrained with {theirs} but this config has {ours}",
                        WHERE, "leave those keys off the command line to take the run's (pe=, size=, objective= "
                        "in --config and --config.model.*)")


def check_param_shapes(meta: dict[str, Any], abstract: dict[str, Any]) -> None:
    """Refuse a checkpoint whose params under the top-level keys of `abstract` (e.g. {'encoder': ...}) differ in
    names or shapes from this model's, naming both."""
    saved = {k: v for k, v in meta.get("param_shapes", {}).items() if any(k.startswith(f"['{top}']")
                                                                          for top in abstract)}
    if not saved:
        return
    ours = ckpt_lib.param_shapes(abstract)
    part = "encoder" if list(abstract) == ["encoder"] else "model"
    missing = sorted(set(ours) - set(saved))
    extra = sorted(set(saved) - set(ours))
    if missing or extra:
        raise UserError(f"the checkpoint's {part} has other parameters (checkpoint only: {extra[:3]}, this model "
                        f"only: {missing[:3]})", WHERE, "use the pretraining run's model.* keys (size, pe, layers)")
    for key, shape in ours.items():
        if list(saved[key]) != list(shape):
            raise UserError(f"{part} param {key} has shape {saved[key]} in the checkpoint but {list(shape)} here",
                            WHERE, "use the same model size (model.* keys) as the pretraining run")


def restore(source: InitSource, abstract: dict[str, Any]) -> tuple[dict[str, Any], InitSource]:
    """(the params under the top-level keys of `abstract` ({'encoder': ...} for a fine-tune, every param for a
    continued pretraining: unboxed ShapeDtypeStructs carrying shardings) read from the pretraining checkpoint onto
    those shardings, the source read): `source.step`, or, where a run still training there has deleted that step
    meanwhile and no step was asked for, its newest step then."""

    def read(at: int) -> tuple[dict[str, Any], Any]:
        meta = source.meta if at == source.step else workdir_lib.read_meta(source.workdir, at, WHERE_STEP)
        check_param_shapes(meta, abstract)
        return meta, ckpt_lib.restore_params(source.workdir, at, abstract_params=abstract, where=WHERE_STEP,
                                             where_run=WHERE)

    step, (meta, restored) = workdir_lib.read_kept_step(source.workdir, source.step, read, WHERE,
                                                        follow=source.follow, where_run=WHERE)
    return restored, dataclasses.replace(source, step=step, meta=meta)


def restore_encoder(source: InitSource, abstract_encoder: Any) -> tuple[Any, InitSource]:
    """(`params['encoder']` of the pretraining checkpoint, the source read): `restore` of the encoder alone."""
    restored, source = restore(source, {"encoder": abstract_encoder})
    return restored["encoder"], source


# ------------------------------------------------------------------------------------------------ tokenizer
def adopt_tokenizer(pretrain_workdir: str, workdir: str) -> str:
    """Copy the pretraining run's tokenizer into `workdir/tokenizer/` (process 0) and return the pretraining run's
    vocab.txt path (every process loads that); refuse a different tokenizer already in `workdir`."""
    src_dir = files.join(pretrain_workdir, "tokenizer")
    src = files.join(src_dir, "vocab.txt")
    require(files.isfile(src), f"the pretraining run {pretrain_workdir} has no tokenizer/vocab.txt", WHERE,
            "point init_from at a workdir made by `launch pretrain`")
    dst_dir = files.join(workdir, "tokenizer")
    dst = files.join(dst_dir, "vocab.txt")
    if files.isfile(dst):
        if files.read_text(dst) != files.read_text(src):
            raise UserError(f"{dst} differs from the tokenizer of init_from's run {src}", "--workdir",
                            "use a fresh workdir for a run that starts from another run")
        return src
    if jax.process_index() == 0:   # vocab.txt and, where there is one, tokenizer_config.json
        for name in files.listdir(src_dir):
            files.write_text(files.join(dst_dir, name), files.read_text(files.join(src_dir, name)))
    return src
