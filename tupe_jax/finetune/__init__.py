"""Fine-tuning on GLUE and the built-in word-order task (`python -m launch finetune` / `glue-sweep`).

    validate.validate(config, num_devices)   every check before compute (the launcher's validator)
    init_from                                resolve `init_from`, check it fits, restore the encoder (or, for
                                             `pretrain --config.init_from`, every param)
    runner.Runner                            tokenizer, model, batches, prediction and dev/test evaluation
    loop.finetune(config, workdir)           one task, one lr, one seed; resumable; results.json
    sweep.sweep(config, workdir)             tasks x lrs x seeds (TUPE App. B), sweep.json / sweep.md
    scores                                   the GLUE metrics, headline numbers, GLUE average, submission files
"""
