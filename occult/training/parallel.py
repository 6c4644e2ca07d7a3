"""This rank's place in an expert-parallel x data-parallel world (`Parallel`, `setup_parallel`).

World of W ranks, expert-parallel degree S (`ep_size`, a divisor of W; default W):

    EP groups       ranks [g*S, (g+1)*S): each holds every expert once, sharded by the placement
                    (the MoE layers' all-to-alls run inside one EP group)
    replica groups  ranks {j, j+S, j+2S, ...}: they hold the same experts (data-parallel copies)
    dense group     every rank, a communicator apart from the world group: the all-reduces of
                    replicated gradients (DDP) and FSDP2's collectives never queue behind the
                    all-to-alls of the EP group

Every rank reads its own B/W rows of each global batch of B rows, so the global loss is the mean
of the ranks' losses (`global_mean`). Used by `occult.lm` (`occult train`) and
`occult.integrations.hf` (`occult finetune --hf`) alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


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

    @property
    def sync_group(self) -> Any:
        """The group of every rank for gradient all-reduces (the dense group, else the world)."""
        return self.dense_group if self.dense_group is not None else self.world_group

    # the short names `occult.integrations.hf.Groups` had
    @property
    def ep(self) -> Any:
        return self.ep_group

    @property
    def replica(self) -> Any:
        return self.replica_group

    @property
    def ddp(self) -> Any:
        return self.sync_group

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
    dense_group = dist.new_group(list(range(W))) if W > 1 else world
    return Parallel(rank, W, S, ep_group, replica_group, world, local_group, dense_group)


def global_mean(values: torch.Tensor, parallel: Parallel | None) -> torch.Tensor:
    """Mean over the world's ranks (equal token counts per rank: the global-batch mean)."""
    if parallel is None or parallel.world_size == 1:
        return values
    out = values.detach().clone()
    dist.all_reduce(out, group=parallel.world_group)
    return out / parallel.world_size


__all__ = ["Parallel", "setup_parallel", "global_mean"]
