"""Expert + data parallelism for `OccultLM` over the ranks of a process group.

World of W ranks, expert-parallel degree S (`ep_size`, a divisor of W; default W):

    EP groups       ranks [g*S, (g+1)*S): each holds every expert once, sharded by the placement
                    (`OccultMoE` all-to-alls run inside one EP group)
    replica groups  ranks {j, j+S, j+2S, ...}: they hold the same experts (data-parallel copies)

Dense parameters (embeddings, attention, norms, routers) are replicated on every rank. Every
rank reads its own B/W rows of each global batch of B rows, so with each rank's loss a mean
over its own tokens the global loss is the mean of the ranks' losses, and `sync_gradients`
makes every rank's gradients those of the global loss: replicated gradients are all-reduced
over the world and divided by W; expert gradients already hold the contributions of their EP
group's tokens (the all-to-all carried them back), so they are all-reduced over the replica
group and divided by W. With `wrap_ddp` (`--grad-sync ddp`, the default on N ranks) torch's
`DistributedDataParallel` averages the replicated gradients instead (bucketed all-reduces over
`dense_group`, all ranks in a group of their own, launched during the backward; DDP divides by
its group size W, the same factor) and `sync_gradients(..., replicated=False)` does the experts
alone; DDP ignores the expert parameters and every buffer. With `--grad-sync fsdp`
(`occult.lm.fsdp.wrap_fsdp`) the dense parameters are sharded by FSDP2 instead (gradients
reduce-scattered and averaged over `dense_group`). `clip_grad_norm` clips by the norm of the
whole model (replicated parameters counted once, FSDP shards summed over the dense group, expert
shards summed over the EP group). The load-balancing loss is
computed over the global batch (`OccultLM.set_aux_group`).

`shard_model(full, parallel, placement)` builds this rank's model from a full single-process
one (every rank builds the same full model from the same seed, with `full_model`), so an N-rank run starts from
exactly the weights a single-process run would, and `gathered_tensors` is the inverse, for the
weights files (every rank calls it; rank 0 writes).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from occult.lm.fsdp import full_tensor, is_sharded, local_tensor
from occult.lm.model import OccultLM
from occult.placement import Placement, PlacementError


@dataclass
class Parallel:
    """This rank's place in the world: EP group (experts sharded) x replicas (data parallel)."""

    rank: int
    world_size: int
    ep_size: int
    ep_group: Any
    replica_group: Any
    world_group: Any
    local_group: Any  # this rank alone: build a full single-process model with `group=local_group`
    dense_group: Any = None  # every rank, apart from world_group: DDP's all-reduce of replicated gradients

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep_size

    @property
    def replicas(self) -> int:
        return self.world_size // self.ep_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        dist.barrier(group=self.world_group)


