"""The flat dispatchers: `StandardDispatcher` (one row per (token, expert)) and `DedupDispatcher`
(one row per (token, device)); they differ only in the plan (`occult.moe.plan`).

`dispatch` plans the rows, swaps the counts (`occult.moe.counts`: the one host wait; rows,
gates and packed metadata are gathered before it, so after it only the all-to-alls and the
experts are launched) and sends rows with their slots and gates (`occult.moe.comm.exchange`:
one autograd node). `combine` returns one row per received row and sums each token's rows.
Backward sends as many rows as forward: gradient rows retrace both all-to-alls in reverse, and
the gate gradients (k scalars per row) return with the dispatch's backward. On a group of one
rank every schedule is the identity of `occult.moe.local`: no plan, no copies, no host wait.
For a decode-sized batch on a GPU the plan and the routing status (sync-free: the fixed-capacity
plan) come from one launch (`occult.moe.plan.routed_plan`). With the device transport (`occult.moe.symm`, chosen once
when the dispatcher is built: `transport="device"`, NCCL groups of one host), the plain schedule runs over it
(`occult.moe.device_exchange`): the counts stay on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from occult.moe import device_exchange, local
from occult.moe import status as pending
from occult.moe.comm import CommStats, exchange
from occult.moe.contract import Capabilities, Dispatcher, Handle, Received, Schedule
from occult.moe.counts import STATUS_OVER_CAPACITY, clamp_ids, exchange_counts, routing_status
from occult.moe.expert_map import ExpertMap
from occult.moe.gather import gather_early, gather_gate_weights, gather_rows, sum_rows
from occult.moe.plan import (
    HEADER_DROPPED,
    DispatchPlan,
    bounded_dedup_plan,
    bounded_rows,
    bounded_splits,
    dedup_plan,
    header_rows,
    routed_plan,
    routed_slots,
    standard_plan,
    static_dedup_plan,
    static_standard_plan,
    trim,
)


@dataclass
class FlatHandle(Handle):
    """What combine and the backward pass need from a flat dispatch."""

    plan: DispatchPlan
    send_splits: list[int]
    recv_splits: list[int]
    num_tokens: int
    rank: int
    stats: CommStats = field(default_factory=CommStats)
    peer_level: list[int] | None = None  # per rank: 0 self, 1 same node, 2 other node (None: unknown)


class FlatDispatcher(Dispatcher):
    """One all-to-all each way over the whole group; subclasses choose the plan (`plan_rows`)."""

    def plan_rows(self, ids_TK: torch.Tensor, expert_map: ExpertMap, sync_free: bool) -> DispatchPlan:
        """The rows to send: compact (capacity-sized, trimmed once the counts are known) or, when
        `sync_free`, in fixed-capacity form (sizes from shapes alone)."""
        raise NotImplementedError

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
        self.check_schedule(schedule)
        if self.num_ranks == 1:  # nothing to send
            return self.dispatch_local(x_TH, weights_TK, ids_TK, expert_map, schedule, status)
        bound = self.sync_free_bound(x_TH.shape[0], schedule)  # rows for each other rank, None: T (unbounded)
        # the plan and the routing status (none when sync-free) of one launch, for a decode-sized batch
        routed = (
            None
            if status is not None or bound is not None
            else routed_plan(
                ids_TK,
                weights_TK,
                expert_map.device_E,
                expert_map.slot_E,
                self.num_ranks,
                self.capabilities.deduplicated,
                schedule.sync_free,
            )
        )
        if routed is not None:
            plan, status = routed
        else:
            ids_TK, status = checked_ids(weights_TK, ids_TK, expert_map, schedule, status)
            if bound is None:
                plan = self.plan_rows(ids_TK, expert_map, schedule.sync_free)
            else:
                plan = self.bounded_plan(ids_TK, expert_map, bound)
        if self.uses_device_transport(schedule):
            return device_exchange.dispatch_device(
                self,
                x_TH,
                weights_TK,
                plan,
                status,
                host_status,
                schedule,
                expert_map.experts_per_device(self.num_ranks),
            )
        if schedule.sync_free:
            early = (None, None, None)
            send = recv = (
                [plan.num_rows // self.num_ranks] * self.num_ranks
                if bound is None
                else bounded_splits(x_TH.shape[0], self.num_ranks, self.rank, bound)
            )
            schedule.run_while_waiting()
        else:
            early = gather_early(x_TH, weights_TK, plan)
            send, recv = exchange_counts(plan.send_counts_D, status, self.group, schedule.while_waiting)
            num_rows = sum(send)
            plan = trim(plan, num_rows)
            early = tuple(t[:num_rows] for t in early)
        # (CommStats() given explicitly: torch.compile cannot trace the dataclass default_factory call)
        handle = FlatHandle(plan, send, recv, x_TH.shape[0], self.rank, CommStats(), self.peer_level)
        gates_PK = gather_gate_weights(weights_TK, plan.entry_PK, early[1])
        x_RH, gates_RK, slots_RK = exchange(
            gather_rows(x_TH, plan.token_P, plan.row_TJ, early[0]),
            gates_PK,
            plan.slot_PK,
            send,
            recv,
            self.link,
            handle,
            early[2],
        )
        handle.stats.dispatch_rows = plan.num_rows
        if bound is not None:  # (after the exchange: what every rank's block header says)
            self.queue_bounded_status(plan, slots_RK, x_TH.shape[0], bound, schedule)
        return Received(x_RH, slots_RK, gates_RK), handle

    def combine(self, y: Any, handle: Handle) -> torch.Tensor:
        if isinstance(handle, local.LocalHandle):
            return local.combine_local(y, handle)
        if isinstance(handle, device_exchange.DeviceHandle):
            return device_exchange.combine_device(y, handle)
        handle.stats.combine_rows = y.shape[0]
        y_PH, _, _ = exchange(y, None, None, handle.recv_splits, handle.send_splits, self.link, handle)
        return sum_rows(y_PH, handle.plan.token_P, handle.plan.row_TJ)

    def dispatch_local(
        self,
        x_TH: torch.Tensor,
        weights_TK: torch.Tensor,
        ids_TK: torch.Tensor,
        expert_map: ExpertMap,
        schedule: Schedule,
        status: torch.Tensor | None,
    ) -> tuple[Received, Handle]:
        """The one-rank schedule (`occult.moe.local`), the slots and the status of one launch where it can."""
        routed = None if status is not None else routed_slots(ids_TK, weights_TK, expert_map.slot_E, schedule.sync_free)
        slots_TK = None
        if routed is not None:
            slots_TK, status = routed[0], None if schedule.sync_free else routed[1]
        else:
            ids_TK, status = checked_ids(weights_TK, ids_TK, expert_map, schedule, status)
        return local.dispatch_local(
            x_TH, weights_TK, ids_TK, expert_map, schedule, status, self.capabilities.deduplicated, slots_TK
        )

    def sync_free_bound(self, num_tokens: int, schedule: Schedule) -> int | None:
        """The rows a sync-free call reserves for each other rank where `sync_free_capacity` bounds them below
        its token count, else None (blocks of T rows: every routing fits)."""
        if not schedule.sync_free or schedule.sync_free_capacity >= 1:
            return None
        rows = bounded_rows(num_tokens, schedule.sync_free_capacity)
        return rows if rows < num_tokens else None

    def bounded_plan(self, ids_TK: torch.Tensor, expert_map: ExpertMap, bound: int) -> DispatchPlan:
        """`bounded_dedup_plan` (what it drops travels in its blocks' header rows: `bounded_status`)."""
        maps = (expert_map.device_E, expert_map.slot_E)
        return bounded_dedup_plan(ids_TK, maps, self.num_ranks, self.rank, bound)[0]

    def queue_bounded_status(
        self, plan: DispatchPlan, slots_RK: torch.Tensor, num_tokens: int, bound: int, schedule: Schedule
    ) -> None:
        """Queue `bounded_status` of a bounded call's exchange (read by `check_routing()`, or after a replay of a
        captured forward or step, as a `RoutingError`): the same on every rank, after the same call."""
        status_D = bounded_status(plan.slot_PK, slots_RK, num_tokens, self.num_ranks, self.rank, bound)
        pending.queue_later(status_D, schedule.status_sink_1)

    def uses_device_transport(self, schedule: Schedule) -> bool:
        """Whether this call runs over the device transport: the plain schedule, where the group has it."""
        return self.transport is not None and not schedule.sync_free

    def rows_per_token(self, top_k: int, num_ranks: int, experts_per_device: int) -> tuple[int, int]:
        """(rows one token can send to one rank, rows one token can send in all): the bounds the
        device transport sizes its buffers by."""
        if self.capabilities.deduplicated:
            return 1, min(top_k, num_ranks)
        return min(top_k, experts_per_device), top_k


def bounded_status(
    slot_PK: torch.Tensor, slots_RK: torch.Tensor, num_tokens: int, num_devices: int, rank: int, remote_rows: int
) -> torch.Tensor:
    """[D] `STATUS_OVER_CAPACITY` for each rank that dropped copies in a bounded call, else 0: this rank by the
    header rows it sent (`slot_PK`), every other rank by the header row of its block received here (`slots_RK`).
    Blocks to and from each rank have the same sizes (`bounded_splits`), so one set of header rows serves both."""
    ranks_D = torch.arange(num_devices, device=slot_PK.device)
    mine_D = ranks_D == rank
    header_D = torch.where(mine_D, 0, header_rows(num_tokens, num_devices, rank, remote_rows, slot_PK.device))
    sent_D = (slot_PK[header_D, 0] == HEADER_DROPPED) & ~mine_D
    got_D = (slots_RK[header_D, 0] == HEADER_DROPPED) & ~mine_D
    return torch.where(got_D | mine_D & sent_D.any(), STATUS_OVER_CAPACITY, 0)


def checked_ids(
    weights_TK: torch.Tensor,
    ids_TK: torch.Tensor,
    expert_map: ExpertMap,
    schedule: Schedule,
    status: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(ids clamped into range, the routing status): as given where a status came (its ids are
    clamped), else made (`routing_status`); sync-free reports nothing (status None)."""
    if status is not None:
        return ids_TK, status
    if schedule.sync_free:
        return clamp_ids(ids_TK, expert_map.num_experts), None
    return routing_status(weights_TK, ids_TK, expert_map.num_experts)


class StandardDispatcher(FlatDispatcher):
    """The baseline every framework ships: one copy per (token, expert)."""

    name = "standard"
    capabilities = Capabilities(deduplicated=False)

    def plan_rows(self, ids_TK: torch.Tensor, expert_map: ExpertMap, sync_free: bool) -> DispatchPlan:
        if sync_free:
            return static_standard_plan(
                ids_TK,
                expert_map.device_E,
                expert_map.slot_E,
                self.num_ranks,
                expert_map.experts_per_device(self.num_ranks),
            )
        return standard_plan(ids_TK, expert_map.device_E, expert_map.slot_E, self.num_ranks)


class DedupDispatcher(FlatDispatcher):
    """Occult's: one copy per (token, device), local experts pre-reduced before the return trip."""

    name = "dedup"
    capabilities = Capabilities(deduplicated=True, bounded_rows=True)

    def plan_rows(self, ids_TK: torch.Tensor, expert_map: ExpertMap, sync_free: bool) -> DispatchPlan:
        if sync_free:
            return static_dedup_plan(
                ids_TK,
                expert_map.device_E,
                expert_map.slot_E,
                self.num_ranks,
                expert_map.experts_per_device(self.num_ranks),
            )
        return dedup_plan(ids_TK, expert_map.device_E, expert_map.slot_E, self.num_ranks)
