"""Two-level deduplicated dispatch: one copy per destination node across the slow link, then one
per destination GPU inside the node; results pre-reduced at both levels on the way back.

Ranks are node-major (rank n*G + g is GPU g of node n; `occult.moe.nodes`). For a token on rank
(m, g):

1. rail stage (inter-node): one row to the *gateway* (n, g) of every node n holding any of the
   token's experts (its own node included: that row is a copy to itself), carrying the token's
   top-k gates and, per entry, a node-local code `local GPU * E/D + slot` (-1 where the expert
   is on another node). An all-to-all among the M ranks with local index g.
2. node stage (intra-node): the gateway forwards each received row once to every GPU of its node
   holding one of the row's experts (the flat dedup plan, applied to the rows it now holds),
   with those experts' slots and gates.
3. experts run as with flat dedup (gate-weighted, pre-reduced per received row).
4. combine: each GPU returns one row per received row to its gateway over the node link; the
   gateway sums the rows of a (token, node) pair (fp32 accumulation, rounded once to the row
   dtype) and returns ONE row per (token, node) over the rail; the source sums per token.

Backward mirrors it through the same four exchanges (one autograd node each, in the same order
on every rank); input gradients are summed on the gateway before they cross the rail back.

Host syncs: one per layer, as flat dedup. Every rank can compute, for each of its tokens, the
nodes and GPUs it touches, so one all-to-all of a small header (per destination rank: input
status, rows this rank sends to that rank's node, and rows destined to each GPU of that node)
gives every split size of both stages. `sync_free=True` uses fixed capacities (T rows per node,
then M*T per GPU) and needs no count exchange at all.

With one node (G = D) or one GPU per node (G = 1) two levels are one: the dispatcher's route is
then the flat `DedupDispatcher` (still reporting its rows per link), chosen once when it is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from occult.moe.comm import CommStats, exchange
from occult.moe.contract import Capabilities, Dispatcher, Handle, Received, Schedule
from occult.moe.counts import raise_on_bad_status, read_to_host, routing_status
from occult.moe.dispatch import DedupDispatcher
from occult.moe.expert_map import ExpertMap
from occult.moe.gather import gather_gate_weights, gather_rows, sum_rows
from occult.moe.nodes import INTER, INTRA, SELF, node_groups
from occult.moe.plan import DispatchPlan, dedup_plan, static_dedup_plan, trim


@dataclass
class Stage:
    """One level's exchange: its plan, split sizes, group, and this rank's place in it."""

    plan: DispatchPlan
    send_splits: list[int]
    recv_splits: list[int]
    group: Any
    rank: int
    peer_level: list[int]
    stats: CommStats


@dataclass
class TwoLevelHandle(Handle):
    """What combine and backward need from a two-level dispatch."""

    rail: Stage
    node: Stage
    num_tokens: int
    stats: CommStats = field(default_factory=CommStats)


def fanout_plan(
    codes_RK: torch.Tensor, devices_per_node: int, experts_per_device: int, sync_free: bool
) -> DispatchPlan:
    """The gateway's plan: each received row once to every GPU of the node holding its experts.

    `codes_RK` are node-local codes (-1 = an entry on another node). Padding entries are sent to
    a sentinel device G, whose rows come last in the device-major plan and are dropped.
    """
    G, S = devices_per_node, experts_per_device
    dev = codes_RK.device
    sentinel = G * S
    ids_RK = torch.where(codes_RK >= 0, codes_RK, sentinel)
    code = torch.arange(G * S, device=dev)
    device_C = torch.cat([code // S, torch.full((1,), G, dtype=torch.int64, device=dev)])
    slot_C = torch.cat([code % S, torch.full((1,), -1, dtype=torch.int64, device=dev)])
    if sync_free:
        plan = static_dedup_plan(ids_RK, device_C, slot_C, G + 1, S)
        num_rows = G * codes_RK.shape[0]
    else:
        plan = dedup_plan(ids_RK, device_C, slot_C, G + 1)
        num_rows = plan.num_rows  # trimmed by the caller once the counts are known
    return DispatchPlan(
        token_P=plan.token_P[:num_rows],
        entry_PK=plan.entry_PK[:num_rows],
        slot_PK=plan.slot_PK[:num_rows],
        send_counts_D=plan.send_counts_D[:G],
        row_TJ=plan.row_TJ[:, :G].contiguous(),
    )


class TwoLevelDispatcher(Dispatcher):
    """Deduplicated dispatch in two levels: once per node over the rail, once per GPU inside it.

    `devices_per_node` (G) must divide the group size; ranks are node-major. Computes the same
    function as `DedupDispatcher` (to rounding: the node-level partial sums are rounded to the
    row dtype once before they cross the rail). `CommStats` reports inter- and intra-node rows.
    """

    name = "dedup2"
    capabilities = Capabilities(deduplicated=True, two_level=True)

    def __init__(self, group: Any = None, devices_per_node: int | None = None, transport: str = "auto") -> None:
        super().__init__(group, transport="counts")
        if devices_per_node is None and self.num_ranks == 1:
            devices_per_node = 1
        self.set_devices_per_node(devices_per_node)
        G = self.devices_per_node
        self.node, self.local = divmod(self.rank, G)
        self.two_level = G not in (1, self.num_ranks)
        if self.two_level and transport == "host":
            raise ValueError(
                "transport='host' shares one host's memory; the two-level route's rail crosses nodes: use "
                "transport='counts' or 'auto' with dispatcher='dedup2'"
            )
        # one node, or one GPU per node: the flat deduplicated exchange is the whole route
        self.route = NodeStages(self) if self.two_level else DedupDispatcher(group, G, transport)

    def dispatch(
        self,
        x_TH: torch.Tensor,
        weights_TK: torch.Tensor,
        ids_TK: torch.Tensor,
        expert_map: ExpertMap,
        schedule: Schedule = Schedule(),
        status: torch.Tensor | None = None,
        host_status: int = 0,
    ) -> tuple[Received, Handle]:
        """Send rows out in two stages: over the rail to each node's gateway, then inside the node."""
        self.check_schedule(schedule)
        if status is None:
            ids_TK, status = routing_status(weights_TK, ids_TK, expert_map.num_experts)
        if isinstance(self.route, DedupDispatcher):
            return self.route.dispatch(x_TH, weights_TK, ids_TK, expert_map, schedule, status, host_status)
        return self.route.dispatch(x_TH, weights_TK, ids_TK, expert_map, schedule, status)

    def combine(self, y: torch.Tensor, handle: Handle) -> torch.Tensor:
        """Rows back to the gateways, summed per (token, node); one row per node back to the source."""
        return self.route.combine(y, handle)


