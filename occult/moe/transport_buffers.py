"""The device transport's receive buffers: their sizes, and growing them all or nothing.

A receive buffer (`Slot`) is one block of CUDA symmetric memory: `COUNTS_BYTES` of row counts and
routing statuses (one int64 each per source rank), then the rows, in one region per source rank.
The transport (`occult.moe.symm`) keeps two and grows them when a call needs more room. Growing
is a collective, and a failure on one rank must not strand the others inside the mapping
(`rendezvous`) or leave any rank without buffers, so a growth runs in three steps:

  1. every rank allocates its new buffers locally (`allocate`: no peer is involved yet), keeping
     the old ones;
  2. the ranks agree, host to host, whether all of them succeeded (`GrowthVote`), with each
     rank's free GPU memory for the message;
  3. all succeeded: the new buffers are mapped (`map_slot`, the collective part) and replace the
     old ones; any failed: every rank drops its new buffers and raises `TransportMemoryError`,
     and the old buffers stay in use.

Buffers are sized to what a call needs (`buffer_bytes`: rounded up to whole MiB), not doubled:
the callers size calls by token buckets (`token_bucket`), which already bounds how often they grow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

ROW_ALIGN = 64  # bytes per row: whole cache lines (the push kernel moves 4-byte words)
MAX_RANKS = 64
COUNTS_BYTES = 2 * MAX_RANKS * 8  # each buffer starts with an int64 row count, then a status, per source rank
MIN_BUFFER_BYTES = 1 << 20  # the smallest receive buffer, and the unit sizes are rounded up to
MIN_TOKENS = 256  # the smallest token bucket buffers are sized for
SLOTS = 2  # receive buffers per transport (consecutive all-to-alls alternate between them)


class TransportMemoryError(RuntimeError):
    """The device transport's buffers could not grow on some rank; raised on every rank of the group.
    The transport keeps its earlier buffers: calls that fit them go on working."""


def row_bytes(payload_bytes: int) -> int:
    """Bytes a row of `payload_bytes` takes in the buffers (padded to `ROW_ALIGN`)."""
    return max(ROW_ALIGN, -(-payload_bytes // ROW_ALIGN) * ROW_ALIGN)


def token_bucket(num_tokens: int) -> int:
    """Buffers are sized for this many tokens per rank: the next power of two, at least `MIN_TOKENS`."""
    return max(MIN_TOKENS, 1 << max(0, num_tokens - 1).bit_length())


def buffer_bytes(num_bytes: int) -> int:
    """The rows' capacity a request of `num_bytes` gets: whole MiB, at least one."""
    return max(MIN_BUFFER_BYTES, -(-num_bytes // MIN_BUFFER_BYTES) * MIN_BUFFER_BYTES)


def slots_bytes(capacity_bytes: int) -> int:
    """GPU memory one rank's set of buffers of `capacity_bytes` of rows takes."""
    return SLOTS * (COUNTS_BYTES + capacity_bytes) if capacity_bytes else 0


@dataclass
class Slot:
    """One receive buffer of the group: `COUNTS_BYTES` of row counts and routing statuses (one int64
    each per source rank), then the rows; its rendezvous handle (the barrier) and every rank's rows and counts as
    addresses this process can store to (int64 device tensors, one entry per rank)."""

    buffer: torch.Tensor
    handle: Any
    peer_rows_D: torch.Tensor
    peer_counts_D: torch.Tensor

    def rows(self, num_rows: int, width: int) -> torch.Tensor:
        """This rank's received rows as [num_rows, width] bytes."""
        return self.buffer[COUNTS_BYTES : COUNTS_BYTES + num_rows * width].view(num_rows, width)

    def counts(self, num_ranks: int) -> torch.Tensor:
        """Rows received from each source rank (int64 [D], a view of the buffer)."""
        return self.buffer[: 8 * num_ranks].view(torch.int64)

    def statuses(self, num_ranks: int) -> torch.Tensor:
        """The routing status each source rank sent with its rows (int64 [D], a view of the buffer)."""
        return self.buffer[8 * MAX_RANKS : 8 * (MAX_RANKS + num_ranks)].view(torch.int64)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()


def allocate(symm_mem: Any, capacity_bytes: int, device: torch.device) -> tuple[list[torch.Tensor], str | None]:
    """This rank's new buffers for `capacity_bytes` of rows, allocated locally (no peer involved):
    (the buffers, None), or ([], why not) where the GPU could not hold them."""
    buffers: list[torch.Tensor] = []
    try:
        for _ in range(SLOTS):
            buffers.append(symm_mem.empty(COUNTS_BYTES + capacity_bytes, dtype=torch.uint8, device=device))
    except (torch.OutOfMemoryError, RuntimeError) as exc:  # the CUDA backend reports a failed cuMemCreate as either
        buffers.clear()
        return [], str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return buffers, None


def free_gpu_bytes(device: torch.device) -> int:
    """Free memory on `device` as the driver counts it (0 where it cannot say)."""
    if device.type != "cuda":
        return 0
    try:
        return int(torch.cuda.mem_get_info(device)[0])
    except (RuntimeError, AssertionError):
        return 0


class GrowthVote:
    """Step 2 of a growth: whether every rank allocated, and each rank's free GPU memory, through the
    transport's host board (`occult.moe.agree`: an element-wise maximum over the group's ranks)."""

    def __init__(self, board: Any, rank: int, num_ranks: int) -> None:
        self.board, self.rank, self.num_ranks = board, rank, num_ranks

    def cast(self, failed: bool, free_bytes: int) -> tuple[list[int], list[int]]:
        """(the ranks that failed, every rank's free MiB), the same on every rank. Each rank fills its
        own entry of the board's row (free MiB times two, plus one where it failed); the maximum over
        ranks then holds every rank's entry."""
        mine = [0] * (1 + self.num_ranks)
        mine[1 + self.rank] = (free_bytes >> 20) * 2 + int(failed)
        entries = self.board.max_reduce(mine)[1:]
        return [r for r, e in enumerate(entries) if e & 1], [e >> 1 for e in entries]


def growth_error(
    capacity_bytes: int, held_bytes: int, failed: list[int], free_mib_D: list[int], why: str | None
) -> TransportMemoryError:
    """The one message every rank raises where a growth failed."""
    asked = slots_bytes(capacity_bytes)
    free = ", ".join(f"rank {r}: {mib / 1024:.1f} GiB" for r, mib in enumerate(free_mib_D))
    return TransportMemoryError(
        f"the device transport could not grow its receive buffers to {asked:,} bytes per rank "
        f"({SLOTS} x {COUNTS_BYTES + capacity_bytes:,}) on rank(s) {failed} (free GPU memory {free}"
        + (f"; this rank: {why}" if why else "")
        + f"). Its buffers stay at {held_bytes:,} bytes and keep working for calls that fit them. "
        "Pass fewer tokens per call, free GPU memory (occult.release_transports() frees the transports' "
        "buffers), or use ExecConfig(transport='counts'), which needs no such buffers"
    )


def map_slot(symm_mem: Any, buffer: torch.Tensor, group_name: str, rank: int, num_ranks: int) -> Slot:
    """Step 3: map `buffer` into every peer (the collective `rendezvous`) and record the peers' addresses."""
    handle = symm_mem.rendezvous(buffer, group=group_name)
    shift = buffer.data_ptr() - handle.buffer_ptrs[rank]  # where the tensor starts in its allocation
    bases = [handle.buffer_ptrs[d] + shift for d in range(num_ranks)]
    if any((b + COUNTS_BYTES) % 16 for b in bases):  # the push kernels store 16 bytes at a time there
        raise RuntimeError(
            f"symmetric memory mapped a receive buffer at {[hex(b) for b in bases]}, not 16-byte "
            "aligned: the device transport cannot use it; pass transport='counts'"
        )
    # (the counts are not zeroed: a peer may already have written its count here, and every
    # all-to-all writes every count before its barrier)
    device = buffer.device
    return Slot(
        buffer,
        handle,
        torch.tensor([b + COUNTS_BYTES for b in bases], dtype=torch.int64, device=device),
        torch.tensor(bases, dtype=torch.int64, device=device),
    )
