"""The learning-rate schedule: linear warm-up, then cosine decay to a floor; extendable on resume.

`CosineSchedule(lr, warmup_steps, steps, min_lr_ratio)`: `lr * (step + 1) / warmup_steps`
during the warm-up, then a cosine from `lr` at `warmup_steps` to `min_lr_ratio * lr` at `steps`
(and the floor after it).

A resumed run may be given another total (`extended(at_step, total)`, e.g. `occult train
--resume --steps N` with a larger N): the rate at the resume step is kept and a new cosine runs
from it to the floor at the new last step (`restarts`; a checkpoint keeps `to_json()` and
`resumed` rebuilds the schedule from it), so the rate
never jumps; a resume inside the warm-up just uses the new total (nothing has decayed yet), and
a finished run continued further stays at the floor. The steps before the resume are unchanged,
so resuming to the old total gives the uninterrupted run exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class CosineSchedule:
    """Warm-up then cosine to `min_lr_ratio * lr` at `steps`; `restarts`: ((step, rate, end), ...)
    where an extended run's decay starts again from `rate` towards the floor at `end`."""

    lr: float
    warmup_steps: int
    steps: int
    min_lr_ratio: float = 0.1
    restarts: tuple[tuple[int, float, int], ...] = ()

    def __post_init__(self) -> None:
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1 or self.warmup_steps < 0 or self.steps < 1:
            raise ValueError(
                f"need lr > 0, 0 <= min_lr_ratio <= 1, warmup_steps >= 0, steps >= 1; got {self.lr}, "
                f"{self.min_lr_ratio}, {self.warmup_steps}, {self.steps}"
            )

    @property
    def total(self) -> int:
        """The last step of the run (the end of the newest decay)."""
        return self.restarts[-1][2] if self.restarts else self.steps

    def __call__(self, step: int) -> float:
        """The learning rate of step `step` (0-based)."""
        floor = self.lr * self.min_lr_ratio
        start = [r for r in self.restarts if r[0] <= step]
        if start:
            at, rate, end = start[-1]
            progress = min(1.0, (step - at) / max(1, end - at))
            return floor + (rate - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        if self.warmup_steps and step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = max(1, self.steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return floor + (self.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def extended(self, at_step: int, total: int) -> CosineSchedule:
        """This schedule continued from `at_step` to a new last step `total` (module docstring)."""
        if total == self.total:
            return self
        if at_step <= self.warmup_steps and not self.restarts:  # nothing has decayed yet
            return CosineSchedule(self.lr, self.warmup_steps, total, self.min_lr_ratio)
        restarts = tuple(r for r in self.restarts if r[0] < at_step) + (
            (int(at_step), float(self(at_step)), int(total)),
        )
        return CosineSchedule(self.lr, self.warmup_steps, self.steps, self.min_lr_ratio, restarts)

    def to_json(self) -> dict:
        """What a checkpoint keeps of an extended schedule (the rest is in the run's settings)."""
        return {"steps": self.steps, "restarts": [[int(s), float(r), int(e)] for s, r, e in self.restarts]}

    def resumed(self, doc: dict | None, saved_total: int, at_step: int) -> CosineSchedule:
        """This run's schedule (with the new total) when resuming a checkpoint at `at_step` whose run had
        `saved_total` steps and whose `to_json()` was `doc` (None: never extended)."""
        old = CosineSchedule(self.lr, self.warmup_steps, int(saved_total), self.min_lr_ratio)
        if doc:
            restarts = tuple((int(s), float(r), int(e)) for s, r, e in doc.get("restarts", []))
            old = CosineSchedule(self.lr, self.warmup_steps, int(doc["steps"]), self.min_lr_ratio, restarts)
        return old.extended(at_step, self.total)


__all__ = ["CosineSchedule"]
