"""Pruning-aware fine-tuning recipes of `occult finetune`: distillation from the unpruned model,
and which MoE parameters train.

Distillation (`TrainConfig.distill_weight` W > 0, `distill_temperature` T): the teacher is the
same weights with standard routing. Every step runs the model twice on the batch: first under
`torch.no_grad()` with every router's device / node limit switched off (`unlimited_routing`:
the plain top-k, the experts where they are), then the pruned forward with the gradient. The
loss is cross-entropy + aux + W * T^2 * KL(teacher || student) of the logits softened by T
(`distill_kl`, mean over tokens), so no second copy of the experts is held; the cost is one more
forward without a backward. The logged loss stays the cross-entropy (comparable with plain
fine-tuning). W = 0 runs no teacher: the step is plain fine-tuning, bit for bit.
`TrainConfig.distill_from` (a checkpoint path) takes another model as the teacher instead, e.g. the
standard-routing fine-tune of the same base (a better target than the base itself): a full copy,
loaded once per run (on N ranks a single-process copy on every rank), frozen, in eval mode.

What trains (`TrainConfig.train_part`): "routers" (the router gates only), "experts" (the expert
weights only), "both" (the MoE blocks, as `moe_only`), or None (today's rule: `moe_only`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from occult.lm.checkpoint import CheckpointError, load_model
from occult.lm.model import OccultLM
from occult.training.distill import TRAIN_PARTS, distill_kl, teacher_logits, unlimited
from occult.training.loop import StepLoss


def part_names(model: OccultLM, part: str) -> list[str]:
    """Names of the parameters `part` trains ("routers", "experts" or "both": the MoE blocks)."""
    if part not in TRAIN_PARTS:
        raise ValueError(f"train part must be one of {TRAIN_PARTS}, got {part!r}")
    names = model.moe_parameter_names()
    experts = set(model.expert_parameters())
    if part == "routers":
        return [n for n in names if ".router." in n]
    if part == "experts":
        return [n for n in names if n in experts]
    return names


def unlimited_routing(model: OccultLM) -> contextlib.AbstractContextManager:
    """Every router's device and node limit off inside (standard top-k routing), restored after."""
    return unlimited(model.routers())


def distilled_loss(
    model: OccultLM,
    forward: Callable[..., Any],
    xy: tuple[torch.Tensor, torch.Tensor],
    aux_coef: float,
    weight: float,
    temperature: float,
    teacher_model: OccultLM | None = None,
) -> StepLoss:
    """One step's loss with a teacher (module docstring): `teacher_model` (another checkpoint, e.g. the
    standard fine-tune: `TrainConfig.distill_from`), else the model itself with standard routing.
    `forward` is the training forward (the model or its DDP wrapper)."""
    teacher = teacher_logits(lambda m: m(xy[0], return_logits=True).logits, model, model.routers(), teacher_model)
    out = forward(*xy, return_logits=True)
    kl = distill_kl(out.logits, teacher, temperature)
    return StepLoss(out.loss + aux_coef * out.aux_loss + weight * kl, out.loss, out.aux_loss)


def load_teacher(path: str, student: OccultLM, device: torch.device, par: Any) -> OccultLM:
    """The frozen teacher of `TrainConfig.distill_from`: a full single-process copy (on N ranks, on every rank)."""
    teacher = load_model(path, device=device, routing=False, group=par.local_group if par is not None else None)
    if teacher.config.vocab_size != student.config.vocab_size:
        raise CheckpointError(
            f"distill_from {path}: its vocabulary has {teacher.config.vocab_size} ids, the model's "
            f"{student.config.vocab_size}: give a checkpoint trained on the same tokenizer"
        )
    teacher.eval().requires_grad_(False)
    return teacher


__all__ = ["TRAIN_PARTS", "part_names", "unlimited_routing", "distill_kl", "distilled_loss", "load_teacher"]
