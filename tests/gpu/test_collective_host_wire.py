"""The host transport's all-to-all (`occult.moe.host_wire`) against NCCL's `all_to_all_single`, bit for bit.

Rows through shared pinned host memory, moved by copy engines, must arrive exactly as NCCL delivers them: uneven
splits, a rank that sends nothing, sizes from one chunk to many (the ring's slots wrapping), every dtype a row
can have; replays of a captured exchange with fresh data, eager exchanges of other sizes between them.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import occult
from occult.moe.host_wire import HostWire


def _wire(ranks) -> HostWire:
    if ranks.device.type != "cuda" or ranks.backend != "nccl":
        pytest.skip("the host transport serves NCCL ranks on CUDA GPUs")
    return HostWire.for_group(dist.group.WORLD)


def _splits(ranks, gen: torch.Generator, most: int, empty_rank: int | None) -> tuple[list[int], list[int]]:
    """Every rank's rows to every rank (drawn on every rank alike), a rank sending and receiving nothing: this
    rank's (send, recv) splits."""
    D = ranks.world_size
    table = torch.randint(0, most + 1, (D, D), generator=gen)
    if empty_rank is not None:
        table[empty_rank, :] = 0
        table[:, empty_rank] = 0
    return table[ranks.rank].tolist(), table[:, ranks.rank].tolist()


def _nccl(x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x, recv, send)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_all_to_all_matches_nccl(ranks, dtype):
    wire = _wire(ranks)
    gen = torch.Generator().manual_seed(ranks.seed + 41)  # the same splits on every rank
    dev_gen = torch.Generator(device=ranks.device).manual_seed(ranks.seed * 3 + ranks.rank)
    mismatches = 0
    for round_ in range(8):  # from a few rows (one small chunk) to ~20 MiB a pair (chunks of 4 MiB, slots wrapping)
        most = [3, 40, 700, 5000][round_ % 4]
        empty = (round_ % ranks.world_size) if round_ in (2, 5) else None
        send, recv = _splits(ranks, gen, most, empty)
        width = 2048 if dtype != torch.uint8 else 4112  # (a packed byte row: 16-byte multiple)
        if dtype == torch.uint8:
            x = torch.randint(0, 256, (sum(send), width), dtype=dtype, device=ranks.device, generator=dev_gen)
        else:
            x = torch.randn(sum(send), width, device=ranks.device, generator=dev_gen).to(dtype)
        got = wire.all_to_all(x, send, recv)
        mismatches += int(not torch.equal(got, _nccl(x, send, recv)))
    assert ranks.all_max(mismatches) == 0


def test_captured_all_to_all_replays_with_fresh_rows(ranks):
    """A captured exchange replayed with fresh rows, eager exchanges of other sizes between the replays (both walk
    the pair's slots on): every result bit-identical to NCCL's."""
    wire = _wire(ranks)
    gen = torch.Generator().manual_seed(ranks.seed + 43)
    dev_gen = torch.Generator(device=ranks.device).manual_seed(ranks.seed * 5 + ranks.rank)
    send, recv = _splits(ranks, gen, 1500, None)
    static_x = torch.randn(sum(send), 2048, device=ranks.device, generator=dev_gen).to(torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        wire.all_to_all(static_x, send, recv)  # the first exchange maps the shared memory: not in a capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = wire.all_to_all(static_x, send, recv)
    mismatches = 0
    for _ in range(4):
        static_x.copy_(torch.randn(static_x.shape, device=ranks.device, generator=dev_gen))
        graph.replay()
        mismatches += int(not torch.equal(static_out, _nccl(static_x, send, recv)))
        other_send, other_recv = _splits(ranks, gen, 900, None)
        y = torch.randn(sum(other_send), 1024, device=ranks.device, generator=dev_gen)
        mismatches += int(not torch.equal(wire.all_to_all(y, other_send, other_recv), _nccl(y, other_send, other_recv)))
    graph.reset()
    assert ranks.all_max(mismatches) == 0


def test_release_and_map_again(ranks):
    """`release` unmaps the shared memory (as a process group's teardown does); the next exchange maps a new file
    and is exact."""
    wire = _wire(ranks)
    x = torch.randn(300, 512, device=ranks.device)
    send = recv = [300 // ranks.world_size] * ranks.world_size
    x = x[: sum(send)]
    wire.all_to_all(x, send, recv)
    assert wire.memory_bytes > 0
    assert wire.release() > 0 and wire.memory_bytes == 0
    got = wire.all_to_all(x, send, recv)
    assert ranks.all_max(float(not torch.equal(got, _nccl(x, send, recv)))) == 0
    assert occult.release_transports() >= wire.layout.nbytes and wire.memory_bytes == 0  # (the public call too)
    got = wire.all_to_all(x, send, recv)
    assert ranks.all_max(float(not torch.equal(got, _nccl(x, send, recv)))) == 0
