"""Distillation loss shared by occult's fine-tuning adapters (`occult.lm.distill` for OccultLM,
`occult.integrations.hf.finetune` for transformers models): the student's logits against a
teacher's, both softened by a temperature."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

TRAIN_PARTS = ("routers", "experts", "both")  # what a pruning-aware fine-tuning trains


def distill_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 * KL(softmax(teacher / T) || softmax(student / T)), mean over tokens (fp32)."""
    vocab = student_logits.shape[-1]
    s = F.log_softmax(student_logits.float().reshape(-1, vocab) / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.float().reshape(-1, vocab) / temperature, dim=-1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean") * temperature**2


@contextlib.contextmanager
def unlimited(routers: Iterable[Any]) -> Iterator[None]:
    """Every router's device (and node) limit off inside: the plain top-k, the distillation teacher's
    routing; the limits restored after, also on an error. Routers without a limit are left alone."""
    routers = [r for r in routers if hasattr(r, "max_devices")]
    saved = [(r.max_devices, getattr(r, "max_nodes", None)) for r in routers]
    try:
        for r in routers:
            r.max_devices = None
            if hasattr(r, "max_nodes"):
                r.max_nodes = None
        yield
    finally:
        for r, (devices, nodes) in zip(routers, saved):
            r.max_devices = devices
            if hasattr(r, "max_nodes"):
                r.max_nodes = nodes


def teacher_logits(
    logits_of: Callable[[Any], torch.Tensor], model: Any, routers: Iterable[Any], teacher: Any = None
) -> torch.Tensor:
    """The distillation target, no gradient: `logits_of(teacher)`, or without a teacher model
    `logits_of(model)` with `routers` (the model's) unlimited: the same weights, standard routing."""
    with torch.no_grad():
        if teacher is not None:
            return logits_of(teacher)
        with unlimited(routers):
            return logits_of(model)
