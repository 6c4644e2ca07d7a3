"""The host transport: all-to-alls through shared pinned host memory, moved by the GPUs' copy engines.

Where the GPUs of one host cannot reach each other's memory (PCIe without peer-to-peer, or `NCCL_P2P_DISABLE=1`),
every row crosses host memory whatever moves it. NCCL moves it with copy kernels on SMs, at well under the rate
the GPUs' own copies to and from pinned host memory reach (docs/overlap.md, "The slow link's ceiling"); here the
copy engines move it, at that rate, and leave every SM to the experts running beside the exchange.

Layout (`RingLayout`): one shared-memory file per group, registered with CUDA by every rank (pinned, mapped). Each
ordered pair of ranks (src, dst) owns a ring of `SLOTS` slots of `SLOT_BYTES` and one 32-bit flag per slot
(0 free, 1 full). A pair's bytes go in chunks (`chunk_sizes`), each through the pair's next slot: the sender's
stream for that peer waits for the slot's flag to read 0, copies the chunk device -> slot and sets the flag to 1;
the receiver's stream for that peer waits for 1, copies slot -> device and sets it to 0. Stream memory
operations do the hand-off on the GPUs (`occult.moe.cuda_driver`): no host in the loop, no kernel, and CUDA graphs
record them. Both ranks of a pair walk its slots in the same order: each keeps a running count of the pair's
chunks, advanced by the same amount (a sender's send split is its peer's receive split), and every rank makes
the same sequence of all-to-alls (as with NCCL), replays of captured ones included.

A peer that never arrives: an eager all-to-all that has not finished within the group's collective timeout ends
the process with a message (`ExchangeWatch`, as NCCL's watchdog does), and so does one whose issue failed half-way
(its streams may wait for flags no peer sets); all-to-alls replayed from CUDA graphs are not watched (as NCCL's
are not).
"""

from __future__ import annotations

import math
import os
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from occult.moe import cuda_driver
from occult.moe.agree import create_page, gloo_group
from occult.moe.symm import group_timeout_s
from occult.teardown import hold_buffers, release_captured

SLOTS = 4  # slots per ordered pair of ranks
SLOT_BYTES = 4 << 20  # the largest chunk
MIN_CHUNK = 256 << 10  # the smallest chunk a pair's bytes are cut into (unless it has fewer)
_FLAG_STRIDE = 64  # bytes between two flags
_ALIGN = 4096

_WIRES: dict[str, HostWire] = {}


