"""Checkpoints of `occult.integrations.hf.finetune` while it runs: `CheckpointSaver` (a sharded checkpoint
every `save_every` steps, `occult.integrations.hf.checkpoint`), `resume_state` (a run directory's checkpoint
loaded into the model, optimizer and loop, checked against this run), and `CloseTaps` (the load-balancing
loss's router taps closed when the loop ends)."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn as nn

from occult.integrations.hf import checkpoint as ckpt
from occult.integrations.hf.aux_loss import RouterTaps
from occult.integrations.hf.finetune_config import FinetuneConfig
from occult.training.hooks import StepHook
from occult.training.loop import TrainLoop
from occult.training.schedule import CosineSchedule


class CheckpointSaver(StepHook):
    """A checkpoint every `save_every` steps (not at the run's last step: `finetune` saves that)."""

    def __init__(
        self,
        loop: TrainLoop,
        directory: str | os.PathLike,
        model: nn.Module,
        extra: Callable[[], dict],
        save_every: int,
        last: int,
    ) -> None:
        self.loop, self.directory, self.model, self.extra = loop, directory, model, extra
        self.save_every, self.last = save_every, last

    def save(self, step: int) -> None:
        self.loop.flush()
        ckpt.save_state(
            self.directory,
            self.model,
            self.loop.optimizer,
            step,
            {**self.extra(), "losses": self.loop.losses, "grad_norms": self.loop.norms()},
        )

    def after_step(self, step: int, optimizer: torch.optim.Optimizer | None) -> None:
        if self.save_every and step % self.save_every == 0 and step < self.last:
            self.save(step)


class CloseTaps(StepHook):
    """Closes the router taps of the load-balancing loss when the loop ends."""

    def __init__(self, taps: RouterTaps) -> None:
        self.taps = taps

    def close(self) -> None:
        self.taps.close()


def resume_state(
    loop: TrainLoop,
    model: nn.Module,
    cfg: FinetuneConfig,
    checkpoint_dir: str | os.PathLike,
    sig: dict,
    resume: bool,
    log: Callable[[str], None] | None,
) -> CosineSchedule:
    """Load the run directory's checkpoint into the model, optimizer and loop (when there is one); the schedule."""
    schedule = CosineSchedule(cfg.lr, cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio)
    found = ckpt.find_state(checkpoint_dir)
    if found is not None and not resume:
        raise ckpt.FinetuneCheckpointError(
            f"{checkpoint_dir} already holds a checkpoint ({found.name}): resume it (--resume) or choose another --out"
        )
    if found is None:
        return schedule
    doc = ckpt.read_meta(found)
    ckpt.check_signature(doc.get("signature", {}), sig, str(found))
    start = int(doc["step"])
    if cfg.steps < start:
        raise ckpt.FinetuneCheckpointError(
            f"{found} is at step {start}, past --steps {cfg.steps}; pass --steps {start} "
            "or more to continue it (a larger value continues training)"
        )
    ckpt.load_state(found, doc, model, loop.optimizer)
    loop.step, loop.losses, loop.grad_norms = start, list(doc["losses"]), list(doc["grad_norms"])
    saved_steps = int(doc.get("signature", {}).get("settings", {}).get("steps", cfg.steps))
    schedule = schedule.resumed(doc.get("lr_schedule"), saved_steps, start)
    if log is not None:
        log(f"resumed {found} at step {start}")
    return schedule


__all__ = ["CheckpointSaver", "CloseTaps", "resume_state"]