def setup_parallel(ep_size: int | None = None) -> Parallel:
    """Groups for the initialised default process group (every rank must call it)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("setup_parallel needs an initialised process group (occult.distributed.init_distributed)")
    W, rank = dist.get_world_size(), dist.get_rank()
    S = W if ep_size is None else int(ep_size)
    if S < 1 or W % S:
        raise ValueError(f"--ep-size {S} must divide the world size {W}")
    world = dist.group.WORLD
    ep_group = replica_group = None
    for g in range(W // S):  # every rank creates every group, in the same order
        grp = world if S == W else dist.new_group(list(range(g * S, (g + 1) * S)))
        if rank // S == g:
            ep_group = grp
    for j in range(S):
        grp = world if S == 1 else dist.new_group(list(range(j, W, S)))
        if rank % S == j:
            replica_group = grp
    local_group = None
    for r in range(W):
        grp = dist.new_group([r])
        if r == rank:
            local_group = grp
    # DDP's all-reduces get a communicator of their own: they never queue behind the EP all-to-alls
    dense_group = dist.new_group(list(range(W))) if W > 1 else world
    return Parallel(rank, W, S, ep_group, replica_group, world, local_group, dense_group)


def full_model(config, parallel: Parallel | None = None) -> OccultLM:
    """A single-process `OccultLM` (every expert, no communication), even inside a process group."""
    return OccultLM(config, group=parallel.local_group if parallel is not None else None)


def per_layer(placement: Placement, num_layers: int) -> Placement:
    """`placement` with one row per MoE layer (a one-layer placement serves every layer)."""
    return placement.for_layers(num_layers)


def shard_model(full: OccultLM, parallel: Parallel, placement: Placement | None = None, dispatcher: str = "dedup") -> OccultLM:
    """This rank's expert-parallel copy of `full` (same weights; experts by `placement`)."""
    cfg = full.config
    if placement is None:
        placement = Placement.contiguous(cfg.num_experts, parallel.ep_size)
    placement.check_fits(cfg.num_experts, parallel.ep_size)
    placement = per_layer(placement, cfg.num_layers)
    with torch.random.fork_rng(devices=[]):  # the throw-away init must not move this rank's RNG
        model = OccultLM(cfg, placement=placement, group=parallel.ep_group, dispatcher=dispatcher)
    model.to(next(full.parameters()).device)
    experts = model.expert_parameters()
    source = dict(full.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            src = source[name]
            if name in experts:
                src = src[experts[name][1].to(src.device)]
            p.copy_(src)
    spec = full.routing
    if spec.max_devices is not None:
        model.set_routing(spec.max_devices, spec.placement, spec.method, spec.similarity)
    model.set_aux_group(parallel.world_group if parallel.world_size > 1 else None)
    return model


def shard_tensors(model: OccultLM, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full `model.<name>` / `optim.<name>.<key>` tensors (expert-id order) cut to this rank's experts."""
    out = dict(tensors)
    for name, (_, ids) in model.expert_parameters().items():
        for key, t in tensors.items():
            if key == f"model.{name}" or (key.startswith(f"optim.{name}.") and t.dim() > 0):
                out[key] = t[ids.cpu()]
    return out


def gathered_tensors(model: OccultLM) -> dict[str, torch.Tensor]:
    """`model.<name>` for every parameter with every expert, in expert-id order (a collective)."""
    full: dict[str, torch.Tensor] = {}
    for i, m in enumerate(model.moe_layers()):
        full[f"blocks.{i}.moe.moe.gate_up_proj"], full[f"blocks.{i}.moe.moe.down_proj"] = m.gather_experts()
    out = {f"model.{n}": (full[n] if n in full else full_tensor(p.detach())).contiguous().cpu()
           for n, p in model.named_parameters()}
    if model.routing.similarity is not None:
        for i, s in enumerate(model.routing.similarity):
            out[f"routing.similarity.{i}"] = s.detach().to(torch.float32).contiguous().cpu()
    return out


# ------------------------------------------------------------------- gradients
def _split(model: OccultLM) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    experts = {id(p) for p, _ in model.expert_parameters().values()}
    trained = [p for p in model.parameters() if p.requires_grad]
    return [p for p in trained if id(p) not in experts], [p for p in trained if id(p) in experts]


def _all_reduce_grads(params: Iterable[nn.Parameter], group: Any, divide: int, reduce: bool) -> None:
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


def sync_gradients(model: OccultLM, parallel: Parallel, replicated: bool = True) -> None:
    """Every rank's gradients become those of the global-batch loss (see the module docstring).

    `replicated=False`: the expert gradients only (DDP has averaged the replicated ones)."""
    dense, experts = _split(model)
    W = parallel.world_size
    if replicated:
        _all_reduce_grads(dense, parallel.world_group, W, reduce=W > 1)
    _all_reduce_grads(experts, parallel.replica_group, W, reduce=parallel.replicas > 1)


def wrap_ddp(model: OccultLM, parallel: Parallel) -> DistributedDataParallel | None:
    """`model` in torch DDP for its trained replicated parameters; None when it trains none.

    Expert parameters (their gradients are complete on the EP group after the backward
    all-to-all) and every buffer (e.g. the rank's `local_expert_ids`) are ignored by DDP, so
    neither is broadcast from rank 0, and re-placement may move experts in place. Call the
    wrapper for the training forward (DDP's backward hooks fire for that graph only), then
    `sync_gradients(model, parallel, replicated=False)`; everything else uses `model`, whose
    parameter names (checkpoints) are unchanged. No broadcast at wrapping (`init_sync=False`: the
    ranks already hold the same weights, as with the explicit sync); the replicated gradients
    are views into DDP's buckets (`gradient_as_bucket_view`: no second copy).
    """
    if not _split(model)[0]:
        return None
    ignore = list(model.expert_parameters()) + [n for n, _ in model.named_buffers()]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignore)
    group = parallel.dense_group if parallel.dense_group is not None else parallel.world_group
    device = next(model.parameters()).device
    ids = [device.index] if device.type == "cuda" and device.index is not None else None
    return DistributedDataParallel(model, process_group=group, device_ids=ids, init_sync=False,
                                   gradient_as_bucket_view=True, **_no_buffer_sync())


def _no_buffer_sync() -> dict[str, bool]:
    """DDP's switch for buffer broadcasts at every forward, by the name this torch knows
    (`forward_sync_buffers` in torch 2.13, `broadcast_buffers` before, e.g. the GPU image's 2.11)."""
    known = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in known else {"broadcast_buffers": False}


def clip_grad_norm(model: OccultLM, parallel: Parallel, max_norm: float) -> torch.Tensor:
    """Clip by the global gradient norm of the whole model; returns that norm (as torch does).

    Squared norms: replicated gradients once, FSDP shards (DTensor) summed over the dense group,
    expert shards summed over the EP group."""
    dense, experts = _split(model)
    device = next(model.parameters()).device
    sq = [torch.zeros((), dtype=torch.float32, device=device) for _ in range(3)]  # replicated, FSDP shards, experts
    expert_ids = {id(p) for p in experts}
    for p in dense + experts:
        if p.grad is not None:
            i = 2 if id(p) in expert_ids else int(is_sharded(p.grad))
            sq[i] = sq[i] + local_tensor(p.grad).detach().float().pow(2).sum()
    if any(p.grad is not None and is_sharded(p.grad) for p in dense):
        dist.all_reduce(sq[1], group=parallel.dense_group if parallel.dense_group is not None else parallel.world_group)
    if parallel.ep_size > 1:
        dist.all_reduce(sq[2], group=parallel.ep_group)
    total = (sq[0] + sq[1] + sq[2]).sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in dense + experts:
        if p.grad is not None:
            g = local_tensor(p.grad)
            g.mul_(coef.to(g.dtype))
    return total


def global_mean(values: torch.Tensor, parallel: Parallel | None) -> torch.Tensor:
    """Mean over the world's ranks (equal token counts per rank: the global-batch mean)."""
    if parallel is None or parallel.world_size == 1:
        return values
    out = values.detach().clone()
    dist.all_reduce(out, group=parallel.world_group)
    return out / parallel.world_size


__all__ = [
    "Parallel", "full_model", "setup_parallel", "shard_model", "shard_tensors", "gathered_tensors", "sync_gradients",
    "wrap_ddp", "clip_grad_norm", "global_mean", "per_layer",
]
