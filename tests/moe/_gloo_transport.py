"""A CPU stand-in for the device transport, for the tests of its data flow on gloo ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist

from occult.moe import agree, symm


class GlooTransport(symm.DeviceTransport):
    """`DeviceTransport` with plain buffers and gloo's `all_to_all_single` (the counts read on the host),
    delivering into the same region-per-source layout; the unwritten rows of a region hold junk (255s)."""

    def __init__(self, group) -> None:  # noqa: D107 (no symmetric memory here)
        self.group, self.group_name = group, "stand-in"
        self.num_ranks, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.host_group = group
        self.board = agree.make_board(group, 1 + self.num_ranks, 60.0)  # on one host: the shared page
        self.capacity_bytes = 0
        self.grown = 0
        self.step_tokens = None

    def fits(self, num_bytes: int) -> bool:
        return num_bytes <= self.capacity_bytes

    def reserve(self, num_bytes: int) -> None:
        if num_bytes > self.capacity_bytes:
            self.grown += 1
            self.capacity_bytes = num_bytes

    def exchange(self, src_NW, counts_D, stride, src_stride=0, status=None, copy_counts=True):
        D, width = self.num_ranks, src_NW.shape[1]
        assert D * stride * width <= self.capacity_bytes
        send = [int(v) for v in counts_D.tolist()]
        first = [d * src_stride for d in range(D)] if src_stride else [sum(send[:d]) for d in range(D)]
        assert max(send) <= stride
        recv_counts = torch.empty_like(counts_D)
        dist.all_to_all_single(recv_counts, counts_D.clone(), group=self.group)
        recv = [int(v) for v in recv_counts.tolist()]
        rows = torch.cat([src_NW[o : o + n] for o, n in zip(first, send)])
        got = torch.empty((sum(recv), width), dtype=torch.uint8)
        dist.all_to_all_single(got, rows.contiguous(), recv, send, group=self.group)
        out = torch.full((D * stride, width), 255, dtype=torch.uint8)
        for s, part in enumerate(got.split(recv)):
            out[s * stride : s * stride + recv[s]] = part
        statuses = None
        if status is not None:  # every rank's status, as the push kernel stores them
            statuses = torch.empty(D, dtype=torch.int64)
            dist.all_gather_into_tensor(statuses, status.reshape(1).to(torch.int64), group=self.group)
        return out, recv_counts, statuses

    def exchange_packed(self, rows, counts_D, stride, status=None, copy_counts=True):
        """The real transport gathers the rows straight into the peers' memory; here: staged, then sent
        (the counts and statuses are always fresh tensors: views or copies read the same)."""
        return self.exchange(rows.staged(), counts_D, stride, status=status)
