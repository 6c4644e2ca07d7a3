"""What runs beside the step loop at fixed points: the one place for re-placement and other hooks.

A `StepHook` is called by `occult.training.loop.TrainLoop` on every rank in the same order:
`start()` before the first step, `after_step(step, optimizer)` after every optimizer step
(`step` counts the steps done), `close()` when the loop ends, also on an error. Hooks may
communicate (every rank reaches the same call), read or change the optimizer (re-placement
moves expert weights and their AdamW state: `occult.lm.replace.Replacer`), or end the run early
through the loop they were given (`TrainLoop.stop`). The adapters' evaluation and checkpoint
hooks (`occult.lm.train`, `occult.integrations.hf.finetune`) are hooks too, run after the others.
"""

from __future__ import annotations

import torch


class StepHook:
    """A no-op hook; subclasses override what they need (module docstring)."""

    def start(self) -> None:
        """Called once before the first step of the loop."""

    def after_step(self, step: int, optimizer: torch.optim.Optimizer | None) -> None:
        """Called after every optimizer step; `step` is the number of steps done."""

    def close(self) -> None:
        """Called once when the loop ends (also when it raised)."""


__all__ = ["StepHook"]
