"""Whether a model's MoE layers compute the same training step with their training calls replayed
(`hf.compile_layers(train_graphs=True)`, `occult.moe.train_graphs`) as with every layer eager.

A replay that reads or writes memory it should not gives wrong gradients. A benchmark's timing does not
show that, and neither do the losses of a few low-learning-rate steps (docs/training.md, "The workspace
that moved": the replays trained on corrupted activations through several published timings). The check
runs one training step on one batch twice, without an update: first with the replays, then with every
MoE layer eager. It reports the relative L2 error of every parameter's gradient, the worst over
parameters and ranks. Every rank calls it at the same point (the eager step's all-to-alls are collectives).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn as nn

from occult.moe.layer import OccultMoE


def replayed_layers(model: nn.Module) -> list[OccultMoE]:
    """The MoE layers of `model` set to replay their training calls."""
    return [m for m in model.modules() if isinstance(m, OccultMoE) and m.execution.graphs and m.execution.train_graphs]


def gradients(model: nn.Module, step: Callable[[], None]) -> dict[str, torch.Tensor]:
    """Each parameter's gradient after `step()` (a forward and backward) from zero."""
    model.zero_grad(set_to_none=True)
    step()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def relative_error(got: torch.Tensor | None, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in fp32 (0 when both are zero); inf when `got` is missing or not finite."""
    if got is None:
        return math.inf
    diff = float((got.float() - want.float()).norm())
    norm = float(want.float().norm())
    if not math.isfinite(diff):
        return math.inf
    return diff / norm if norm > 0 else (0.0 if diff == 0 else math.inf)


def replay_check(model: nn.Module, step: Callable[[], None], tol: float) -> dict | None:
    """The gradients of `step()` with the replays against those with every MoE layer eager (module
    docstring): {"max_rel_err", "worst_param" (on this rank), "passed"}; None where no layer replays
    its training calls. The layers' settings are restored, their recordings released (made again at their next
    calls), and the gradients left at None."""
    layers = replayed_layers(model)
    if not layers:
        return None
    replayed = gradients(model, step)
    settings = [layer.execution for layer in layers]
    try:
        for layer in layers:
            layer.graphs.release()  # the eager step beside the recordings might not fit (recorded again on use)
            layer.execution = replace(layer.execution, train_graphs=False)
        eager = gradients(model, step)
    finally:
        for layer, execution in zip(layers, settings):
            layer.execution = execution
        model.zero_grad(set_to_none=True)
    errors = {name: relative_error(replayed.get(name), want) for name, want in eager.items()}
    errors.update({name: math.inf for name in replayed.keys() - eager.keys()})
    worst_param = max(errors, key=errors.get, default="")
    worst = errors.get(worst_param, 0.0)
    if dist.is_initialized():
        device = next(model.parameters()).device
        t = torch.tensor([worst], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        worst = float(t)
    return {"max_rel_err": worst, "worst_param": worst_param, "passed": worst <= tol}
