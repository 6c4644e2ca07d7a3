"""FSDP2-sharded tensors (DTensors) seen by the training core: whole, local or laid out like a parameter.

`is_sharded` (a DTensor: an FSDP-sharded parameter, its gradient or its AdamW state),
`full_tensor` (all-gather; a collective, every rank calls it in the same order), `local_tensor`
(this rank's shard) and `like_param` (a full tensor cut to a parameter's shard, no communication:
every rank holds the full tensor). Clipping, checkpoints and weights files use them so that they
are indifferent to whether a parameter is sharded. (Moved here from `occult.lm.fsdp`, which
re-exports them.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, distribute_tensor


def is_sharded(t: torch.Tensor) -> bool:
    """Whether `t` is a DTensor (an FSDP-sharded parameter, its gradient or its AdamW state)."""
    return isinstance(t, DTensor)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """`t` whole: all-gathered if it is a DTensor (every rank must call it), else itself.

    FSDP2's layout (sharded on one dim over a 1-D mesh, `torch.chunk` sizes) is gathered with a
    plain `all_gather` of equal padded shards: `DTensor.full_tensor`'s functional collective
    crashed ranks with SIGSEGV over gloo (docs/training.md). Other layouts go through
    `full_tensor`."""
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


__all__ = ["is_sharded", "full_tensor", "local_tensor", "like_param"]
