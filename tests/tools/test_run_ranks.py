"""`occult.distributed.run_ranks` hands each rank's result back by value: a rank's tensors reach the parent
whole even when the rank has exited before the parent reads them (torch's own pickler would share their
memory through a file descriptor that the exiting rank serves), and an unpicklable result is a clear error."""

from __future__ import annotations

import random

import pytest
import torch

from occult.distributed import RankFailure, run_ranks


def _tensors(rank: int, world_size: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + rank)
    return [torch.randn(256, 1024, generator=gen), torch.arange(rank + 3), torch.empty(0)]


def _unpicklable(rank: int, world_size: int) -> object:
    return (lambda: rank) if rank == 1 else rank


def test_results_come_back_by_value():
    seed = random.randrange(2**31)
    got = run_ranks(_tensors, 2, seed, timeout_s=120)
    for rank, tensors in enumerate(got):
        want = _tensors(rank, 2, seed)
        assert all(torch.equal(a, b) for a, b in zip(tensors, want)), (rank, seed)


def test_an_unpicklable_result_is_a_clear_error():
    with pytest.raises(RankFailure, match="rank 1 returned an unpicklable result"):
        run_ranks(_unpicklable, 2, timeout_s=120)
