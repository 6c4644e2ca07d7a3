"""The device-driven transport: all-to-alls whose row counts never leave the GPU.

The count-exchange path (`occult.moe.counts`) reads every layer's row counts on the host before it
can size its all-to-alls: the host waits for the GPU in the middle of every layer call, and the
GPU then idles while the host launches the rest. Here the counts stay on the device. Every rank
maps every peer's receive buffer (CUDA symmetric memory, `torch.distributed._symmetric_memory`:
the ranks of one host, NVLink or PCIe peer access), and an all-to-all is one kernel that stores
each rank's rows straight into the peers' buffers (`occult.kernels.push`), then a barrier of the
group on the device. A receive buffer holds one region per source rank, as many rows as a source
can send (a bound from shapes), so no rank needs another's counts to know where to write, and
each region's row count arrives beside it.

What the host still needs is that bound. It follows from the largest token count of any rank,
which is a shape every host knows about itself: `agree` swaps it (with every rank's input status
known on the host) host to host, never waiting for the GPU (`occult.moe.agree`: a shared-memory
page). Buffers grow, collectively, only when that bound grows (sized in powers of two of tokens),
all or nothing (`occult.moe.transport_buffers`: a rank that cannot allocate raises on every rank, and
the old buffers stay in use). `memory_bytes` says what they hold; `release_transports()` frees them.

Two sets of buffers (`Slot`) alternate between consecutive all-to-alls. A rank reads what it
received before its next all-to-all (stream order), whose barrier every rank must reach before any
rank goes on to the all-to-all after it, the one that writes into this set again. Every rank runs
the same sequence of all-to-alls (as for NCCL), hence the same sets. A layer call (forward or
backward) makes two, so a CUDA graph of whole calls leaves the alternation where it found it.
"""

from __future__ import annotations

import socket
from typing import Any

import torch
import torch.distributed as dist

from occult import settings
from occult.moe.agree import gloo_group, make_board
from occult.moe.config import TRANSPORTS
from occult.moe.transport_buffers import (
    MAX_RANKS,
    GrowthVote,
    Slot,
    allocate,
    buffer_bytes,
    free_gpu_bytes,
    growth_error,
    map_slot,
    row_bytes,
    token_bucket,
)
from occult.teardown import hold_buffers, release_buffers, release_captured

__all__ = [
    "DeviceTransport",
    "Slot",
    "choose_transport",
    "group_timeout_s",
    "release_transports",
    "reset",
    "row_bytes",
    "token_bucket",
    "transports_memory_bytes",
    "unavailable_reason",
]

AGREE_TIMEOUT_S = 120.0  # where the group's own collective timeout cannot be read (`group_timeout_s`)

_TRANSPORTS: dict[str, DeviceTransport] = {}
_AUTO_COUNTS: dict[str, Any] = {}  # groups "auto" gave the count exchange (the check is a collective: once)


def unavailable_reason(group: Any, for_auto: bool = False) -> str | None:
    """Why the device transport cannot serve `group` (None: it can). A collective over `group`
    (the ranks swap their host names and what they see): every rank of the group calls it at the
    same point. `for_auto`: also why "auto" should not take it where it could run (peer-to-peer
    switched off by NCCL_P2P_DISABLE, or a GPU without peer access to another)."""
    if group is None:
        return "the group has one rank"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if dist.get_backend(group) != "nccl":
        return f"the group's backend is {dist.get_backend(group)}, not nccl"
    size = dist.get_world_size(group)
    if size > MAX_RANKS:
        return f"the group has {size} ranks (the transport serves up to {MAX_RANKS})"
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError:
        return "this torch has no symmetric memory"
    seen: list[Any] = [None] * size
    dist.all_gather_object(seen, (socket.gethostname(), _peer_trouble()), group=group)
    hosts = {host for host, _ in seen}
    if len(hosts) > 1:
        return f"the group spans {len(hosts)} hosts (the transport maps peers' memory: one host)"
    trouble = [f"rank {r}: {why}" for r, (_, why) in enumerate(seen) if why]
    if for_auto and trouble:
        return "; ".join(trouble)
    return None