def chunk_sizes(nbytes: int) -> list[int]:
    """The chunks one pair's `nbytes` go in: about `SLOTS` of them (so that the ring's slots pipeline the copies
    both ways), each between `MIN_CHUNK` and `SLOT_BYTES` (4 KiB multiples), the last the remainder."""
    if nbytes <= 0:
        return []
    chunk = min(SLOT_BYTES, max(MIN_CHUNK, -(-math.ceil(nbytes / SLOTS) // _ALIGN) * _ALIGN))
    full, rest = divmod(nbytes, chunk)
    return [chunk] * full + ([rest] if rest else [])


@dataclass(frozen=True)
class RingLayout:
    """Byte offsets in the shared file of `world` ranks: the flags first (one page-aligned block), then the slots."""

    world: int
    slots: int = SLOTS
    slot_bytes: int = SLOT_BYTES

    @property
    def flag_bytes(self) -> int:
        return -(-(self.world * self.world * self.slots * _FLAG_STRIDE) // _ALIGN) * _ALIGN

    @property
    def nbytes(self) -> int:
        return self.flag_bytes + self.world * self.world * self.slots * self.slot_bytes

    def _index(self, src: int, dst: int, slot: int) -> int:
        return (src * self.world + dst) * self.slots + slot

    def flag(self, src: int, dst: int, slot: int) -> int:
        return self._index(src, dst, slot) * _FLAG_STRIDE

    def data(self, src: int, dst: int, slot: int) -> int:
        return self.flag_bytes + self._index(src, dst, slot) * self.slot_bytes


def unavailable_reason(group: Any, host_group: Any) -> str | None:
    """Why the host transport cannot serve `group` (None: it can); a collective over `host_group`."""
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if dist.get_backend(group) != "nccl":
        return f"the group's backend is {dist.get_backend(group)}, not nccl"
    hosts: list[Any] = [None] * dist.get_world_size(host_group)
    dist.all_gather_object(hosts, socket.gethostname(), group=host_group)
    if len(set(hosts)) > 1:
        return f"the group spans {len(set(hosts))} hosts (the transport shares host memory: one host)"
    return None


class ExchangeWatch:
    """Ends the process when an eager all-to-all has not finished within `timeout_s` (a peer died or stopped)."""

    def __init__(self, timeout_s: float, rank: int) -> None:
        self.timeout_s, self.rank = timeout_s, rank
        self._open: deque[tuple[torch.cuda.Event, float]] = deque()
        self._thread: threading.Thread | None = None

    def watch(self, stream: torch.cuda.Stream) -> None:
        """Watch the work queued on `stream` so far (the all-to-all just issued)."""
        done = torch.cuda.Event()
        done.record(stream)
        self.add(done, torch.cuda.current_device())

    def add(self, done: Any, device: int | None) -> None:
        """Watch `done` (anything with `query()`: True once finished), an event of GPU `device` (None: no GPU to set
        up in the watching thread)."""
        self._open.append((done, time.monotonic()))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, args=(device,), daemon=True)
            self._thread.start()

    def _run(self, device: int | None) -> None:
        if device is not None:
            torch.cuda.set_device(device)
            cuda_driver.relax_capture_mode()  # (the main thread may be capturing a graph while this one queries)
        while True:
            time.sleep(min(1.0, self.timeout_s / 20))
            while self._open and self._finished(self._open[0][0]):
                self._open.popleft()
            if self._open and time.monotonic() - self._open[0][1] > self.timeout_s:
                print(
                    f"occult: rank {self.rank}: an all-to-all of the host transport did not finish within "
                    f"{self.timeout_s:g} s (a peer rank died or stopped calling the MoE layer); ending the process",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(1)

    @staticmethod
    def _finished(done: torch.cuda.Event) -> bool:
        try:
            return done.query()
        except RuntimeError:  # (the context in an error state: the main thread raises that error itself)
            return True


class HostWire:
    """All-to-alls of one NCCL group of one host through shared pinned host memory (one per group: `for_group`)."""

    def __init__(self, group: Any, host_group: Any, timeout_s: float) -> None:
        self.group, self.host_group, self.timeout_s = group, host_group, timeout_s
        self.name = group.group_name  # (`_WIRES`' key: how a traced exchange finds its wire)
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.layout = RingLayout(self.world)
        self.peers = [(self.rank + i) % self.world for i in range(1, self.world)]
        self._streams = {(p, way): torch.cuda.Stream() for p in self.peers for way in ("send", "receive")}
        self._chunks = {(p, way): 0 for p in self.peers for way in ("send", "receive")}  # chunks walked per pair
        self._file: torch.Tensor | None = None
        self._device_base = 0
        self._captured = False
        self.watch = ExchangeWatch(timeout_s, self.rank)
        hold_buffers(self)  # unregistered before the process group is destroyed (occult.teardown)

    @classmethod
    def for_group(cls, group: Any) -> HostWire:
        """The host transport of `group`, made once (every rank of the group makes it at the same point); a clear
        error where it cannot run."""
        wire = _WIRES.get(group.group_name)
        if wire is not None and wire.group is group:
            return wire
        timeout_s = group_timeout_s(group)
        host_group = gloo_group(dist.get_process_group_ranks(group), timeout_s)
        reason = unavailable_reason(group, host_group)
        if reason is not None:
            raise ValueError(f"the host transport cannot run here: {reason}; use transport='counts' or 'auto'")
        wire = _WIRES[group.group_name] = cls(group, host_group, timeout_s)
        return wire

    @property
    def memory_bytes(self) -> int:
        """Shared pinned host memory this rank has mapped (0 until the first all-to-all)."""
        return self.layout.nbytes if self._file is not None else 0

    def all_to_all(self, x: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        """Rows of `x` [P, ...] out along `send_splits` (rows per destination rank), rows in along `recv_splits`:
        the received [sum(recv_splits), ...] in source-rank order, as `dist.all_to_all_single` returns them."""
        self._ensure_file()
        x = x.contiguous()
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        row = math.prod(x.shape[1:]) * x.element_size()
        send_at, recv_at = _starts(send_splits), _starts(recv_splits)
        main = torch.cuda.current_stream()
        ready = torch.cuda.Event()
        ready.record(main)
        sends = [(p, "send", x.data_ptr() + send_at[p] * row, send_splits[p] * row) for p in self.peers]
        receives = [(p, "receive", out.data_ptr() + recv_at[p] * row, recv_splits[p] * row) for p in self.peers]
        ends = self._walk_all([w for pair in zip(sends, receives) for w in pair], ready)
        me = self.rank
        out[recv_at[me] : recv_at[me] + recv_splits[me]].copy_(x[send_at[me] : send_at[me] + send_splits[me]])
        for end in ends:
            if end is not None:
                main.wait_event(end)
        if torch.cuda.is_current_stream_capturing():
            self._captured = True
        else:
            self.watch.watch(main)
        return out

    def traced_all_to_all(self, x: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        """`all_to_all` as one opaque operator torch.compile keeps in its graph (`occult::host_all_to_all`): the
        compiled code calls this wire at run time, in the order the graph gives its exchanges (the same on every
        rank), so a traced sync-free layer keeps the host transport instead of NCCL's functional collective."""
        return torch.ops.occult.host_all_to_all(x.contiguous(), send_splits, recv_splits, self.name)

    def _walk_all(self, walks: list[tuple[int, str, int, int]], ready: torch.cuda.Event) -> list:
        """`_walk` each (peer, way, address, bytes) in turn; their end events. Where one fails half-way (a driver
        call refused), the pair streams may hold waits for flags that no peer will set: each is watched before the
        error goes up, so the process ends within the timeout instead of hanging at its next synchronisation."""
        try:
            return [self._walk(peer, way, address, nbytes, ready) for peer, way, address, nbytes in walks]
        except BaseException:
            if not torch.cuda.is_current_stream_capturing():  # (a failed capture is abandoned with its streams' work)
                for stream in self._streams.values():
                    self.watch.watch(stream)
            raise

    def _walk(self, peer: int, way: str, address: int, nbytes: int, ready: torch.cuda.Event) -> torch.cuda.Event | None:
        """Queue one pair's chunks on its stream for `way`: each a wait for its slot, a copy and a flag write; a
        chunk's flag write and the next chunk's wait go as one operation (fewer nodes in a captured graph)."""
        chunks = chunk_sizes(nbytes)
        if not chunks:
            return None
        stream = self._streams[(peer, way)]
        stream.wait_event(ready)
        handle = stream.cuda_stream
        src, dst = (self.rank, peer) if way == "send" else (peer, self.rank)
        start = self._chunks[(peer, way)]
        ready_value, done_value = (0, 1) if way == "send" else (1, 0)  # (a sender fills free slots, a receiver full)
        slots = [(start + i) % self.layout.slots for i in range(len(chunks))]
        flags = [self._device_base + self.layout.flag(src, dst, slot) for slot in slots]
        cuda_driver.wait_value(handle, flags[0], ready_value)
        offset = 0
        for i, size in enumerate(chunks):
            data = self._device_base + self.layout.data(src, dst, slots[i])
            if way == "send":
                cuda_driver.copy_async(data, address + offset, size, handle)
            else:
                cuda_driver.copy_async(address + offset, data, size, handle)
            then = [("wait", flags[i + 1], ready_value)] if i + 1 < len(chunks) else []
            cuda_driver.memory_ops(handle, [("write", flags[i], done_value), *then])
            offset += size
        self._chunks[(peer, way)] = start + len(chunks)
        end = torch.cuda.Event()
        end.record(stream)
        return end

    def _ensure_file(self) -> None:
        """Map the group's shared file (a collective over the host group, at the first all-to-all or the first after
        `release`): rank 0 makes it, every rank maps and registers it, then its name goes."""
        if self._file is not None:
            return
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "the host transport maps its shared memory at its first all-to-all, which cannot run inside a "
                "CUDA-graph capture: run the same forward once eagerly before capturing it"
            )
        nbytes = self.layout.nbytes
        path = [create_page(nbytes, prefix="occult-wire-") if self.rank == 0 else None]
        dist.broadcast_object_list(path, src=dist.get_global_rank(self.host_group, 0), group=self.host_group)
        mapped, why = None, None
        try:
            mapped = torch.from_file(path[0], shared=True, size=nbytes, dtype=torch.uint8)
            self._device_base = cuda_driver.register_host(mapped.data_ptr(), nbytes)
        except (OSError, RuntimeError) as exc:
            mapped, why = None, str(exc)
        failed: list[Any] = [None] * self.world
        dist.all_gather_object(failed, why, group=self.host_group)  # every rank mapped it or knows who did not
        if self.rank == 0:
            os.unlink(path[0])  # (every rank has mapped it by now: the name can go)
        if any(failed):
            if mapped is not None:
                cuda_driver.unregister_host(mapped.data_ptr())
            problems = "; ".join(f"rank {r}: {w}" for r, w in enumerate(failed) if w)
            raise RuntimeError(f"the host transport could not map {nbytes} bytes of shared pinned memory: {problems}")
        self._file = mapped

    def release(self) -> int:
        """Unregister and unmap the shared memory (graphs captured over it first: `occult.teardown`); the next
        all-to-all maps a new one. Every rank of the group calls it at the same point. Returns the bytes freed."""
        freed = self.memory_bytes
        if self._file is not None:
            if self._captured:
                release_captured()
            torch.cuda.synchronize()
            cuda_driver.unregister_host(self._file.data_ptr())
            self._file = None
        self._captured = False
        self._chunks = dict.fromkeys(self._chunks, 0)  # a new file's flags all read 0
        return freed


@torch.library.custom_op("occult::host_all_to_all", mutates_args=())
def _host_all_to_all(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], wire: str) -> torch.Tensor:
    """The operator behind `HostWire.traced_all_to_all`: the exchange through the wire of group `wire`."""
    return _WIRES[wire].all_to_all(x, list(send_splits), list(recv_splits))


@_host_all_to_all.register_fake
def _host_all_to_all_shape(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], wire: str) -> torch.Tensor:
    return x.new_empty((sum(recv_splits), *x.shape[1:]))


def _starts(splits: list[int]) -> list[int]:
    starts, total = [], 0
    for n in splits:
        starts.append(total)
        total += n
    return starts


def release_wires() -> int:
    """Unmap every host transport's shared memory on this rank; returns the bytes freed."""
    return sum(wire.release() for wire in list(_WIRES.values()))


def reset() -> None:
    """Free and forget every host transport; for tests and process teardown."""
    release_wires()
    _WIRES.clear()
