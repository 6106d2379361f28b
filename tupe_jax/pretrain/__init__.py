"""Pretraining (`python -m launch pretrain` / `evaluate`): an MLM encoder or a causal LM decoder.

    validate.validate(config, num_devices)   every check before compute (the launcher's validator for pretrain)
    loop.pretrain(config, workdir)           train or resume a run (the loop, top to bottom, over `trainer.Trainer`);
                                             with init_from, continue another run or an import
    evaluate.evaluate(workdir, step)         restore a checkpoint, report validation loss / accuracy / perplexity
    steps                                    the loss of a batch, the eval step, summaries, FLOPs per step
"""
