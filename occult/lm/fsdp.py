"""Dense parameters of `OccultLM` sharded with torch's FSDP2 (`--grad-sync fsdp`).

`wrap_fsdp(model, parallel)` applies `torch.distributed.fsdp.fully_shard` to every decoder
block and then to the model (the root unit: embeddings, the tied lm head, the final norm) over
a 1-D `DeviceMesh` of `Parallel.dense_group` (every rank, a communicator of its own). The expert
weights are `ignored_params`: expert parallelism already shards them, and after the backward
`sync_gradients(model, parallel, replicated=False)` all-reduces them over the replica groups
as with DDP. Every other parameter (attention, norms, routers, embeddings) becomes a DTensor
sharded on dim 0 over the ranks; FSDP all-gathers it before each block's forward and backward
and reduce-scatters (averages over the W ranks, the factor DDP and the explicit sync use) its
gradient, so each rank holds 1/W of the dense weights, gradients and AdamW state. Parameter
names are unchanged (checkpoints, weights files). After a forward without backward (evaluation)
call `reshard(model)`: FSDP2 leaves the root unit's weights unsharded then.

With bf16 autocast (`--precision bf16`, or auto on CUDA) the blocks also get FSDP2's
`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`: bf16 all-gathers and compute
copies, fp32 gradient reduction and fp32 sharded master weights; autocast stays on for the
experts (plain fp32 parameters).

The helpers make the rest of `occult.lm` indifferent to whether a parameter is sharded:
`full_tensor` (all-gather; a collective, every rank calls it in the same order), `local_tensor`
(this rank's shard) and `like_param` (a full tensor cut to a parameter's shard, no
communication: every rank holds the full tensor).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from occult.lm.model import OccultLM


def is_sharded(t: torch.Tensor) -> bool:
    """Whether `t` is a DTensor (an FSDP-sharded parameter, its gradient or its AdamW state)."""
    return isinstance(t, DTensor)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """`t` whole: all-gathered if it is a DTensor (every rank must call it), else itself.

    FSDP2's layout (sharded on one dim over a 1-D mesh, `torch.chunk` sizes) is gathered with a
    plain `all_gather` of equal padded shards: `DTensor.full_tensor`'s functional collective
    crashed ranks with SIGSEGV over gloo (CUDA tensors on an H200 every time; CPU tensors once in
    a CI run). Other layouts go through `full_tensor`."""
    if not isinstance(t, DTensor):
        return t
    mesh, placements = t.device_mesh, t.placements
    if mesh.ndim != 1 or len(placements) != 1 or not isinstance(placements[0], Shard):
        return t.full_tensor()
    group, dim = mesh.get_group(), placements[0].dim
    world = dist.get_world_size(group)
    local = t.to_local().movedim(dim, 0)
    n = t.shape[dim]
    chunk = -(-n // world)  # every shard padded to the first (largest) one
    padded = local.new_zeros((chunk, *local.shape[1:]))
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat(parts)[:n].movedim(0, dim).contiguous()  # torch.chunk: full shards first


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (in-place updates reach the DTensor), else `t` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def like_param(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A full tensor `t` laid out like parameter `p` (cut to its shard when `p` is a DTensor)."""
    if not isinstance(p, DTensor) or isinstance(t, DTensor) or tuple(t.shape) != tuple(p.shape):
        return t
    return distribute_tensor(t.to(p.device), p.device_mesh, p.placements, src_data_rank=None)


def is_fsdp(model: OccultLM) -> bool:
    """Whether `wrap_fsdp` has sharded `model`'s dense parameters."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def reshard(model: OccultLM) -> None:
    """Free the unsharded dense weights (FSDP2 keeps the root's after a forward without backward,
    e.g. evaluation, so `named_parameters` would name full tensors, not the optimizer's shards)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.reshard()


def wrap_fsdp(model: OccultLM, parallel, param_dtype: torch.dtype | None = None) -> OccultLM:
    """Shard `model`'s dense parameters over every rank with FSDP2 (in place; returns `model`).

    `parallel`: an `occult.lm.parallel.Parallel`. `param_dtype=torch.bfloat16`: FSDP2 mixed
    precision (bf16 compute copies, fp32 reduction). Call it before building the optimizer
    (the dense parameters become new DTensor parameters). A second call does nothing.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if is_fsdp(model):
        return model
    device = next(model.parameters()).device
    group = parallel.dense_group if parallel.dense_group is not None else parallel.world_group
    mesh = DeviceMesh.from_group(group, device.type)
    experts = {p for p, _ in model.expert_parameters().values()}
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype is not None else None)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, ignored_params=experts)
    fully_shard(model, mesh=mesh, mp_policy=mp, ignored_params=experts)
    return model


__all__ = ["wrap_fsdp", "reshard", "is_fsdp", "is_sharded", "full_tensor", "local_tensor", "like_param"]
