"""The optimizer occult's trainers build: AdamW on its fused kernels wherever the parameters allow.

AdamW's default on a GPU is its for-each path: several passes over every parameter, gradient and moment a
step, where the fused kernel makes one (what that saves: docs/training.md, "`--captured-step`").
The fused kernel takes floating-point CUDA tensors, FSDP2's sharded ones (DTensors) too (DTensor runs it shard by
shard, where its for-each path dispatches every elementwise operation of every parameter on the host); CPU
parameters keep the for-each path. Sharded and plain parameters stay in groups of their own (the trainers' split).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from occult.training.dtensor import is_sharded


def fusable(params: Iterable[torch.Tensor]) -> bool:
    """Whether a fused optimizer kernel takes these parameters: floating-point tensors on CUDA, all sharded
    (DTensors) or none."""
    params = list(params)
    if not params or len({is_sharded(p) for p in params}) > 1:
        return False
    return all(p.is_cuda and p.is_floating_point() for p in params)


def adamw(groups: list[dict[str, Any]], **hyper: Any) -> torch.optim.AdamW:
    """`torch.optim.AdamW(groups, **hyper)` with every group whose parameters `fusable` takes on the fused
    kernel (the update is AdamW's either way)."""
    fused = [{**g, "fused": True, "foreach": False} if fusable(g["params"]) else g for g in groups]
    return torch.optim.AdamW(fused, **hyper)


__all__ = ["fusable", "adamw"]
