"""The chunked schedule: a sync-free call's tokens in chunks whose all-to-alls run on a side
stream under the previous chunk's experts (`ExecConfig(chunks=C)`).

Where the link is slower than the experts (PCIe, NCCL without peer-to-peer, hosts apart), a
layer's dispatch and combine cost more than its expert compute, and in one call they run in series
with it. Split into C chunks, the side stream runs dispatch(0), dispatch(1), combine(0),
dispatch(2), combine(1), ... while the compute stream runs experts(c) as soon as dispatch(c) has
landed: chunk c's experts hide chunk c+1's dispatch and chunk c-1's combine. Each chunk is an
ordinary call of the one dispatcher contract (its own fixed-capacity plan, the same rows, the
same sums per token), so the function is the unchunked call's.

It applies where nothing waits on the host, so that launching chunk c+1 never waits for chunk c:
sync-free calls (fixed capacity; every rank passes the same token count, hence the same chunks),
several ranks, no autograd (a backward would need its own order of collectives on every rank).
Other calls run unchunked. Every rank launches the chunks' collectives in the same order (NCCL
matches them by order), whatever the GPU then overlaps. Under CUDA-graph capture
(`ExecConfig(graphs=True)`) the two streams fork and join by events inside the capture, so a
replay costs no host time per chunk. On CPU ranks the chunks run one after another (no streams):
the same function, nothing overlapped.
"""

from __future__ import annotations

from dataclasses import fields

import torch

from occult.moe.comm import CommStats
from occult.moe.contract import Dispatcher, ExpertFn, Schedule
from occult.moe.expert_map import ExpertMap

_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}  # device index -> the side stream its chunked calls share


def chunk_bounds(num_tokens: int, chunks: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk: `chunks` near-equal chunks (fewer when there are fewer tokens)."""
    count = max(1, min(chunks, num_tokens))
    edges = [num_tokens * c // count for c in range(count + 1)]
    return list(zip(edges[:-1], edges[1:]))


def run_chunked(dispatcher: Dispatcher, x_TH: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor,
                expert_map: ExpertMap, experts: ExpertFn, schedule: Schedule, chunks: int
                ) -> tuple[torch.Tensor, CommStats]:
    """The sync-free call in `chunks` chunks (module docstring): (y_TH, the rows sent, summed)."""
    bounds = chunk_bounds(x_TH.shape[0], chunks)
    schedule.run_while_waiting()  # no host wait in a sync-free call: at once, as the unchunked call does
    plain = Schedule(sync_free=True)

    def dispatch(c: int):
        a, b = bounds[c]
        return dispatcher.dispatch(x_TH[a:b], weights_TK[a:b], ids_TK[a:b], expert_map, plain)

    if not x_TH.is_cuda:
        outs, stats = [], []
        for c in range(len(bounds)):
            received, handle = dispatch(c)
            outs.append(dispatcher.combine(received.apply(experts), handle))
            stats.append(handle.stats)
        return torch.cat(outs), summed(stats)
    return _overlapped(dispatcher, dispatch, len(bounds), experts, x_TH.device)


def _overlapped(dispatcher: Dispatcher, dispatch, count: int, experts: ExpertFn,
                device: torch.device) -> tuple[torch.Tensor, CommStats]:
    """The chunks on two CUDA streams: all-to-alls (and their plans) on the side stream, experts on the
    caller's. Every chunk's tensors stay referenced until the streams join, so the allocator, which
    reuses memory per stream, never hands one stream a block the other still reads."""
    main, side = torch.cuda.current_stream(device), side_stream(device)
    side.wait_stream(main)  # the routing and the tokens are ready
    kept, outs, stats = [], [], []

    def dispatched(c: int):
        with torch.cuda.stream(side):
            received, handle = dispatch(c)
            landed = torch.cuda.Event()
            landed.record(side)
        return received, handle, landed

    pending = dispatched(0)
    for c in range(count):
        received, handle, landed = pending
        main.wait_event(landed)
        if c + 1 < count:
            pending = dispatched(c + 1)  # on the side stream under this chunk's experts
        y = received.apply(experts)
        computed = torch.cuda.Event()
        computed.record(main)
        with torch.cuda.stream(side):
            side.wait_event(computed)
            outs.append(dispatcher.combine(y, handle))
        kept.append((received, y, handle))
        stats.append(handle.stats)
    main.wait_stream(side)
    return torch.cat(outs), summed(stats)


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of `device` (one per device, made on first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def summed(stats: list[CommStats]) -> CommStats:
    """One `CommStats` with every figure summed over the chunks'."""
    total = CommStats()
    for one in stats:
        for f in fields(CommStats):
            setattr(total, f.name, getattr(total, f.name) + getattr(one, f.name))
    return total
