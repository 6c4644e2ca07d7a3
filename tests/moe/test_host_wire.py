"""The host transport (`occult.moe.host_wire`) where it can be checked without a GPU: how a pair's bytes are cut
into chunks, where the ring puts flags and slots, and the clear error on every rank where it cannot run (CPU gloo
ranks). Its exchanges against NCCL's, bit for bit, and layers over it: tests/gpu (test_collective_host_wire.py,
test_collective_layer.py)."""

from __future__ import annotations

import random

import pytest
import torch.distributed as dist

from occult import OccultMoE
from occult.distributed import run_ranks
from occult.moe.config import ExecConfig
from occult.moe.host_wire import MIN_CHUNK, SLOT_BYTES, SLOTS, RingLayout, chunk_sizes


def test_chunks_cover_the_bytes_within_the_slot_size():
    rng = random.Random()
    sizes = [0, 1, 4095, MIN_CHUNK, MIN_CHUNK + 1, SLOTS * SLOT_BYTES, 3 * SLOTS * SLOT_BYTES + 17]
    sizes += [rng.randrange(1, 64 << 20) for _ in range(200)]
    for n in sizes:
        chunks = chunk_sizes(n)
        assert sum(chunks) == n, n
        assert all(0 < c <= SLOT_BYTES for c in chunks), (n, chunks)
        assert all(c == chunks[0] for c in chunks[:-1]), (n, chunks)  # equal chunks, the last the remainder
        if n >= SLOTS * MIN_CHUNK:
            assert len(chunks) >= SLOTS or chunks[0] == SLOT_BYTES, (n, chunks)  # the slots pipeline the copies
        if n > 0:
            assert chunks[0] >= min(n, MIN_CHUNK), (n, chunks)


def test_ring_layout_gives_every_pair_its_own_flags_and_slots():
    for world in (2, 3, 4, 8):
        layout = RingLayout(world)
        flags, slots = set(), []
        for src in range(world):
            for dst in range(world):
                for s in range(layout.slots):
                    flags.add(layout.flag(src, dst, s))
                    slots.append(layout.data(src, dst, s))
        assert len(flags) == world * world * layout.slots and max(flags) + 4 <= layout.flag_bytes
        slots.sort()
        assert slots[0] >= layout.flag_bytes and slots[0] % 4096 == 0
        assert all(b - a == layout.slot_bytes for a, b in zip(slots, slots[1:]))
        assert slots[-1] + layout.slot_bytes == layout.nbytes


def test_exec_config_takes_host():
    assert ExecConfig(transport="host", sync_free=True).transport == "host"
    with pytest.raises(ValueError, match="transport must be one of"):
        ExecConfig(transport="shm")


def refusal_worker(rank: int, world: int) -> str:
    try:
        OccultMoE(16, 8, 4, 2, transport="host")
    except ValueError as e:
        message = str(e)
    else:
        message = "no error"
    layer = OccultMoE(16, 8, 4, 2, transport="counts")  # the group still works
    dist.barrier()
    return f"{message} | {layer.dispatcher.transport_name}"


def test_host_transport_refused_on_every_gloo_rank_with_the_reason():
    for out in run_ranks(refusal_worker, 2, timeout_s=120):
        assert "host transport cannot run here" in out and ("no CUDA GPU" in out or "not nccl" in out), out
        assert "transport='counts' or 'auto'" in out and out.endswith("| counts"), out
