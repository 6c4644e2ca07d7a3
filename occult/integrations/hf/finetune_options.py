"""How the steps of a transformers fine-tune (`occult.integrations.hf.finetune`) execute, and what each way needs,
checked before anything changes (a `ValueError` naming the setting): the whole step recorded (`captured_step`), two
interleaved halves (`two_batch`), accumulated micro-batches, in turn or paired (`micro_batches`,
`pair_micro_batches`); the threaded ways switch the MoE layers to sync-free dispatch (two exchanges in flight cannot
share the device transport's buffers). `loop_settings`: the training loop's settings of a run."""

from __future__ import annotations

import torch.nn as nn

from occult.integrations.hf.finetune_config import FinetuneConfig
from occult.moe.model_layers import set_sync_free
from occult.training.accumulation import check_paired
from occult.training.loop import LoopSettings
from occult.training.parallel import Parallel
from occult.training.step_graph import check_capturable
from occult.training.two_batch import check_two_batch


def loop_settings(cfg: FinetuneConfig, progress: bool | None, main: bool) -> LoopSettings:
    """The loop's settings of a fine-tuning run: its steps, clipping, global tokens a step, and how a step runs."""
    return LoopSettings(
        cfg.steps,
        cfg.grad_clip,
        cfg.batch_size * cfg.seq_len,
        "finetune (routers + experts)",
        progress,
        main,
        captured_step=cfg.captured_step,
        two_batch=cfg.two_batch,
        micro_batches=cfg.micro_batches,
        paired=cfg.pair_micro_batches,
    )


def check_captured_step(cfg: FinetuneConfig, model: nn.Module) -> None:
    """`captured_step`: not with `layer_graphs` (the layers are recorded inside the step), and what the training
    core cannot record (`check_capturable`); a `ValueError` before anything changes."""
    if cfg.captured_step:
        if cfg.layer_graphs:
            raise ValueError("captured_step records every MoE layer inside the step: set layer_graphs=False")
        check_capturable(model)


def prepare_two_batch(cfg: FinetuneConfig, model: nn.Module, groups: Parallel | None) -> None:
    """`two_batch`: not with `layer_graphs` (two halves in flight would share a layer's recorded calls) or
    distillation (the teacher runs a forward of its own), an even number of rows per rank; then every MoE layer
    sync-free (two exchanges in flight cannot share the device transport's buffers). A `ValueError` first."""
    if not cfg.two_batch:
        return
    if cfg.layer_graphs or cfg.distill_weight > 0:
        raise ValueError(
            "two_batch does not run with " + ("layer_graphs" if cfg.layer_graphs else "distillation (distill_weight)")
        )
    rows = cfg.batch_size // (groups.world_size if groups is not None else 1)
    if rows % 2:
        raise ValueError(f"two_batch splits each rank's {rows} rows in halves: give an even number of rows per rank")
    set_sync_free(model)
    check_two_batch(model, rows)


def prepare_micro_batches(cfg: FinetuneConfig, model: nn.Module, groups: Parallel | None) -> None:
    """`micro_batches` > 1: dividing each rank's rows, not with `two_batch`; paired also not with `layer_graphs` or
    distillation (as two_batch), then every MoE layer sync-free. A `ValueError` first."""
    count = cfg.micro_batches
    if count == 1:
        return
    rows = cfg.batch_size // (groups.world_size if groups is not None else 1)
    if rows % count:
        raise ValueError(
            f"micro_batches {count} split each rank's {rows} rows: give a batch of a multiple of {count} rows per rank"
        )
    if cfg.two_batch:
        raise ValueError("micro_batches and two_batch both split the step: choose one")
    if not cfg.pair_micro_batches:
        return
    if cfg.layer_graphs or cfg.distill_weight > 0:
        raise ValueError(
            "pair_micro_batches does not run with "
            + ("layer_graphs" if cfg.layer_graphs else "distillation (distill_weight)")
        )
    set_sync_free(model)
    check_paired(model, count)


__all__ = ["check_captured_step", "loop_settings", "prepare_micro_batches", "prepare_two_batch"]
