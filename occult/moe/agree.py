"""A host-only element-wise maximum over the ranks of a group, without waiting for any GPU.

The device transport (`occult.moe.symm`) needs, at every layer call, the largest token count of
any rank (its buffer bound) and every rank's host-known input status. A gloo all-reduce gives that
but costs hundreds of microseconds of host time a call. Ranks on one host instead meet on a page of
shared memory (`SharedBoard`): each writes its values and a round number into its own row, then
reads every row once all show that round; a few microseconds when the ranks arrive together.
Groups spanning hosts fall back to gloo (`GlooBoard`).

A round can also be split (`post`, then `collect` later): a training step whose token counts are
agreed once (`occult.moe.step`) posts each layer call's round without waiting and reads
it at the next call, one call late, so the hosts need not arrive together.

Rows are double-buffered by the round's parity: a rank posts round n+1 only after it has read
round n (`post` reads an unread round first), so it can post round n+1 only after every rank
posted round n, and every rank read round n-1 before posting round n: a row is never rewritten
while someone still reads it. The values are written before the round number (x86-64
keeps stores in order, as it keeps loads in order); a peer that never arrives ends the wait with a
clear error after `timeout_s`.
"""

from __future__ import annotations

import datetime
import mmap
import os
import socket
import tempfile
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


class GlooBoard:
    """The element-wise maximum through a gloo all-reduce (any group, any hosts)."""

    def __init__(self, host_group: Any) -> None:
        self.host_group = host_group
        self.round = 0
        self._open: tuple[Any, torch.Tensor] | None = None  # the posted round's all-reduce, not yet read
        self._last: list[int] = []

    def max_reduce(self, values: list[int]) -> list[int]:
        """The element-wise maximum of every rank's `values` (every rank calls it with as many)."""
        self.post(values)
        return self.collect()

    def post(self, values: list[int]) -> int:
        """Start a round with `values` (an unread earlier round is read first); its number."""
        if self._open is not None:
            self.collect()
        payload = torch.tensor(values, dtype=torch.int64)
        self._open = (dist.all_reduce(payload, op=dist.ReduceOp.MAX, group=self.host_group, async_op=True), payload)
        self.round += 1
        return self.round

    def collect(self) -> list[int]:
        """The last posted round's maximum (waits for every rank's values)."""
        if self._open is not None:
            work, payload = self._open
            work.wait()
            self._open, self._last = None, payload.tolist()
        return self._last

    @property
    def unread(self) -> bool:
        """Whether the last posted round has not been read yet."""
        return self._open is not None


class SharedBoard:
    """The element-wise maximum through a shared-memory page (every rank of the group on this host)."""

    def __init__(self, host_group: Any, width: int, timeout_s: float) -> None:
        self.rank, self.world = dist.get_rank(host_group), dist.get_world_size(host_group)
        self.width, self.timeout_s, self.round = width, timeout_s, 0
        nbytes = self.world * 2 * (width + 1) * 8
        path = [create_page(nbytes) if self.rank == 0 else None]
        dist.broadcast_object_list(path, src=dist.get_global_rank(host_group, 0), group=host_group)
        with open(path[0], "r+b") as f:
            self._page = mmap.mmap(f.fileno(), nbytes)
        dist.barrier(group=host_group)  # every rank has it mapped: the name can go
        if self.rank == 0:
            os.unlink(path[0])
        self.rows = np.frombuffer(self._page, dtype=np.int64).reshape(self.world, 2, width + 1)
        self.read_round, self._last = 0, []  # the last round read, and its maximum

    def max_reduce(self, values: list[int]) -> list[int]:
        """The element-wise maximum of every rank's `values` (every rank calls it with as many)."""
        self.post(values)
        return self.collect()

    def post(self, values: list[int]) -> int:
        """Write `values` as the next round (an unread earlier round is read first: module docstring);
        returns at once with the round's number."""
        if self.unread:
            self.collect()
        self.round += 1
        mine = self.rows[self.rank, self.round % 2]
        mine[1:] = values
        mine[0] = self.round  # after the values: a peer that sees the round sees them
        return self.round

    @property
    def unread(self) -> bool:
        """Whether the last posted round has not been read yet."""
        return self.read_round < self.round

    def collect(self) -> list[int]:
        """The last posted round's maximum, once every rank posted it (a clear error after `timeout_s`)."""
        if not self.unread:
            return self._last
        parity = self.round % 2
        rounds = self.rows[:, parity, 0]
        deadline, spins = None, 0
        while (rounds < self.round).any():
            spins += 1
            if spins > 200:
                time.sleep(0)
                deadline = deadline or time.monotonic() + self.timeout_s
                if time.monotonic() > deadline:
                    late = [r for r in range(self.world) if rounds[r] < self.round]
                    raise RuntimeError(
                        f"ranks {late} did not reach the MoE layer's agreement within {self.timeout_s:.0f} s "
                        "(a rank died or stopped calling the layer)"
                    )
        self.read_round, self._last = self.round, self.rows[:, parity, 1:].max(axis=0).tolist()
        return self._last


def create_page(nbytes: int, prefix: str = "occult-agree-") -> str:
    """A zeroed file of nbytes in shared memory (/dev/shm where there is one); its path."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix=prefix, dir=folder)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    return path


def make_board(host_group: Any, width: int, timeout_s: float) -> SharedBoard | GlooBoard:
    """A `SharedBoard` where every rank of `host_group` runs on this host, else a `GlooBoard`."""
    hosts: list[Any] = [None] * dist.get_world_size(host_group)
    dist.all_gather_object(hosts, socket.gethostname(), group=host_group)
    if len(set(hosts)) == 1:
        return SharedBoard(host_group, width, timeout_s)
    return GlooBoard(host_group)


def gloo_group(ranks: list[int], timeout_s: float) -> Any:
    """A gloo group over `ranks` made by those ranks alone (no other rank needs to join)."""
    return dist.new_group(
        ranks, backend="gloo", use_local_synchronization=True, timeout=datetime.timedelta(seconds=timeout_s)
    )
