"""`python -m launch evaluate`: restore a pretraining checkpoint and score the whole validation split."""
from __future__ import annotations

from typing import Mapping, Optional

import jax

from tupe_jax import data as data_lib
from tupe_jax import metrics as metrics_lib
from tupe_jax import sharding as sharding_lib
from tupe_jax import workdir as workdir_lib
from tupe_jax import xla_options
from tupe_jax.errors import UserError
from tupe_jax.model import TransformerLM
from tupe_jax.pretrain import steps
from tupe_jax.pretrain.loop import validation_batches


def evaluate(workdir: str, step: Optional[int] = None, data: Optional[Mapping[str, str]] = None) -> dict[str, float]:
    """Restore `workdir` at `step` (default latest), evaluate on the whole validation split, log to metrics (not
    while a run is live in that folder: `live_run`). With `data` (`--config.data.*` overrides: another corpus,
    `workdir.corpus_config`) the validation split is that corpus's, and the values are printed, not logged: the
    run's metrics.jsonl records its own corpus."""
    if not data:
        workdir_lib.check_folder(workdir)      # it writes a metrics row: refuse a read-only folder before evaluating
    run = workdir_lib.load_run(workdir, step, data)
    config = run.config
    with config.unlocked():
        config.mesh.data, config.mesh.fsdp, config.mesh.tensor = -1, 1, 1   # any device count can evaluate
    mesh = sharding_lib.make_mesh(config)
    batch_size = int(config.train.batch_size)
    batch_size -= batch_size % jax.device_count() or 0
    batch_size = max(batch_size, jax.device_count())
    if data:     # another corpus: whatever keeps it from being read is the error (not "no validation split")
        batches = data_lib.pretrain_iterator(config, run.tokenizer, split="validation", global_batch_size=batch_size,
                                             seed=0, shuffle=False, repeat=False)
    else:
        batches = validation_batches(config, run.tokenizer, batch_size)
    if batches is None:
        raise UserError(f"the corpus of {workdir} has no validation split", "data.holdout",
                        "set --config.data.holdout>0 when pretraining")
    params = sharding_lib.replicate(run.params, mesh)
    sums = steps.run_eval(xla_options.jit(steps.make_eval_step(TransformerLM(run.model_cfg))), params, batches, mesh, 0)
    values = steps.summarize(sums, run.model_cfg.causal, prefix="eval_")
    if data:
        print(f"{workdir} step {run.step} on --config." + " --config.".join(f"{k}={v}" for k, v in run.corpus.items()) +
              ": " + " | ".join(f"{k} {v:.4f}" for k, v in values.items()) + " (another corpus: not added to the "
              "run's metrics.jsonl)", flush=True)
        return values
    live = live_run(workdir)
    if live is None:
        with metrics_lib.MetricsWriter(workdir) as writer:
            writer.write(run.step, {**values, "split": "validation", "evaluated_tokens": float(sums["weight"])})
    print(f"{workdir} step {run.step}: " + " | ".join(f"{k} {v:.4f}" for k, v in values.items()), flush=True)
    if live is not None:
        print(f"{workdir}: this row is not added to metrics.jsonl: {live}. That run writes the file (in a bucket "
              "by rewriting the object whole, so one of the two writes could drop the other's rows; locally its "
              "rows and this one would interleave, and its resume would drop rows past its checkpoint); evaluate "
              "again once the run has finished to record it", flush=True)
    return values


def live_run(workdir: str) -> Optional[str]:
    """For a workdir whose lock or lease is live (a run is training there): who holds it; else None."""
    try:
        workdir_lib.refuse_if_held(workdir)
    except UserError as err:
        return err.what
    return None
