"""`python -m launch import-hf --from=DIR --workdir=RUN`, `python -m launch import-fairseq --from=DIR
--workdir=RUN` and `python -m launch export --workdir=RUN --out=DIR`.

The launcher side of `tupe_jax.interop`: import-hf builds the base config of the imported run from
configs/pretrain.py (pe=bert_a, size=tiny presets for everything the checkpoint does not define: train, data,
mesh, checkpoint) and hands it to the library, which never reads configs/.
"""
from __future__ import annotations

import argparse
import os

from tupe_jax.errors import UserError

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
PRETRAIN_CONFIG = os.path.join(CONFIGS, "pretrain.py")


def _one_workdir(args: argparse.Namespace) -> str:
    workdirs = args.workdir if isinstance(args.workdir, list) else [args.workdir]
    if len(workdirs) != 1:
        raise UserError(f"{args.command} takes one --workdir, got {len(workdirs)}", "--workdir", "give it once")
    return workdirs[0]


def import_hf(args: argparse.Namespace) -> str:
    from tupe_jax import config as config_lib
    from tupe_jax.interop import hf
    if not args.source:
        raise UserError("import-hf needs --from", "--from", "give the Hugging Face model folder: --from=DIR")
    base = config_lib.load_config(f"{PRETRAIN_CONFIG}:pe=bert_a,size=tiny,objective=mlm")
    return print_finetune_hint(hf.import_hf(args.source, _one_workdir(args), base))


def import_fairseq(args: argparse.Namespace) -> str:
    from tupe_jax import config as config_lib
    from tupe_jax.interop import fairseq
    if not args.source:
        raise UserError("import-fairseq needs --from", "--from",
                        "give the extracted checkpoint folder (the .pt, dict.txt, bpe-code): --from=DIR")
    base = config_lib.load_config(f"{PRETRAIN_CONFIG}:pe=tupe_r,size=tiny,objective=mlm")
    return print_finetune_hint(fairseq.import_fairseq(args.source, _one_workdir(args), base))


def finetune_arguments(run: str) -> list[str]:
    """The `launch finetune` arguments for the run `run`: the fine-tune takes its model keys from `init_from`
    (`tupe_jax.finetune.init_from.adopt_model_keys`), so none are repeated."""
    return ["--config=configs/glue.py:task=TASK", f"--config.init_from={run}"]


def print_finetune_hint(run: str) -> str:
    """Print the fine-tune command for the imported run `run`."""
    print("fine-tune it: python -m launch finetune " + " ".join(finetune_arguments(run))
          + " --workdir=OUT --config.data.glue_dir=GLUE", flush=True)
    return run


def export(args: argparse.Namespace) -> str:
    from tupe_jax.interop import export as export_lib
    if not args.out:
        raise UserError("export needs --out", "--out", "give a new folder for the export: --out=DIR")
    return export_lib.export(_one_workdir(args), args.out, args.step)
