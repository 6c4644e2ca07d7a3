"""Dispatch and combine over torch.distributed, one interface for both dispatchers.

`Dispatcher.dispatch` sends each plan row (a token's activation, its local expert slots and gate
weights) to the rank that holds those experts; `Dispatcher.combine` brings one result row back
per sent row and sums them per token. `StandardDispatcher` and `DedupDispatcher` differ only in
the plan (`occult.moe.plan`): k copies per token vs one per device.

Per layer and call the host waits once: the per-destination row counts (and every rank's input
status, so bad input on one rank raises a clear error on all ranks instead of a hang) travel in
one small all-to-all and are read with a single `.tolist()`. Backward sends the same number of
rows as forward: gradient rows retrace the combine and dispatch all-to-alls in reverse, and the
gate-weight gradients (k scalars per row) return with the dispatch's backward. The exchanges
themselves (the all-to-all, its autograd node, metadata packing, byte accounting) are in
`occult.moe.comm`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from occult.moe.comm import CommStats, exchange, pack_metadata
from occult.moe.nodes import check_devices_per_node, peer_levels
from occult.moe.plan import DispatchPlan, dedup_plan, standard_plan, static_dedup_plan, static_standard_plan, trim


class RoutingError(ValueError):
    """Input or router output that cannot be dispatched; raised on every rank of the group."""


# Status codes exchanged with the counts; 0 = fine.
STATUS_OK = 0
STATUS_MESSAGES = {
    1: "router produced NaN/inf gate weights (check the input activations and router weights for NaN/inf)",
    2: "router returned expert ids out of range",
    3: "input hidden size does not match the layer",
}


@dataclass
class DispatchState:
    """What combine and the backward pass need from dispatch."""

    plan: DispatchPlan
    send_splits: list[int]
    recv_splits: list[int]
    num_tokens: int
    rank: int
    stats: CommStats = field(default_factory=CommStats)
    peer_level: list[int] | None = None  # per rank: 0 self, 1 same node, 2 other node (None: unknown)


def _use_triton(t: torch.Tensor) -> bool:
    """The Triton row sums (fp32 accumulation) serve bf16/fp16/fp32 CUDA tensors."""
    if not t.is_cuda or t.dtype == torch.float64:
        return False
    from occult import kernels

    return kernels.available(t.device)


def token_sum(src_PH: torch.Tensor, token_P: torch.Tensor, row_TJ: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Sum each token's rows (fp32 accumulation): one pass on GPU, `index_add` elsewhere."""
    if _use_triton(src_PH):
        from occult.kernels.rows import gather_sum

        return gather_sum(src_PH, row_TJ, out_dtype)
    acc = torch.promote_types(src_PH.dtype, torch.float32)
    out = src_PH.new_zeros((row_TJ.shape[0], src_PH.shape[1]), dtype=acc)
    return out.index_add_(0, token_P, src_PH.to(acc)).to(out_dtype)


class _GatherRows(torch.autograd.Function):
    """rows = x[token_P] (`early`: the same rows, gathered before the host sync); backward sums
    each token's row gradients (no atomics on GPU)."""

    @staticmethod
    def forward(ctx, x_TH, token_P, row_TJ, early_PH=None):
        ctx.save_for_backward(token_P, row_TJ)
        return x_TH[token_P] if early_PH is None else early_PH

    @staticmethod
    def backward(ctx, grad_PH):
        token_P, row_TJ = ctx.saved_tensors
        return token_sum(grad_PH, token_P, row_TJ, grad_PH.dtype), None, None, None


def gather_gates(weights_TK: torch.Tensor, entry_PK: torch.Tensor) -> torch.Tensor:
    """gates[p, j] = weights.flat[entry[p, j]], 0 where entry is -1 (padding)."""
    padded = torch.cat([weights_TK.reshape(-1), weights_TK.new_zeros(1)])
    return padded[torch.where(entry_PK >= 0, entry_PK, weights_TK.numel())]


