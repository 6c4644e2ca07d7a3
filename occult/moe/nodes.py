"""Nodes of an expert-parallel group: which ranks share a node, and their process groups.

Ranks are node-major, as `Placement.num_nodes` numbers devices: group rank `r = n*G + g` is
GPU `g` of node `n` (G devices per node, M = D/G nodes). Two-level dispatch talks over two
families of subgroups (the shape DeepEP uses):

- node `n`: the G ranks `[n*G, (n+1)*G)`, the fast link (NVLink);
- rail `g`: the M ranks `{n*G + g}`, one per node with the same local index, the slow link (NIC).

`node_groups(group, G)` creates them once per (the group's ranks, G) and caches them.
`dist.new_group` is a collective over the world: when `group` is the world, every rank
creates every node and rail group in the same order; when it is a subgroup (e.g. one
expert-parallel group of several), its members create its subgroups with
`use_local_synchronization=True`, so ranks outside it need not take part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

# (global ranks of the group, devices per node, local synchronisation) -> (default group, NodeGroups)
_CACHE: dict[tuple[tuple[int, ...], int, bool], tuple[Any, NodeGroups]] = {}

SELF, INTRA, INTER = 0, 1, 2  # where a peer is, seen from this rank (`peer_levels`)


def check_devices_per_node(devices_per_node: Any, num_ranks: int, source: str = "devices_per_node") -> int:
    """Return G as an int, or raise a clear error when it is missing or does not divide the group."""
    if devices_per_node is None:
        raise ValueError(
            f"two-level dispatch needs the number of GPUs per node for its {num_ranks} ranks: give the "
            f"layer a Placement with num_nodes (`occult place --nodes M`, or Placement(..., num_nodes=M)), "
            f"or pass dispatcher=TwoLevelDispatcher(group, devices_per_node=G) (under torchrun, "
            f"G = int(os.environ['LOCAL_WORLD_SIZE']))"
        )
    try:
        value = int(devices_per_node)
    except (TypeError, ValueError):
        raise ValueError(f"{source} must be an integer, got {devices_per_node!r}") from None
    if value != devices_per_node or value < 1 or num_ranks % value:
        divisors = [d for d in range(1, num_ranks + 1) if num_ranks % d == 0]
        raise ValueError(
            f"{source}={devices_per_node} must be a positive integer dividing the group's {num_ranks} ranks "
            f"(ranks are node-major: rank n*G + g is GPU g of node n); choose one of {divisors}"
        )
    return value


def peer_levels(num_ranks: int, rank: int, devices_per_node: int) -> list[int]:
    """For each rank of a flat group: SELF, INTRA (same node) or INTER (another node)."""
    node = rank // devices_per_node
    return [SELF if p == rank else INTRA if p // devices_per_node == node else INTER for p in range(num_ranks)]


@dataclass(frozen=True)
class NodeGroups:
    """This rank's node and rail subgroups (None where the subgroup is this rank alone)."""

    node_group: Any
    rail_group: Any
    node: int
    local: int


def _is_world(group: Any) -> bool:
    return group is None or group is dist.group.WORLD


def node_groups(group: Any, devices_per_node: int) -> NodeGroups:
    """This rank's node and rail subgroups of `group` (created on first use, then cached).

    Every rank of `group` must call it, in the same order as its other group creations (when
    `group` is the world, every rank of the job).
    """
    G = devices_per_node
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    local_sync = not _is_world(group)
    key = (ranks, G, local_sync)
    world = dist.group.WORLD
    cached = _CACHE.get(key)
    if cached is not None and cached[0] is world:
        return cached[1]
    me = ranks.index(dist.get_rank())
    num_ranks = len(ranks)
    check_devices_per_node(G, num_ranks)
    node, local = divmod(me, G)
    members = [ranks[n * G : (n + 1) * G] for n in range(num_ranks // G)]
    members += [ranks[g::G] for g in range(G)]
    mine = [members[node], members[num_ranks // G + local]]
    made: dict[tuple[int, ...], Any] = {}
    for sub in members:  # the same order on every rank
        if len(sub) == 1:
            continue
        if local_sync and ranks[me] not in sub:
            continue  # with local synchronisation only members create a group
        grp = dist.new_group(list(sub), use_local_synchronization=local_sync)
        if ranks[me] in sub:
            made[tuple(sub)] = grp
    out = NodeGroups(made.get(tuple(mine[0])), made.get(tuple(mine[1])), node, local)
    for grp, want, what in ((out.node_group, local, "node"), (out.rail_group, node, "rail")):
        if grp is not None and dist.get_rank(grp) != want:
            raise RuntimeError(
                f"{what} group rank {dist.get_rank(grp)} != expected {want}: the group's ranks "
                f"{list(ranks)} must be in ascending order"
            )
    _CACHE[key] = (world, out)
    return out
