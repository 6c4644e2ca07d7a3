"""`occult.training.grads.all_reduce_in_place` on gloo ranks: every tensor becomes the sum over the ranks (divided
where asked), the large contiguous ones reduced where they lie (same storage), the small and the non-contiguous ones
through one flat buffer; the threshold lowered so that CPU-sized tensors take both paths."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from occult.distributed import run_ranks
from occult.training import grads
from occult.training.parallel import setup_parallel

WORLD = 2


def _tensors(seed: int, rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 7 + rank)
    shapes = [(3,), (40, 5), (7, 9), (2,), (64,), (11, 13)]
    out = [torch.randn(s, generator=g) for s in shapes]
    out[5] = out[5].t()  # large but not contiguous: flattened
    return out


def _worker(rank: int, world: int, seed: int, divide: int) -> dict:
    par = setup_parallel()
    grads.IN_PLACE_BYTES = 64 * 4  # (a tensor of >= 64 floats is "large" here)
    tensors = _tensors(seed, rank)
    before = [t.data_ptr() for t in tensors]
    calls, all_reduce = [], dist.all_reduce

    def logged(t, *args, **kwargs):
        calls.append((t.data_ptr(), t.numel()))
        return all_reduce(t, *args, **kwargs)

    dist.all_reduce = logged
    try:
        grads.all_reduce_in_place(tensors, par.world_group, divide)
    finally:
        dist.all_reduce = all_reduce
    want = [torch.zeros_like(t) for t in tensors]
    for r in range(world):
        for w, t in zip(want, _tensors(seed, r)):
            w += t
    large = [t.is_contiguous() and t.numel() >= 64 for t in _tensors(seed, rank)]
    dist.barrier()
    return {
        "err": max(float((t - w / divide).abs().max()) for t, w in zip(tensors, want)),
        "kept": [a == t.data_ptr() for a, t in zip(before, tensors)],
        "large": large,
        "calls": calls,
        "where": before,
        "sizes": [t.numel() for t in tensors],
    }


@pytest.mark.parametrize("divide", [1, 2])
def test_large_gradients_reduced_where_they_lie_small_ones_flattened(divide):
    seed = random.randrange(2**31)
    for rank, got in enumerate(run_ranks(_worker, WORLD, seed, divide, timeout_s=120)):
        assert got["err"] < 1e-5, (rank, got["err"], seed)
        assert got["large"] == [False, True, False, False, True, False], rank  # both paths taken
        assert all(got["kept"]), rank  # in place, every one (the small ones copied back into their storage)
        in_place = [(a, n) for a, n, big in zip(got["where"], got["sizes"], got["large"]) if big]
        flat = sum(n for n, big in zip(got["sizes"], got["large"]) if not big)
        assert got["calls"][: len(in_place)] == in_place, rank  # each large one reduced where it lies
        assert [n for _, n in got["calls"][len(in_place) :]] == [flat], rank  # the rest in one flat all-reduce
