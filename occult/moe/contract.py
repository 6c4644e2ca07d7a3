"""The one contract every dispatcher implements, and the schedule it honours.

    received, handle = dispatcher.dispatch(x_TH, weights_TK, ids_TK, expert_map, schedule)
    y = received.apply(experts)              # experts(x_RH, slots_RK, gates_RK) -> y_RH
    y_TH = dispatcher.combine(y, handle)

`dispatch` plans where each token's rows go (`occult.moe.plan`), swaps the row counts (the one
host sync, none when sync-free) and sends the rows with their local expert slots and gate
weights; `combine` brings one result row back per sent row and sums each token's rows. What
differs between calls is data, not code paths: a `Schedule` says how to run (sync-free
capacity, work to run while the host waits) and each dispatcher declares the `Capabilities` it
honours; `check_schedule` refuses the rest with one clear error. Dispatchers are stateless
between calls: one serves every layer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from occult.moe.comm import CommStats
from occult.moe.expert_map import ExpertMap
from occult.moe.host_wire import HostWire
from occult.moe.nodes import check_devices_per_node, peer_levels
from occult.moe.symm import choose_transport

# experts(x_RH, slots_RK, gates_RK, dense=...) -> y_RH (`occult.moe.experts.expert_mlp` with the layer's weights)
ExpertFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Schedule:
    """How one call runs; the same function is computed under every schedule.

    `sync_free`: fixed-capacity plans whose all-to-all sizes follow from shapes alone (no host
    wait, CUDA-graph capturable; every rank passes the same token count, bad input is not
    reported across ranks). `while_waiting`: called exactly once, while the host waits for the
    counts (at once when there is no wait). `agreed_tokens`: the largest token count of any rank,
    already agreed by the caller for this call (the device transport then skips its own agreement:
    `occult.moe.graphs` agrees before it chooses between a replay and an eager call).
    `status_sink_1`: where a call traced by torch.compile leaves its routing status as it queues it
    (a [1] int64 buffer of the layer; `occult.moe.status`); without one a traced call queues none.
    `sync_free_capacity`: a sync-free call's rows for each other rank, as a fraction of its tokens
    (`ExecConfig.sync_free_capacity`; below 1 only where `Capabilities.bounded_rows`).
    """

    sync_free: bool = False
    while_waiting: Callable[[], None] | None = None
    agreed_tokens: int | None = None
    status_sink_1: torch.Tensor | None = None
    sync_free_capacity: float = 1.0

    def run_while_waiting(self) -> None:
        """Call `while_waiting` now (for schedules with no host wait)."""
        if self.while_waiting is not None:
            self.while_waiting()


@dataclass(frozen=True)
class Capabilities:
    """What a dispatcher honours; the layer, the CLI, `occult bench` and the cost model ask these
    instead of comparing dispatcher names."""

    deduplicated: bool = True  # one row per (token, device) instead of per (token, expert)
    sync_free: bool = True
    two_level: bool = False  # one row per node across nodes, then per GPU inside (needs a node layout)
    bounded_rows: bool = False  # sync-free blocks for other ranks below T rows (`ExecConfig.sync_free_capacity`)


@dataclass
class Received:
    """The rows this rank received: activations, local expert slots (-1 = padding) and gate weights;
    `dense`: no padding, every slot a local expert (the one-rank schedule), so buffers sized by R*K hold
    only real (row, expert) pairs."""

    x_RH: torch.Tensor
    slots_RK: torch.Tensor
    gates_RK: torch.Tensor
    dense: bool = False

    def apply(self, experts: ExpertFn) -> Any:
        """Run the local experts on the received rows (what `combine` takes back)."""
        return experts(self.x_RH, self.slots_RK, self.gates_RK, dense=self.dense)


class Handle:
    """What `combine` (and backward) need from `dispatch`; each dispatcher has its own kind.
    `stats` holds the rows and bytes sent, forward and (after it) backward."""

    stats: CommStats


class Dispatcher(ABC):
    """Sends token rows to the ranks holding their experts and brings results back (see module doc).

    `group`: the expert-parallel process group (None: the default group, or one rank).
    `devices_per_node` (G, ranks node-major): with it, `CommStats` splits remote rows into
    inter-node and intra-node ones. `transport`: "device" (`occult.moe.symm`: counts kept on
    the GPU, no host wait; an error where it cannot run), "counts" (the count exchange: one host
    wait per call), "host" (as "counts", the rows through shared pinned host memory by copy engines:
    `occult.moe.host_wire`, `self.link`; an error where it cannot run) or "auto" (`symm.choose_transport`:
    the device transport for the dedup dispatchers on NCCL GPUs of one host with peer-to-peer, else the
    count exchange); `self.transport` is the device one or None. `capturable`: whether a CUDA graph can
    record its exchanges (one rank, or a group of NCCL: gloo's collectives run on the host, and capturing one
    breaks the process's CUDA state).
    """

    name: ClassVar[str] = "base"
    capabilities: ClassVar[Capabilities] = Capabilities()

    def __init__(self, group: Any = None, devices_per_node: int | None = None, transport: str = "auto") -> None:
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
        self.capturable = self.group is None or "nccl" in str(dist.get_backend(self.group))
        self.devices_per_node = self.num_nodes = self.peer_level = None
        if devices_per_node is not None:
            self.set_devices_per_node(devices_per_node)
        self.transport = choose_transport(transport, self.group, prefer_device=self.capabilities.deduplicated)
        self.link: Any = self.group  # what the exchanges run over: the group (NCCL), or its host transport
        if transport == "host" and self.group is not None:
            self.link = HostWire.for_group(self.group)

    @property
    def transport_name(self) -> str:
        """ "device", "host" or "counts": how this dispatcher's exchanges run."""
        if isinstance(self.link, HostWire):
            return "host"
        return "device" if self.transport is not None else "counts"

    def set_devices_per_node(self, devices_per_node: int) -> None:
        """Declare the node layout (ranks node-major, G per node)."""
        G = check_devices_per_node(devices_per_node, self.num_ranks)
        self.devices_per_node, self.num_nodes = G, self.num_ranks // G
        self.peer_level = peer_levels(self.num_ranks, self.rank, G)

    def check_schedule(self, schedule: Schedule) -> None:
        """Refuse, with one clear error, a schedule this dispatcher does not honour."""
        if schedule.sync_free and not self.capabilities.sync_free:
            raise ValueError(f"the {self.name!r} dispatcher has no sync-free mode; use sync_free=False")
        if schedule.sync_free and schedule.sync_free_capacity < 1 and not self.capabilities.bounded_rows:
            raise ValueError(
                f"the {self.name!r} dispatcher sends whole fixed blocks; sync_free_capacity < 1 needs "
                "dispatcher='dedup' (or sync_free_capacity=1.0)"
            )

    @abstractmethod
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
        """Send each token's rows to the ranks holding its experts (`ids_TK`, global ids, with
        gate weights `weights_TK`); return what this rank received and the handle for `combine`.

        `status` (a 0-dim device tensor; `occult.moe.counts.routing_status` makes one) travels
        with the counts so that bad input on any rank raises `RoutingError` on every rank; None:
        checked here. `host_status`: a status this rank already knows on the host (its input's
        hidden size or dtype is wrong); the device transport raises it on every rank at once.
        Every rank of the group calls it, with any number of tokens (even 0).
        """

    @abstractmethod
    def combine(self, y: Any, handle: Handle) -> torch.Tensor:
        """Return each received row's result (`Received.apply`'s output) to its source; y_TH
        with each token's rows summed (fp32 accumulation)."""