def scatter_gates(grad_PK: torch.Tensor, entry_PK: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Backward of `gather_gates`: every valid entry occurs once, so a plain scatter (no
    accumulation); padding entries all land in one spare slot that is dropped. (Autograd's own
    indexing backward would accumulate the padding's duplicates one by one.)"""
    n = shape.numel()
    buf = grad_PK.new_zeros(n + 1)
    buf.scatter_(0, torch.where(entry_PK >= 0, entry_PK, n).reshape(-1), grad_PK.reshape(-1))
    return buf[:n].view(shape)


class _GatherGates(torch.autograd.Function):
    """`gather_gates` (`early`: its result, made before the host sync) with `scatter_gates` as its backward."""

    @staticmethod
    def forward(ctx, weights_TK, entry_PK, early_PK=None):
        ctx.save_for_backward(entry_PK)
        ctx.shape = weights_TK.shape
        return gather_gates(weights_TK, entry_PK) if early_PK is None else early_PK

    @staticmethod
    def backward(ctx, grad_PK):
        (entry_PK,) = ctx.saved_tensors
        return scatter_gates(grad_PK, entry_PK, torch.Size(ctx.shape)), None, None


def read_to_host(t: torch.Tensor, while_waiting: Callable[[], None] | None = None) -> list:
    """`t.tolist()`, running `while_waiting` between queuing the device-to-host copy and waiting
    for it: GPU work queued there (e.g. a MoE block's shared experts) runs while the host waits
    and keeps the GPU busy while the host then launches what needed the values."""
    if while_waiting is None:
        return t.tolist()
    if not t.is_cuda:
        while_waiting()
        return t.tolist()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    while_waiting()
    copied.synchronize()
    return host.tolist()


def gather_early(x_TH: torch.Tensor, weights_TK: torch.Tensor, plan: DispatchPlan) -> tuple[torch.Tensor, ...]:
    """Rows, gates and packed metadata of every row a capacity-sized plan may send (the tail is
    padding): queued before the host waits for the counts, so that after the wait only the
    all-to-alls and the experts are launched. The forward is host-bound: on one H200 at 8192
    tokens the GPU sat idle while the host launched these after the wait (docs/overlap.md).
    Costs the padding rows' gather on the GPU (capacity T*min(k, D) rows vs the sent ones)."""
    with torch.no_grad():
        gates_PK = gather_gates(weights_TK, plan.entry_PK)
        return x_TH[plan.token_P], gates_PK, pack_metadata(gates_PK, plan.slot_PK)


class _SumRows(torch.autograd.Function):
    """y[t] = sum of token t's rows; backward hands each row its token's gradient."""

    @staticmethod
    def forward(ctx, y_PH, token_P, row_TJ):
        ctx.save_for_backward(token_P, row_TJ)
        return token_sum(y_PH, token_P, row_TJ, y_PH.dtype)

    @staticmethod
    def backward(ctx, grad_TH):
        token_P, _ = ctx.saved_tensors
        return grad_TH[token_P], None, None


class Dispatcher:
    """Sends token rows to the ranks holding their experts and brings results back.

    Subclasses choose the plan; everything else (count exchange, all-to-alls, autograd,
    accounting, the per-token sum) is shared.
    """

    name = "base"

    def __init__(self, group=None, devices_per_node: int | None = None) -> None:
        self.group = group
        if group is None and dist.is_available() and dist.is_initialized():
            self.group = dist.group.WORLD
        if self.group is not None:
            self.num_ranks = dist.get_world_size(self.group)
            self.rank = dist.get_rank(self.group)
        else:
            self.num_ranks, self.rank = 1, 0
        if self.num_ranks == 1:
            self.group = None  # a single rank needs no communication
        self.devices_per_node = self.num_nodes = self.peer_level = None
        if devices_per_node is not None:
            self.set_devices_per_node(devices_per_node)

    def set_devices_per_node(self, devices_per_node: int) -> None:
        """Declare the node layout (ranks node-major, G per node): `CommStats` then splits remote
        rows into inter-node and intra-node ones."""
        G = check_devices_per_node(devices_per_node, self.num_ranks)
        self.devices_per_node, self.num_nodes = G, self.num_ranks // G
        self.peer_level = peer_levels(self.num_ranks, self.rank, G)

    def plan(self, ids_TK, expert_device_E, expert_slot_E) -> DispatchPlan:
        raise NotImplementedError

    def static_plan(self, ids_TK, expert_device_E, expert_slot_E) -> DispatchPlan:
        """The same rows in fixed-capacity form (`occult.moe.plan.static_capacity` per destination)."""
        raise NotImplementedError

    def exchange_counts(self, send_counts_D: torch.Tensor, status: torch.Tensor,
                        while_waiting: Callable[[], None] | None = None) -> tuple[list[int], list[int]]:
        """Swap row counts (and input status) with every rank; the layer's one host sync."""
        send, recv = self.exchange_chunk_counts(send_counts_D[None], status, while_waiting)
        return send[0], recv[0]

    def exchange_chunk_counts(self, send_counts_CD: torch.Tensor, status: torch.Tensor,
                              while_waiting: Callable[[], None] | None = None) -> tuple[list[list[int]], list[list[int]]]:
        """Row counts of C chunks per destination, swapped in one all-to-all and read with one host sync.

        Returns (send splits, receive splits), each C lists of one count per rank. Raises
        `RoutingError` on every rank when any rank reports bad input in `status`.
        `while_waiting` runs while the host waits for the counts (`read_to_host`).
        """
        num_chunks, D = send_counts_CD.shape[0], self.num_ranks
        header_DX = torch.cat([send_counts_CD.t().to(torch.int64), status.to(torch.int64).expand(D, 1)], dim=1)
        if self.group is not None:
            recv_DX = torch.empty_like(header_DX)
            dist.all_to_all_single(recv_DX, header_DX, group=self.group)
        else:
            recv_DX = header_DX
        host = read_to_host(torch.cat([header_DX[:, :num_chunks].t().reshape(-1), recv_DX.t().reshape(-1)]), while_waiting)
        send = [host[c * D : (c + 1) * D] for c in range(num_chunks)]
        recv_host = host[num_chunks * D :]
        recv = [recv_host[c * D : (c + 1) * D] for c in range(num_chunks)]
        statuses = recv_host[num_chunks * D :]
        bad = [(r, s) for r, s in enumerate(statuses) if s != STATUS_OK]
        if bad:
            text = "; ".join(f"rank {r}: {STATUS_MESSAGES.get(s, f'status {s}')}" for r, s in bad)
            raise RoutingError(f"MoE dispatch stopped on every rank because of bad input: {text}")
        return send, recv

    def dispatch(
        self,
        x_TH: torch.Tensor,
        weights_TK: torch.Tensor,
        ids_TK: torch.Tensor,
        expert_device_E: torch.Tensor,
        expert_slot_E: torch.Tensor,
        status: torch.Tensor,
        sync_free: bool = False,
        pause: Callable[[], None] | None = None,
        while_waiting: Callable[[], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DispatchState]:
        """Send rows out; return (x_RH, slots_RK, gates_RK, state) as received by this rank.

        `pause` (two-batch overlap, `occult.moe.two_batch`) runs between starting the all-to-all
        and waiting for it, and again in backward; every rank of the group must pass one or none.

        `sync_free=True` sends a fixed-capacity plan with split sizes known from shapes alone:
        no count exchange, no host wait, capturable in a CUDA graph. Every rank of the group must
        then pass the same number of tokens (pad the batch), and bad input is not reported
        (`status` is not exchanged): NaN gates give NaN outputs, out-of-range ids were clamped.

        `while_waiting` (optional) is called exactly once: while the host waits for the counts
        (GPU work that does not depend on them, e.g. shared experts), or at once when sync-free.
        """
        if sync_free:
            plan = self.static_plan(ids_TK, expert_device_E, expert_slot_E)
            send_splits = recv_splits = [plan.num_rows // self.num_ranks] * self.num_ranks
            early = (None, None, None)
            if while_waiting is not None:
                while_waiting()
        else:
            plan = self.plan(ids_TK, expert_device_E, expert_slot_E)
            early = gather_early(x_TH, weights_TK, plan)
            send_splits, recv_splits = self.exchange_counts(plan.send_counts_D, status, while_waiting)
            num_rows = sum(send_splits)
            plan = trim(plan, num_rows)
            early = tuple(t[:num_rows] for t in early)
        # (CommStats() given explicitly: torch.compile cannot trace the dataclass default_factory call,
        # and a graph break there made dynamo give up on the layer's whole try block)
        state = DispatchState(plan, send_splits, recv_splits, x_TH.shape[0], self.rank, CommStats(), self.peer_level)
        gates_PK = _GatherGates.apply(weights_TK, plan.entry_PK, early[1])
        x_RH, gates_RK, slots_RK = exchange(
            _GatherRows.apply(x_TH, plan.token_P, plan.row_TJ, early[0]), gates_PK, plan.slot_PK, send_splits, recv_splits,
            self.group, state, pause, early[2],
        )
        state.stats.dispatch_rows = plan.num_rows
        return x_RH, slots_RK, gates_RK, state

    def combine(self, y_RH: torch.Tensor, state: DispatchState, pause: Callable[[], None] | None = None) -> torch.Tensor:
        """Return each received row's result to its source; sum a token's rows in fp32 (`pause`: as in dispatch)."""
        state.stats.combine_rows = y_RH.shape[0]
        y_PH, _, _ = exchange(y_RH, None, None, state.recv_splits, state.send_splits, self.group, state, pause)
        return _SumRows.apply(y_PH, state.plan.token_P, state.plan.row_TJ)


class StandardDispatcher(Dispatcher):
    """The baseline every framework ships: one copy per (token, expert)."""

    name = "standard"

    def plan(self, ids_TK, expert_device_E, expert_slot_E) -> DispatchPlan:
        return standard_plan(ids_TK, expert_device_E, expert_slot_E, self.num_ranks)

    def static_plan(self, ids_TK, expert_device_E, expert_slot_E) -> DispatchPlan:
        per_device = expert_device_E.shape[0] // self.num_ranks
        return static_standard_plan(ids_TK, expert_device_E, expert_slot_E, self.num_ranks, per_device)


class DedupDispatcher(Dispatcher):
    """Occult's: one copy per (token, device), local experts pre-reduced before the return trip."""

    name = "dedup"

    def plan(self, ids_TK, expert_device_E, expert_slot_E) -> DispatchPlan:
        return dedup_plan(ids_TK, expert_device_E, expert_slot_E, self.num_ranks)

    def static_plan(self, ids_TK, expert_device_E, expert_slot_E) -> DispatchPlan:
        per_device = expert_device_E.shape[0] // self.num_ranks
        return static_dedup_plan(ids_TK, expert_device_E, expert_slot_E, self.num_ranks, per_device)


# (at the bottom: it subclasses DedupDispatcher)
from occult.moe.two_level import TwoLevelDispatcher  # noqa: E402

DISPATCHERS: dict[str, type[Dispatcher]] = {
    "standard": StandardDispatcher, "dedup": DedupDispatcher, "dedup2": TwoLevelDispatcher,
}


def _group_size(group) -> int:
    if group is not None:
        return dist.get_world_size(group)
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def make_dispatcher(name: str | Dispatcher, group=None, *, devices_per_node: int | None = None, placement=None) -> Dispatcher:
    """Build a dispatcher by name ("standard", "dedup" or "dedup2"), or check and return a built one.

    The node layout (G GPUs per node, ranks node-major) is `devices_per_node`, else that of
    `placement` (a `Placement` with `num_nodes` > 1 over as many devices as the group has ranks).
    "dedup2" (two-level) needs it; the flat dispatchers use it to split `CommStats` by link.
    """
    size = _group_size(group) if not isinstance(name, Dispatcher) else name.num_ranks
    placed = None
    if placement is not None and placement.num_nodes > 1:
        if placement.num_devices != size and name == "dedup2":
            raise ValueError(f"the placement has {placement.num_devices} devices on {placement.num_nodes} nodes "
                             f"but the group has {size} ranks: give it one device per rank")
        placed = placement.devices_per_node if placement.num_devices == size else None
    if isinstance(name, Dispatcher):
        if group is not None and name.group is not None and group is not name.group:
            raise ValueError("the dispatcher was built for another process group than the `group` given")
        if placed is not None and name.devices_per_node not in (None, placed):
            raise ValueError(f"the dispatcher has {name.devices_per_node} GPUs per node but the placement has "
                             f"{placed} ({placement.num_nodes} nodes); make them agree")
        return name
    try:
        cls = DISPATCHERS[name]
    except KeyError:
        raise ValueError(f"unknown dispatcher {name!r}; choose one of {sorted(DISPATCHERS)}") from None
    if devices_per_node is None:
        devices_per_node = placed
    return cls(group, devices_per_node=devices_per_node)
