"""The device transport's buffers grow all or nothing, to what a call asks, and can be freed: the
growth protocol of `DeviceTransport.reserve` on stand-ins for symmetric memory and the host board (the
real allocation and mapping run in the GPU suite: tests/gpu/test_collective_transport_memory.py)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from occult import TransportMemoryError
from occult.moe.symm import DeviceTransport
from occult.moe.transport_buffers import COUNTS_BYTES, MIN_BUFFER_BYTES, SLOTS, GrowthVote, buffer_bytes
from occult.teardown import hold_buffers, release_buffers

MIB = 1 << 20


class StandInSymmMem:
    """`torch.distributed._symmetric_memory` as `reserve` uses it: local `empty`, collective `rendezvous`."""

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.mapped = fail, 0

    def empty(self, num_bytes: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self.fail:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {num_bytes} bytes")
        return torch.empty(num_bytes, dtype=dtype, device=device)

    def rendezvous(self, buffer: torch.Tensor, group: str) -> SimpleNamespace:
        self.mapped += 1
        return SimpleNamespace(buffer_ptrs=[buffer.data_ptr()] * 2)


class StandInBoard:
    """The host board of a 2-rank group seen from rank 0: rank 1's entry is what the test sets."""

    def __init__(self) -> None:
        self.peer_failed, self.peer_free_mib, self.rounds = False, 1000, 0

    def max_reduce(self, values: list[int]) -> list[int]:
        self.rounds += 1
        out = list(values)
        out[2] = max(out[2], self.peer_free_mib * 2 + int(self.peer_failed))
        return out


def _transport(symm_mem: StandInSymmMem, board: StandInBoard) -> DeviceTransport:
    """Rank 0 of 2 with no buffers yet (no process group: the attributes `reserve` reads)."""
    t = DeviceTransport.__new__(DeviceTransport)
    t.group_name, t.rank, t.num_ranks, t.device = "stand-in", 0, 2, torch.device("cpu")
    t._symm_mem, t.capacity_bytes, t.generation = symm_mem, 0, 0
    t._slots, t._retired, t._captured, t._turn = [], [], False, 0
    t._vote = GrowthVote(board, 0, 2)
    return t


def test_buffers_grow_to_what_a_call_asks_in_whole_mib_not_doubled():
    t = _transport(StandInSymmMem(), StandInBoard())
    asked = random.randint(3 * MIB, 40 * MIB)
    t.reserve(asked)
    assert t.capacity_bytes == buffer_bytes(asked) and asked <= t.capacity_bytes < asked + MIB
    assert t.memory_bytes == SLOTS * (COUNTS_BYTES + t.capacity_bytes) and t.generation == 1
    slots = list(t._slots)
    t.reserve(asked - MIB)  # fits: nothing changes, no collective
    assert t._slots == slots and t.generation == 1
    t.reserve(t.capacity_bytes + 1)  # one byte more: one MiB more, not twice the size
    assert t.capacity_bytes == buffer_bytes(asked) + MIB and t.generation == 2
    assert buffer_bytes(0) == buffer_bytes(1) == MIN_BUFFER_BYTES


@pytest.mark.parametrize("where", ["this rank", "a peer"])
def test_a_failed_growth_raises_on_every_rank_and_keeps_the_old_buffers(where):
    symm_mem, board = StandInSymmMem(), StandInBoard()
    t = _transport(symm_mem, board)
    t.reserve(2 * MIB)
    slots, held, mapped = list(t._slots), t.memory_bytes, symm_mem.mapped
    symm_mem.fail, board.peer_failed = where == "this rank", where == "a peer"
    board.peer_free_mib = 1536
    with pytest.raises(TransportMemoryError) as err:
        t.reserve(64 * MIB)
    message = str(err.value)
    assert f"on rank(s) [{0 if where == 'this rank' else 1}]" in message, message
    assert f"{SLOTS * (COUNTS_BYTES + 64 * MIB):,} bytes per rank" in message and "rank 1: 1.5 GiB" in message
    assert f"stay at {held:,} bytes" in message and "release_transports" in message
    assert ("Tried to allocate" in message) == (where == "this rank")
    assert symm_mem.mapped == mapped  # nothing was mapped: no rank is left waiting in the collective
    assert t._slots == slots and t.memory_bytes == held and t.capacity_bytes == 2 * MIB and t.generation == 1
    assert t.next_slot() is slots[0]  # the old buffers go on working
    symm_mem.fail, board.peer_failed = False, False
    t.reserve(64 * MIB)  # and a later growth that fits succeeds
    assert t.capacity_bytes == 64 * MIB and t.generation == 2


def test_released_buffers_are_gone_until_the_next_growth():
    t = _transport(StandInSymmMem(), StandInBoard())
    t.reserve(5 * MIB)
    held = t.memory_bytes
    assert t.release() == held and t.memory_bytes == 0 and t.capacity_bytes == 0 and t.generation == 2
    with pytest.raises(RuntimeError, match="holds no buffers"):
        t.next_slot()
    assert t.release() == 0
    t.reserve(MIB)
    assert t.capacity_bytes == MIB and t.next_slot() is not None


def test_teardown_frees_registered_buffers_and_skips_a_broken_holder_only_when_asked():
    class Holder:
        def __init__(self, freed: int, broken: bool = False) -> None:
            self.freed, self.broken = freed, broken

        def release(self) -> int:
            if self.broken:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return self.freed

    ok, broken = Holder(3 * MIB), Holder(MIB, broken=True)
    hold_buffers(ok)
    assert release_buffers() >= 3 * MIB
    hold_buffers(broken)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        release_buffers()
    assert release_buffers(strict=False) >= 3 * MIB  # the broken one skipped, the others freed
    del ok, broken  # (held weakly: gone with the test)