def _peer_trouble() -> str | None:
    """Why this rank's GPU should not store into its peers' memory, as far as it can tell."""
    if settings.current().nccl_p2p_disable:
        return "NCCL_P2P_DISABLE is set (peer-to-peer off)"
    here = torch.cuda.current_device()
    blocked = [
        d for d in range(torch.cuda.device_count()) if d != here and not torch.cuda.can_device_access_peer(here, d)
    ]
    return f"GPU {here} has no peer access to GPU(s) {blocked}" if blocked else None


def choose_transport(choice: str, group: Any, prefer_device: bool = True) -> DeviceTransport | None:
    """The device transport of `group` for "device" (a clear error where it cannot run); None (the
    count exchange, or sync-free plans) for "counts", "host" and on a group of one rank. "auto": the device
    transport where it runs with peer-to-peer on and `prefer_device` (the dedup dispatchers: their buffers are
    sized by tokens x 1 row per rank; the standard one's by tokens x k, and its copies are slower
    than the count exchange's, docs/results/CURRENT.md), else the count exchange."""
    if choice not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {choice!r}")
    if choice in ("counts", "host") or group is None or (choice == "auto" and not prefer_device):
        return None
    existing = _TRANSPORTS.get(group.group_name)
    if existing is not None and existing.group is group:
        return existing  # checked when it was made: the check is a collective, once per group, not per layer
    decided = _AUTO_COUNTS.get(group.group_name)
    if choice == "auto" and decided is group:
        return None
    reason = unavailable_reason(group, for_auto=choice == "auto")
    if reason is not None and choice == "auto":
        _AUTO_COUNTS[group.group_name] = group
        return None
    if reason is not None:
        raise ValueError(f"the device transport cannot run here: {reason}; use transport='counts' or 'auto'")
    return DeviceTransport.for_group(group)


def group_timeout_s(group: Any) -> float:
    """The collective timeout `group`'s NCCL backend was made with (seconds): the transport's own
    waits end within it too (`AGREE_TIMEOUT_S` where torch does not say)."""
    try:
        return float(group._get_backend(torch.device("cuda")).options._timeout.total_seconds())
    except (AttributeError, RuntimeError, TypeError):
        return AGREE_TIMEOUT_S


