"""Gradients of the global-batch loss on N ranks: synchronisation and global-norm clipping.

A model's trained parameters fall into two sets: *dense* ones, replicated on every rank (or
sharded by FSDP2: DTensors), and *expert* ones, sharded over the EP group (their gradients
already hold every EP-group rank's contribution after the backward all-to-all). With each
rank's loss a mean over its own B/W rows:

    dense     averaged over the world: by torch DDP during the backward (`wrap_ddp`, on the dense
              group), by `occult.training.bucketed_sync.BucketedSync` during it (recordable), by
              FSDP2's reduce-scatter, or after it by `sync_gradients(replicated=True)` (one
              all-reduce per dtype), each dividing the sum by W
    experts   all-reduced over the replica group (when there are replicas) and divided by W,
              after the backward (`sync_gradients`)

`clip_grad_norm` clips by the norm of the whole model: squared norms of replicated gradients
counted once, of FSDP shards summed over the dense group, of expert shards summed over the EP
group. One process (`parallel=None`) takes the same path without communication.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from occult.training.dtensor import is_sharded, local_tensor
from occult.training.parallel import Parallel


def all_reduce_grads(params: Iterable[nn.Parameter], group: Any, divide: int, reduce: bool) -> None:
    """Sum the gradients over `group` (one flat all-reduce per dtype and device) and divide by
    `divide`; a missing gradient counts as zeros. `reduce=False`: divide only."""
    buckets: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p)
    for ps in buckets.values():
        if not reduce:
            for p in ps:
                p.grad.div_(divide)
            continue
        flat = torch.cat([p.grad.reshape(-1) for p in ps])
        dist.all_reduce(flat, group=group)
        flat.div_(divide)
        offset = 0
        for p in ps:
            n = p.grad.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n


def sync_gradients(
    dense: Sequence[nn.Parameter], experts: Sequence[nn.Parameter], parallel: Parallel, replicated: bool = True
) -> None:
    """Every rank's gradients become those of the global-batch loss (module docstring).

    `replicated=False`: the expert gradients only (DDP or FSDP2 has averaged the dense ones)."""
    W = parallel.world_size
    if replicated:
        all_reduce_grads(dense, parallel.world_group, W, reduce=W > 1)
    all_reduce_grads(experts, parallel.replica_group, W, reduce=parallel.replicas > 1)


def clip_grad_norm(
    dense: Sequence[nn.Parameter], experts: Sequence[nn.Parameter], parallel: Parallel | None, max_norm: float
) -> torch.Tensor:
    """Scale every gradient by min(1, max_norm / global norm) (`max_norm <= 0`: no scaling);
    return the global norm (float32, on the parameters' device)."""
    params = list(dense) + list(experts)
    device = params[0].device
    sq = [torch.zeros((), dtype=torch.float32, device=device) for _ in range(3)]  # replicated, FSDP shards, experts
    expert_ids = {id(p) for p in experts}
    for p in params:
        if p.grad is not None:
            i = 2 if id(p) in expert_ids else int(is_sharded(p.grad))
            sq[i] = sq[i] + local_tensor(p.grad).detach().float().pow(2).sum()
    if parallel is not None and any(p.grad is not None and is_sharded(p.grad) for p in dense):
        dist.all_reduce(sq[1], group=parallel.sync_group)
    if parallel is not None and parallel.ep_size > 1:
        dist.all_reduce(sq[2], group=parallel.ep_group)
    total = (sq[0] + sq[1] + sq[2]).sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in params:
            if p.grad is not None:
                g = local_tensor(p.grad)
                g.mul_(coef.to(g.dtype))
    return total


def wrap_ddp(model: nn.Module, ignore: Iterable[str], parallel: Parallel) -> DistributedDataParallel:
    """`model` in torch DDP on the dense group, the parameters and buffers named in `ignore` left
    alone (experts: each rank its own; buffers such as `local_expert_ids` differ per rank).

    Call the wrapper for the training forward (DDP's backward hooks fire for that graph only);
    everything else uses `model`, whose parameter names are unchanged. No broadcast at wrapping
    (`init_sync=False`: the ranks already hold the same weights); the replicated gradients are
    views into DDP's buckets (`gradient_as_bucket_view`: no second copy)."""
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, list(ignore))
    device = next(model.parameters()).device
    ids = [device.index] if device.type == "cuda" and device.index is not None else None
    return DistributedDataParallel(
        model,
        process_group=parallel.sync_group,
        device_ids=ids,
        init_sync=False,
        gradient_as_bucket_view=True,
        **no_buffer_sync(),
    )


def no_buffer_sync() -> dict[str, bool]:
    """DDP's switch for buffer broadcasts at every forward, by the name this torch knows
    (`forward_sync_buffers` in torch 2.13, `broadcast_buffers` before, e.g. torch 2.11)."""
    known = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in known else {"broadcast_buffers": False}


__all__ = ["all_reduce_grads", "sync_gradients", "clip_grad_norm", "wrap_ddp", "no_buffer_sync"]