class NodeStages:
    """The two-level route of a `TwoLevelDispatcher` with G not in (1, D): rail stage, then node stage."""

    def __init__(self, owner: TwoLevelDispatcher) -> None:
        self.owner = owner
        groups = node_groups(owner.group, owner.devices_per_node)
        self.node_group, self.rail_group = groups.node_group, groups.rail_group

    def exchange_header(
        self, nodes_M, devices_D, status, while_waiting=None
    ) -> tuple[list[int], list[int], list[int], list[int]]:
        """One all-to-all of (status, rows to your node, rows for each GPU of your node); one host sync
        (`while_waiting` runs while the host waits for it: `read_to_host`).

        Returns the split sizes of both stages: rail send/recv (per node), node send/recv (per GPU).
        """
        own = self.owner
        M, D, G = own.num_nodes, own.num_ranks, own.devices_per_node
        header_DX = torch.cat(
            [
                status.to(torch.int64).expand(D, 1),
                nodes_M.to(torch.int64).repeat_interleave(G)[:, None],
                devices_D.to(torch.int64).view(M, G).repeat_interleave(G, dim=0),
            ],
            dim=1,
        )
        recv_DX = torch.empty_like(header_DX)
        dist.all_to_all_single(recv_DX, header_DX, group=own.group)
        host = read_to_host(torch.cat([nodes_M.to(torch.int64), recv_DX.reshape(-1)]), while_waiting)
        rail_send, recv = host[:M], [host[M + s * (G + 2) : M + (s + 1) * (G + 2)] for s in range(D)]
        raise_on_bad_status([r[0] for r in recv])
        rail_recv = [recv[m * G + own.local][1] for m in range(M)]
        node_send = [sum(recv[m * G + own.local][2 + g] for m in range(M)) for g in range(G)]
        node_recv = [sum(recv[m * G + g][2 + own.local] for m in range(M)) for g in range(G)]
        return rail_send, rail_recv, node_send, node_recv

    def split_sizes(self, ids_TK, expert_map, plan1, status, schedule):
        """Both stages' split sizes: from shapes alone (sync-free: T rows per node, M*T per GPU) or
        swapped in one header exchange."""
        own = self.owner
        M, G, T = own.num_nodes, own.devices_per_node, ids_TK.shape[0]
        if schedule.sync_free:
            schedule.run_while_waiting()
            return [T] * M, [T] * M, [M * T] * G, [M * T] * G
        used_TD = torch.zeros((T, own.num_ranks), dtype=torch.int64, device=ids_TK.device)
        used_TD.scatter_(1, expert_map.device_E[ids_TK], 1)
        return self.exchange_header(plan1.send_counts_D, used_TD.sum(dim=0), status, schedule.while_waiting)

    def dispatch(self, x_TH, weights_TK, ids_TK, expert_map: ExpertMap, schedule: Schedule, status):
        own = self.owner
        G, M, T = own.devices_per_node, own.num_nodes, ids_TK.shape[0]
        S = expert_map.experts_per_device(own.num_ranks)
        node_map = expert_map.coarsen(G, S)
        if schedule.sync_free:
            plan1 = static_dedup_plan(ids_TK, node_map.device_E, node_map.slot_E, M, S * G)
        else:
            plan1 = dedup_plan(ids_TK, node_map.device_E, node_map.slot_E, M)
        rail_send, rail_recv, node_send, node_recv = self.split_sizes(ids_TK, expert_map, plan1, status, schedule)
        plan1 = trim(plan1, sum(rail_send))
        stats = CommStats()
        rail = Stage(
            plan1,
            rail_send,
            rail_recv,
            self.rail_group,
            own.node,
            [SELF if n == own.node else INTER for n in range(M)],
            stats,
        )
        # 1. rail: one row per (token, node), with the token's gates and node-local expert codes
        x1_RH, gates1_RK, codes1_RK = exchange(
            gather_rows(x_TH, plan1.token_P, plan1.row_TJ),
            gather_gate_weights(weights_TK, plan1.entry_PK),
            plan1.slot_PK,
            rail_send,
            rail_recv,
            rail.group,
            rail,
        )
        # 2. node: the gateway fans each row out once per GPU of its node holding its experts
        plan2 = trim(fanout_plan(codes1_RK, G, S, schedule.sync_free), sum(node_send))
        node = Stage(
            plan2,
            node_send,
            node_recv,
            self.node_group,
            own.local,
            [SELF if g == own.local else INTRA for g in range(G)],
            stats,
        )
        x_RH, gates_RK, slots_RK = exchange(
            gather_rows(x1_RH, plan2.token_P, plan2.row_TJ),
            gather_gate_weights(gates1_RK, plan2.entry_PK),
            plan2.slot_PK,
            node_send,
            node_recv,
            node.group,
            node,
        )
        stats.dispatch_rows = plan1.num_rows + plan2.num_rows
        return Received(x_RH, slots_RK, gates_RK), TwoLevelHandle(rail, node, T, stats)

    def combine(self, y_RH: torch.Tensor, handle: TwoLevelHandle) -> torch.Tensor:
        rail, node = handle.rail, handle.node
        y2_PH, _, _ = exchange(y_RH, None, None, node.recv_splits, node.send_splits, node.group, node)
        y1_RH = sum_rows(y2_PH, node.plan.token_P, node.plan.row_TJ)  # node-level pre-reduction
        y1_PH, _, _ = exchange(y1_RH, None, None, rail.recv_splits, rail.send_splits, rail.group, rail)
        handle.stats.combine_rows = y_RH.shape[0] + y1_RH.shape[0]
        return sum_rows(y1_PH, rail.plan.token_P, rail.plan.row_TJ)
