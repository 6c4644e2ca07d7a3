"""The host transport (`occult.moe.host_wire`) where it can be checked without a GPU: how a pair's bytes are cut
into chunks, where the ring puts flags and slots, and the clear error on every rank where it cannot run (CPU gloo
ranks). Its exchanges against NCCL's, bit for bit, and layers over it: tests/gpu (test_collective_host_wire.py,
test_collective_layer.py)."""

from __future__ import annotations

import random
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from occult import OccultMoE
from occult.distributed import run_ranks
from occult.moe import cuda_driver
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


def test_a_stream_memory_operation_of_an_unknown_kind_is_refused_before_the_driver_is_called():
    with pytest.raises(ValueError, match="'wait' or 'write', not 'signal'"):
        cuda_driver.memory_ops(0, [("write", 4096, 1), ("signal", 8192, 0)])


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


_WATCH = """
import sys, time
from occult.moe.host_wire import ExchangeWatch

class Event:
    def __init__(self, finished): self.finished = finished
    def query(self): return self.finished

watch = ExchangeWatch(timeout_s=float(sys.argv[1]), rank=3)
watch.add(Event(sys.argv[2] == "finished"), device=None)
time.sleep(float(sys.argv[3]))
print("ran on")
"""


def test_an_all_to_all_that_never_finishes_ends_the_process_with_a_message():
    """A peer that never arrives: the watch ends the process (exit 1) soon after the timeout, naming the rank and
    why; a finished one is forgotten and the process runs on."""
    start = time.monotonic()
    hung = subprocess.run([sys.executable, "-c", _WATCH, "0.5", "open", "30"], capture_output=True, text=True)
    assert hung.returncode == 1 and "ran on" not in hung.stdout, (hung.returncode, hung.stdout, hung.stderr)
    assert "rank 3: an all-to-all of the host transport did not finish within 0.5 s" in hung.stderr, hung.stderr
    assert time.monotonic() - start < 20
    done = subprocess.run([sys.executable, "-c", _WATCH, "0.5", "finished", "1.5"], capture_output=True, text=True)
    assert done.returncode == 0 and "ran on" in done.stdout, (done.returncode, done.stdout, done.stderr)


def test_an_issue_that_fails_half_way_watches_every_pair_stream(monkeypatch):
    """A pair's walk refused half-way through an all-to-all's issue (a driver error): every pair stream, which may
    hold waits for flags no peer will set, is handed to the watch before the error goes up (else the process would
    hang at its next synchronisation instead of ending within the timeout); a capture's failure is not watched."""
    import torch

    from occult.moe.host_wire import HostWire

    class Watch:
        def __init__(self) -> None:
            self.streams: list[str] = []

        def watch(self, stream: str) -> None:
            self.streams.append(stream)

    walked: list[tuple[int, str]] = []

    def walk(peer: int, way: str, address: int, nbytes: int, ready: object) -> str:
        if len(walked) == 2:
            raise RuntimeError("cuStreamWaitValue32 failed")
        walked.append((peer, way))
        return f"end {peer} {way}"

    wire = object.__new__(HostWire)
    wire._streams = {(p, way): f"stream {p} {way}" for p in (1, 2) for way in ("send", "receive")}
    wire._walk = walk
    walks = [(p, way, 0, 8) for p in (1, 2) for way in ("send", "receive")]
    for capturing in (False, True):
        walked.clear()
        wire.watch = Watch()
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
        with pytest.raises(RuntimeError, match="cuStreamWaitValue32"):
            wire._walk_all(walks, ready=None)
        assert walked == [(1, "send"), (1, "receive")]
        assert sorted(wire.watch.streams) == ([] if capturing else sorted(wire._streams.values())), wire.watch.streams
    walked.clear()
    wire.watch = Watch()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert wire._walk_all(walks[:2], ready=None) == ["end 1 send", "end 1 receive"] and wire.watch.streams == []
