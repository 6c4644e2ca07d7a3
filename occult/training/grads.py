"""Gradients of the global-batch loss on N ranks: synchronisation and global-norm clipping.

A model's trained parameters fall into two sets: *dense* ones, replicated on every rank (or
sharded by FSDP2: DTensors), and *expert* ones, sharded over the EP group (their gradients
already hold every EP-group rank's contribution after the backward all-to-all). With each
rank's loss a mean over its own B/W rows:

    dense     averaged over the world: by torch DDP during the backward (`wrap_ddp`, on the dense
              group), by `occult.training.bucketed_sync.BucketedSync` during it (recordable), by
              FSDP2's reduce-scatter, or after it by `sync_gradients(replicated=True)` (one
              all-reduce per dtype for the small gradients, one each for the large ones where they
              lie: `all_reduce_in_place`), each dividing the sum by W
    experts   all-reduced over the replica group (when there are replicas) and divided by W,
              after the backward (`sync_gradients`)

Dividing is a pass over every gradient (an OLMoE-shape rank's expert gradients are GBs). A trainer can scale
each rank's loss by `loss_scale` (1/W) before the backward instead and only sum (`sync_gradients(average=False)`,
`BucketedSync(divide=1)`, `wrap_ddp(summed=True)`): the sums are then the averages, with no pass (the same bits
where W is a power of two: scaling by a power of two is exact). FSDP2 divides for itself.

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

IN_PLACE_BYTES = 25 * 2**20  # a gradient this large is all-reduced where it lies (DDP's bucket size)


def all_reduce_grads(params: Iterable[nn.Parameter], group: Any, divide: int, reduce: bool) -> None:
    """Sum the gradients over `group` (`all_reduce_in_place`, per dtype and device) and divide by
    `divide`; a missing gradient counts as zeros. `reduce=False`: divide only."""
    buckets: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p)
    for ps in buckets.values():
        if reduce:
            all_reduce_in_place([p.grad for p in ps], group, divide)
        elif divide != 1:
            for p in ps:
                p.grad.div_(divide)


def all_reduce_in_place(tensors: Sequence[torch.Tensor], group: Any, divide: int = 1) -> None:
    """Sum `tensors` (one dtype and device) over `group` and divide them by `divide`, in place: each contiguous
    one of at least `IN_PLACE_BYTES` by an all-reduce of its own where it lies (an embedding's or LM head's
    gradient is GBs: copying it out and back would move it four times), the others flattened into one
    all-reduce and copied back (one collective for the many small ones)."""
    large = [t for t in tensors if t.is_contiguous() and t.numel() * t.element_size() >= IN_PLACE_BYTES]
    chosen = {id(t) for t in large}
    small = [t for t in tensors if id(t) not in chosen]
    for t in large:
        dist.all_reduce(t, group=group)
        if divide != 1:
            t.div_(divide)
    if not small:
        return
    flat = torch.cat([t.reshape(-1) for t in small])
    dist.all_reduce(flat, group=group)
    if divide != 1:
        flat.div_(divide)
    offset = 0
    for t in small:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


def sync_gradients(
    dense: Sequence[nn.Parameter],
    experts: Sequence[nn.Parameter],
    parallel: Parallel,
    replicated: bool = True,
    average: bool = True,
) -> None:
    """Every rank's gradients become those of the global-batch loss (module docstring).

    `replicated=False`: the expert gradients only (DDP or FSDP2 has averaged the dense ones). `average=False`:
    summed, not divided (each rank's loss was scaled by `loss_scale(parallel)` before its backward)."""
    W = parallel.world_size
    divide = W if average else 1
    if replicated:
        all_reduce_grads(dense, parallel.world_group, divide, reduce=W > 1)
    all_reduce_grads(experts, parallel.replica_group, divide, reduce=parallel.replicas > 1)


def loss_scale(parallel: Parallel | None) -> float:
    """What a rank's loss is multiplied by before its backward so that `sync_gradients(..., average=False)` (and
    `BucketedSync(..., divide=1)`) leave the global-batch mean's gradients: 1/W (module docstring)."""
    return 1.0 if parallel is None else 1.0 / parallel.world_size


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


def wrap_ddp(
    model: nn.Module, ignore: Iterable[str], parallel: Parallel, summed: bool = False
) -> DistributedDataParallel:
    """`model` in torch DDP on the dense group, the parameters and buffers named in `ignore` left
    alone (experts: each rank its own; buffers such as `local_expert_ids` differ per rank).

    Call the wrapper for the training forward (DDP's backward hooks fire for that graph only);
    everything else uses `model`, whose parameter names are unchanged. No broadcast at wrapping
    (`init_sync=False`: the ranks already hold the same weights); the replicated gradients are
    views into DDP's buckets (`gradient_as_bucket_view`: no second copy). `summed`: DDP's buckets
    summed, not divided (each rank's loss scaled by `loss_scale` before its backward: module docstring)."""
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, list(ignore))
    device = next(model.parameters()).device
    ids = [device.index] if device.type == "cuda" and device.index is not None else None
    ddp = DistributedDataParallel(
        model,
        process_group=parallel.sync_group,
        device_ids=ids,
        init_sync=False,
        gradient_as_bucket_view=True,
        **no_buffer_sync(),
    )
    if summed:
        ddp.register_comm_hook(parallel.sync_group, _summed_bucket)
    return ddp


def _summed_bucket(group, bucket):  # (unannotated: DDP checks a hook's annotations against its own types)
    """DDP's all-reduce of a bucket without its division (a comm hook, a `dist.GradBucket` in, a future of the
    reduced buffer out: DDP then divides nothing itself)."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def no_buffer_sync() -> dict[str, bool]:
    """DDP's switch for buffer broadcasts at every forward, by the name this torch knows
    (`forward_sync_buffers` in torch 2.13, `broadcast_buffers` before, e.g. torch 2.11)."""
    known = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in known else {"broadcast_buffers": False}


__all__ = [
    "all_reduce_grads",
    "all_reduce_in_place",
    "sync_gradients",
    "loss_scale",
    "clip_grad_norm",
    "wrap_ddp",
    "no_buffer_sync",
]
