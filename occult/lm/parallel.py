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
group and divided by W (or, each rank's loss scaled by 1/W before its backward, only summed:
`average=False`, what the trainer does). With `wrap_ddp` (`--grad-sync ddp`, the default on N ranks) torch's
`DistributedDataParallel` reduces the replicated gradients instead (bucketed all-reduces over
`dense_group`, all ranks in a group of their own, launched during the backward; dividing by W,
or `summed`) and `sync_gradients(..., replicated=False)` does the experts
alone; DDP ignores the expert parameters and every buffer. With `--grad-sync fsdp`
(`occult.lm.fsdp.wrap_fsdp`) the dense parameters are sharded by FSDP2 instead (gradients
reduce-scattered and averaged over `dense_group`). `clip_grad_norm` clips by the norm of the
whole model (replicated parameters counted once, FSDP shards summed over the dense group, expert
shards summed over the EP group). The load-balancing loss is
computed over the global batch (`OccultLM.set_aux_group`).

`Parallel`, `setup_parallel` and `global_mean` live in `occult.training.parallel` (re-exported
here); the gradient sync, DDP wrapping and clipping in `occult.training.grads`, which the
functions here call with this model's dense / expert split.

`shard_model(full, parallel, placement)` builds this rank's model from a full single-process
one (every rank builds the same full model from the same seed, with `full_model`), so an N-rank run starts from
exactly the weights a single-process run would, and `gathered_tensors` is the inverse, for the
weights files (every rank calls it; rank 0 writes).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from occult.lm.model import OccultLM
from occult.placement import Placement
from occult.training import grads
from occult.training.dtensor import full_tensor
from occult.training.parallel import Parallel, global_mean, setup_parallel  # noqa: F401  (re-exported)


def full_model(config, parallel: Parallel | None = None) -> OccultLM:
    """A single-process `OccultLM` (every expert, no communication), even inside a process group."""
    return OccultLM(config, group=parallel.local_group if parallel is not None else None)


def per_layer(placement: Placement, num_layers: int) -> Placement:
    """`placement` with one row per MoE layer (a one-layer placement serves every layer)."""
    return placement.for_layers(num_layers)


def shard_model(
    full: OccultLM, parallel: Parallel, placement: Placement | None = None, dispatcher: str = "dedup"
) -> OccultLM:
    """This rank's expert-parallel copy of `full` (same weights; experts by `placement`)."""
    cfg = full.config
    if placement is None:
        placement = Placement.contiguous(cfg.num_experts, parallel.ep_size)
    placement.check_fits(cfg.num_experts, parallel.ep_size)
    placement = per_layer(placement, cfg.num_layers)
    with torch.random.fork_rng(devices=[]):  # (the dense layers' constructors still draw: not from this rank's RNG)
        model = OccultLM(cfg, placement=placement, group=parallel.ep_group, dispatcher=dispatcher, init_weights=False)
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
    out = {
        f"model.{n}": (full[n] if n in full else full_tensor(p.detach())).contiguous().cpu()
        for n, p in model.named_parameters()
    }
    if model.routing.similarity is not None:
        for i, s in enumerate(model.routing.similarity):
            out[f"routing.similarity.{i}"] = s.detach().to(torch.float32).contiguous().cpu()
    return out


# ------------------------------------------------------------------- gradients
def split_trained(model: OccultLM) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(dense, expert) parameters of `model` that train (requires_grad)."""
    experts = {id(p) for p, _ in model.expert_parameters().values()}
    trained = [p for p in model.parameters() if p.requires_grad]
    return [p for p in trained if id(p) not in experts], [p for p in trained if id(p) in experts]


def sync_gradients(model: OccultLM, parallel: Parallel, replicated: bool = True, average: bool = True) -> None:
    """Every rank's gradients become those of the global-batch loss (`occult.training.grads`).

    `replicated=False`: the expert gradients only (DDP has averaged the replicated ones). `average=False`: summed
    only (each rank's loss scaled by `grads.loss_scale` before its backward: no pass over the gradients)."""
    grads.sync_gradients(*split_trained(model), parallel, replicated, average)


def wrap_ddp(model: OccultLM, parallel: Parallel, summed: bool = False) -> DistributedDataParallel | None:
    """`model` in torch DDP for its trained replicated parameters; None when it trains none.

    Expert parameters (their gradients are complete on the EP group after the backward
    all-to-all) and every buffer (e.g. the rank's `local_expert_ids`) are ignored by DDP, so
    neither is broadcast from rank 0, and re-placement may move experts in place. Call the
    wrapper for the training forward, then `sync_gradients(model, parallel, replicated=False)`
    (`occult.training.grads.wrap_ddp`; `summed`: the buckets summed, each rank's loss scaled).
    """
    if not split_trained(model)[0]:
        return None
    ignore = list(model.expert_parameters()) + [n for n, _ in model.named_buffers()]
    return grads.wrap_ddp(model, ignore, parallel, summed)


def clip_grad_norm(model: OccultLM, parallel: Parallel | None, max_norm: float) -> torch.Tensor:
    """Clip by the global gradient norm of the whole model; returns that norm (as torch does).

    Squared norms: replicated gradients once, FSDP shards (DTensor) summed over the dense group,
    expert shards summed over the EP group (`occult.training.grads.clip_grad_norm`)."""
    return grads.clip_grad_norm(*split_trained(model), parallel, max_norm)


__all__ = [
    "Parallel",
    "full_model",
    "setup_parallel",
    "shard_model",
    "shard_tensors",
    "gathered_tensors",
    "sync_gradients",
    "wrap_ddp",
    "clip_grad_norm",
    "global_mean",
    "per_layer",
    "split_trained",
]
