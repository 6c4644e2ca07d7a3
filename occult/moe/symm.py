"""The device-driven transport: all-to-alls whose row counts never leave the GPU.

The count-exchange path (`occult.moe.counts`) reads every layer's row counts on the host before it
can size its all-to-alls: the host waits for the GPU in the middle of every layer call, and the
GPU then idles while the host launches the rest. Here the counts stay on the device: rows travel
through `torch.ops.symm_mem.all_to_all_vdev` (NVSHMEM, splits read by the kernel) between
symmetric-memory buffers sized from shapes, so a layer call queues all its work without waiting.

What the host still needs is a bound on the rows each rank can receive. It follows from the
largest token count of any rank, which is a shape every host knows about itself: `agree` swaps it
(with every rank's input status known on the host) host to host, never waiting for the GPU
(`occult.moe.agree`: a shared-memory page where the group is on one host, else gloo). Buffers
grow, collectively, only when that bound grows (sized in powers of two of tokens).

Two sets of buffers (`Slot`) alternate between consecutive all-to-alls: `all_to_all_vdev` pulls
rows out of the senders' buffers, and a sender may reuse its buffer only after every peer has
pulled; the next all-to-all (on the other set) begins with a barrier of all ranks, which each
reaches only after its earlier pulls completed, so every set is free again when its turn comes.
Every rank runs the same sequence of all-to-alls (as for NCCL), hence the same sets.

The kernel splits each peer's bytes evenly over its thread blocks and requires that they divide
(a device assert otherwise): rows are padded to `ROW_ALIGN` bytes and every call passes whole
buffers of at least `MIN_BUFFER_BYTES`, so it always runs its full block count, a power of two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from occult.moe.agree import gloo_group, make_board
from occult.moe.config import TRANSPORTS

ROW_ALIGN = 64  # bytes per row: a multiple of this divides evenly over any power-of-two block count <= 64
MIN_BUFFER_BYTES = 8 << 20  # whole buffers this large always run the kernel's maximum block count
MIN_TOKENS = 256  # the smallest token bucket buffers are sized for
AGREE_TIMEOUT_S = 120.0

_TRANSPORTS: dict[str, "DeviceTransport"] = {}


def unavailable_reason(group: Any) -> str | None:
    """Why the device transport cannot serve `group` (None: it can)."""
    if group is None:
        return "the group has one rank"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if dist.get_backend(group) != "nccl":
        return f"the group's backend is {dist.get_backend(group)}, not nccl"
    size = dist.get_world_size(group)
    if size & (size - 1) or size > 64:
        return f"the group has {size} ranks (the transport needs a power of two up to 64)"
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return "this torch has no symmetric memory"
    if not (hasattr(symm_mem, "is_nvshmem_available") and symm_mem.is_nvshmem_available()):
        return "NVSHMEM is not available to this torch"
    if not hasattr(torch.ops.symm_mem, "all_to_all_vdev"):
        return "this torch has no symm_mem.all_to_all_vdev"
    return None


def choose_transport(choice: str, group: Any) -> "DeviceTransport | None":
    """The device transport of `group` for "device" (a clear error where it cannot run); None (the
    count exchange) for "counts", for "auto" and on a group of one rank.

    "auto" takes the count exchange today: on 2 x H200 the device transport is exact and has no
    host wait but is not faster (its all-to-all kernel is slower than NCCL's and the layer call's
    host time is the same; docs/benchmarks.md, "The device transport"); it becomes "auto"'s
    choice where it is measured faster."""
    if choice not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {choice!r}")
    if choice != "device" or group is None:
        return None
    reason = unavailable_reason(group)
    if reason is not None:
        raise ValueError(f"the device transport cannot run here: {reason}; use transport='counts' or 'auto'")
    return DeviceTransport.for_group(group)


def row_bytes(payload_bytes: int) -> int:
    """Bytes a row of `payload_bytes` takes in the buffers (padded to `ROW_ALIGN`)."""
    return max(ROW_ALIGN, -(-payload_bytes // ROW_ALIGN) * ROW_ALIGN)


def token_bucket(num_tokens: int) -> int:
    """Buffers are sized for this many tokens per rank: the next power of two, at least `MIN_TOKENS`."""
    return max(MIN_TOKENS, 1 << max(0, num_tokens - 1).bit_length())


@dataclass
class Slot:
    """One set of symmetric buffers: send and receive bytes, the send splits, and the kernel's
    output splits/offsets (also its exchange scratch)."""

    send: torch.Tensor
    recv: torch.Tensor
    in_splits: torch.Tensor
    out_splits_offsets: torch.Tensor


class DeviceTransport:
    """Device-driven all-to-alls over one NCCL group (one instance per group: `for_group`)."""

    def __init__(self, group: Any) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group, self.group_name = group, group.group_name
        self.num_ranks, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.host_group = gloo_group(dist.get_process_group_ranks(group), AGREE_TIMEOUT_S)
        self.board = make_board(self.host_group, 1 + self.num_ranks, AGREE_TIMEOUT_S)
        if symm_mem.get_backend(torch.device("cuda")) != "NVSHMEM":
            symm_mem.set_backend("NVSHMEM")
        symm_mem.enable_symm_mem_for_group(self.group_name)
        self._symm_mem = symm_mem
        self.capacity_bytes = 0
        self._slots: list[Slot] = []
        self._turn = 0

    @classmethod
    def for_group(cls, group: Any) -> "DeviceTransport":
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
        values = self.board.max_reduce([num_tokens, *statuses_D])
        return values[0], values[1:]

    def reserve(self, num_bytes: int) -> None:
        """Make every buffer hold at least `num_bytes` (a collective when they grow: every rank
        passes the same value, derived from `agree`'s result)."""
        num_bytes = max(num_bytes, MIN_BUFFER_BYTES)
        if num_bytes <= self.capacity_bytes:
            return
        num_bytes = 1 << (num_bytes - 1).bit_length()
        self._slots = []  # free the old buffers first
        device = torch.device("cuda", torch.cuda.current_device())
        empty, D = self._symm_mem.empty, self.num_ranks
        for _ in range(2):
            slot = Slot(empty(num_bytes, dtype=torch.uint8, device=device),
                         empty(num_bytes, dtype=torch.uint8, device=device),
                         empty(D, dtype=torch.int64, device=device),
                         empty((2, D), dtype=torch.int64, device=device))
            for t in (slot.send, slot.recv, slot.in_splits, slot.out_splits_offsets):
                self._symm_mem.rendezvous(t, group=self.group_name)
            self._slots.append(slot)
        self.capacity_bytes = num_bytes

    def next_slot(self) -> Slot:
        """The buffers of the next all-to-all (the two sets alternate)."""
        slot = self._slots[self._turn]
        self._turn ^= 1
        return slot

    def all_to_all(self, slot: Slot, width: int, counts_D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Send the first rows of `slot.send` (as rows of `width` bytes, grouped by destination,
        `counts_D[d]` to rank d, a device tensor) to their ranks.

        Returns (received bytes as [rows, width], packed by source rank in rank order; rows past
        the received total are stale, and received rows per source, int64 [D]: a view of the
        slot's buffer, valid until its next use: clone it to keep it). Nothing waits on the host.
        """
        rows = self.capacity_bytes // width
        send = slot.send[: rows * width].view(rows, width)
        recv = slot.recv[: rows * width].view(rows, width)
        slot.in_splits.copy_(counts_D)
        torch.ops.symm_mem.all_to_all_vdev(send, recv, slot.in_splits, slot.out_splits_offsets, self.group_name)
        return recv, slot.out_splits_offsets[0]

    def send_view(self, slot: Slot, width: int) -> torch.Tensor:
        """`slot.send` as rows of `width` bytes (fill the first rows before `all_to_all`)."""
        rows = self.capacity_bytes // width
        return slot.send[: rows * width].view(rows, width)


def reset() -> None:
    """Forget every transport (their buffers go with them); for tests and process teardown."""
    _TRANSPORTS.clear()