class DeviceTransport:
    """Device-driven all-to-alls over one NCCL group of one host (one instance per group: `for_group`)."""

    def __init__(self, group: Any) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group, self.group_name = group, group.group_name
        self.num_ranks, self.rank = dist.get_world_size(group), dist.get_rank(group)
        # a peer that stops calling ends every wait within the group's collective timeout: the host
        # agreement with an error, the device barrier with a trap (the process ends)
        self.timeout_s = group_timeout_s(group)
        self.host_group = gloo_group(dist.get_process_group_ranks(group), self.timeout_s)
        self.board = make_board(self.host_group, 1 + self.num_ranks, self.timeout_s)
        self.device = device = torch.device("cuda", torch.cuda.current_device())
        if symm_mem.get_backend(device) != "CUDA":
            symm_mem.set_backend("CUDA")  # peer-mapped buffers (NVSHMEM's are not needed here)
        self._symm_mem = symm_mem
        self.capacity_bytes = 0
        self.generation = 0  # counts buffer growths (the same on every rank: growth is collective)
        self._slots: list[Slot] = []
        self._retired: list[Slot] = []  # buffers outgrown while a captured graph may still use them
        self._captured = False
        self._turn = 0
        self._vote = GrowthVote(self.board, self.rank, self.num_ranks)
        self.step_tokens: int | None = None  # a step's agreed bound (`occult.moe.step`): calls post, not wait
        hold_buffers(self)  # freed before the process group is destroyed (occult.teardown)

    @classmethod
    def for_group(cls, group: Any) -> DeviceTransport:
        """The transport of `group`, made once (every rank of the group must make it at the same point)."""
        transport = _TRANSPORTS.get(group.group_name)
        if transport is None or transport.group is not group:
            transport = _TRANSPORTS[group.group_name] = cls(group)
        return transport

    def agree(self, num_tokens: int, statuses_D: list[int]) -> tuple[int, list[int]]:
        """(the largest token count of any rank, every rank's status): one host-only exchange.

        `statuses_D` holds this rank's knowledge (0 = fine) per rank of the group; the result is
        their element-wise maximum over ranks, the same list on every rank.
        """
        with torch.profiler.record_function("occult::agree"):  # a host wait for the other ranks: named in traces
            values = self.board.max_reduce([num_tokens, *statuses_D])
        return values[0], values[1:]

    def post(self, num_tokens: int, statuses_D: list[int]) -> None:
        """`agree`'s values for this call, posted without waiting (inside a step's agreement): the next
        call reads them (`posted`)."""
        self.board.post([num_tokens, *statuses_D])

    def posted(self) -> list[int] | None:
        """Every rank's status from the last posted call not read yet (waits for every rank to post it),
        else None."""
        if not self.board.unread:
            return None
        with torch.profiler.record_function("occult::agree"):
            return self.board.collect()[1:]

    def fits(self, num_bytes: int) -> bool:
        """Whether the receive buffers already hold `num_bytes` of rows (`reserve` would not grow them)."""
        return num_bytes <= self.capacity_bytes and bool(self._slots)

    @property
    def memory_bytes(self) -> int:
        """GPU memory this rank's buffers take (those a captured graph may still use included)."""
        return sum(slot.nbytes for slot in self._slots + self._retired)

    def reserve(self, num_bytes: int) -> None:
        """Make every receive buffer hold at least `num_bytes` of rows: a collective where they grow
        (every rank passes the same value, derived from `agree`'s result), all or nothing
        (`occult.moe.transport_buffers`): where any rank cannot allocate, every rank raises
        `TransportMemoryError` and the buffers stay as they were."""
        if self.fits(num_bytes):
            return
        capacity = buffer_bytes(num_bytes)
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"the device transport's buffers must grow to {capacity} bytes inside a CUDA-graph capture, "
                "where they cannot be allocated: run the same forward once eagerly (a warm-up at the captured "
                "shape) before capturing it"
            )
        free_bytes = free_gpu_bytes(self.device)
        buffers, why = allocate(self._symm_mem, capacity, self.device)
        failed, free_mib_D = self._vote.cast(why is not None, free_bytes)
        if failed:
            del buffers
            raise growth_error(capacity, self.memory_bytes, failed, free_mib_D, why)
        slots = [map_slot(self._symm_mem, b, self.group_name, self.rank, self.num_ranks) for b in buffers]
        if self._captured:
            self._retired.extend(self._slots)  # a captured graph still writes and reads them
        elif self._slots:
            self._synchronize()  # earlier calls' kernels may still use the old ones
        self._slots, self.capacity_bytes = slots, capacity
        self.generation += 1

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def release(self) -> int:
        """Free this rank's buffers (graphs captured over them first: `occult.teardown`); the next call
        grows them again. Every rank of the group calls it at the same point. Returns the bytes freed."""
        freed = self.memory_bytes
        if freed:
            if self._captured:
                release_captured()
            self._synchronize()  # no kernel of this rank (hence no peer's store, by the barriers) uses them
        self._slots, self._retired, self._captured, self._turn = [], [], False, 0
        self.capacity_bytes = 0
        self.generation += 1
        return freed

    def next_slot(self) -> Slot:
        """The buffers of the next all-to-all (the two sets alternate)."""
        if not self._slots:
            raise RuntimeError("the device transport holds no buffers (released or never grown): reserve first")
        slot = self._slots[self._turn]
        self._turn ^= 1
        return slot

    def exchange(
        self,
        src_NW: torch.Tensor,
        counts_D: torch.Tensor,
        stride: int,
        src_stride: int = 0,
        status: torch.Tensor | None = None,
        copy_counts: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Send rows of `src_NW` (bytes [N, W]): `counts_D[d]` rows (a device tensor) to rank d, starting
        at row `d * src_stride`, or packed by destination when `src_stride` is 0. Every rank passes
        the same W and `stride` (rows a source can send to one rank, at most). `status` (a device
        integer scalar, optional): this rank's routing status, delivered to every rank with the rows.

        Returns (received rows [D * stride, W]: region s holds rank s's rows, the first
        `recv_counts_D[s]` valid, the rest stale; a view of the buffer: launch every read of it
        before this rank's next all-to-all, copy what must live longer; received rows per source,
        int64 [D], a copy (`copy_counts=False`: a view, valid as the rows are); with `status`: every
        rank's status, int64 [D], a copy, else None). Nothing waits on the host."""
        from occult.kernels.push import push_rows

        slot = self._begin(src_NW.shape[1], stride)
        push_rows(
            src_NW, counts_D, slot.peer_rows_D, slot.peer_counts_D, self.rank, stride, src_stride, status, MAX_RANKS
        )
        return self._end(slot, src_NW.shape[1], stride, status is not None, copy_counts)

    def exchange_packed(
        self,
        rows: Any,
        counts_D: torch.Tensor,
        stride: int,
        status: torch.Tensor | None = None,
        copy_counts: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`exchange` of rows not yet written anywhere: `rows` (`device_exchange.PackedRows`) gathered
        from the tokens straight into the peers' regions by one kernel (`occult.kernels.pack`).
        `copy_counts=False`: the counts and statuses as views of the buffer (copy them before the
        all-to-all after next, as the unpack kernel does)."""
        from occult.kernels.pack import pack_push_rows

        slot = self._begin(rows.width, stride)
        pack_push_rows(
            rows.x_TH,
            rows.token_P,
            rows.weights_TK,
            rows.entry_PK,
            rows.slot_PK,
            rows.gate_byte,
            rows.slot_byte,
            rows.width,
            counts_D,
            slot.peer_rows_D,
            slot.peer_counts_D,
            self.rank,
            stride,
            status,
            MAX_RANKS,
        )
        return self._end(slot, rows.width, stride, status is not None, copy_counts)

    def _begin(self, width: int, stride: int) -> Slot:
        if self.num_ranks * stride * width > self.capacity_bytes:
            raise RuntimeError(
                f"an all-to-all of {self.num_ranks} x {stride} rows of {width} bytes exceeds the "
                f"reserved {self.capacity_bytes} bytes (reserve first)"
            )
        if torch.cuda.is_current_stream_capturing():
            self._captured = True
        return self.next_slot()

    def _end(
        self, slot: Slot, width: int, stride: int, with_status: bool, copy_counts: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The group's barrier, then (rows, counts, statuses) as `exchange` returns them (the counts and
        statuses copied in one launch: they sit in the buffer's head; views with `copy_counts=False`)."""
        D = self.num_ranks
        slot.handle.barrier(channel=0, timeout_ms=int(self.timeout_s * 1000))
        if not with_status:
            return slot.rows(D * stride, width), slot.counts(D).clone() if copy_counts else slot.counts(D), None
        if not copy_counts:
            return slot.rows(D * stride, width), slot.counts(D), slot.statuses(D)
        head = slot.buffer[: 8 * (MAX_RANKS + D)].view(torch.int64).clone()
        return slot.rows(D * stride, width), head[:D], head[MAX_RANKS : MAX_RANKS + D]


def release_transports() -> int:
    """Free every transport's buffers on this rank (the device transports' GPU buffers, the host transports' shared
    pinned memory), and the CUDA graphs captured over them; the next layer call grows them again. Every rank calls
    it at the same point (between layer calls). `occult.distributed.finish_distributed` and
    `dist.destroy_process_group` call it too. Returns the bytes freed on this rank."""
    release_captured()
    return release_buffers()  # (every transport registers its buffers with occult.teardown)


def transports_memory_bytes() -> int:
    """GPU memory the device transports' buffers take on this rank."""
    return sum(transport.memory_bytes for transport in _TRANSPORTS.values())


def reset() -> None:
    """Free and forget every transport and every "auto" choice; for tests and process teardown."""
    release_transports()
    _TRANSPORTS.clear()
    _AUTO_COUNTS.clear()
