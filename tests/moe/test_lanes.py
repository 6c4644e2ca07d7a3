"""A second lane of exchanges (`occult.moe.lanes`, behind `GraphedForward(micro_batches=2)`), on gloo
ranks: the lane's dispatchers run over a new group of the same ranks, of the layer's kind; a model
run as two micro-batches, the second over the lane, gives the full batch's output (the same function,
uneven token counts per rank, plain and sync-free); the layers get their own dispatchers back, also
after an error; a one-rank model or a group of other ranks is refused. (The two streams in one
captured graph: tests/gpu/test_collective_hf.py.)"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.distributed as dist

from occult.distributed import run_ranks
from occult.moe.dense import DenseMoE
from occult.moe.lanes import Lane
from occult.moe.layer import OccultMoE
from occult.placement import Placement

WORLD = 2


def _model(seed: int, world: int, dispatcher: str) -> torch.nn.Sequential:
    """Two expert-parallel layers with a random placement (the same on every rank)."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    placement = Placement(np.stack([rng.permutation(np.arange(8) % world) for _ in range(2)]), world)
    dense = [DenseMoE(16, 12, 8, 3, dtype=torch.float64) for _ in range(2)]
    layers = [
        OccultMoE.from_dense(d, placement=placement, layer_index=i, dispatcher=dispatcher) for i, d in enumerate(dense)
    ]
    return torch.nn.Sequential(*layers)


def _worker(rank: int, world: int, seed: int) -> dict:
    out = {}
    for name in ("dedup", "standard"):
        model = _model(seed, world, name)
        lane = Lane(model)
        own = [layer.dispatcher for layer in lane.layers]
        out[f"{name} kinds"] = [d.name for d in lane.dispatchers] == [d.name for d in own]
        out[f"{name} groups"] = all(
            d.group is not o.group and dist.get_process_group_ranks(d.group) == dist.get_process_group_ranks(o.group)
            for d, o in zip(lane.dispatchers, own)
        )
        for sync_free in (False, True):
            for layer in lane.layers:
                layer.sync_free = sync_free
            tokens = 10 if sync_free else 7 + 3 * rank  # sync-free: every rank the same count
            torch.manual_seed(seed + 10 + rank)
            x = torch.randn(2 * tokens, 16, dtype=torch.float64)
            with torch.no_grad():
                whole = model(x)
                first = model(x[:tokens])
                with lane.active():
                    second = model(x[tokens:])
            out[f"{name} sync_free={sync_free}"] = float((torch.cat([first, second]) - whole).abs().max())
        try:
            with lane.active():
                raise KeyError("inside")
        except KeyError:
            pass
        out[f"{name} restored"] = [layer.dispatcher for layer in lane.layers] == own
    others = dist.new_group([0])  # a group of other ranks than the layers' (made by every rank)
    if rank == 0:
        try:
            _model(seed, world, "dedup")[0].dispatcher_over(others)
            out["other ranks"] = "accepted"
        except ValueError as e:
            out["other ranks"] = str(e)
    return out


def test_two_micro_batches_over_a_second_lane_compute_the_whole_batch():
    per_rank = run_ranks(_worker, WORLD, random.randrange(2**31), timeout_s=300)
    for rank, out in enumerate(per_rank):
        for name in ("dedup", "standard"):
            assert out[f"{name} kinds"] and out[f"{name} groups"] and out[f"{name} restored"], (rank, name, out)
            for sync_free in (False, True):
                assert out[f"{name} sync_free={sync_free}"] < 1e-12, (rank, name, sync_free, out)
    assert "the same ranks" in per_rank[0]["other ranks"], per_rank[0]


def test_a_one_rank_model_has_no_second_lane():
    layer = OccultMoE.from_dense(DenseMoE(16, 12, 8, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="no expert-parallel MoE layers"):
        Lane(torch.nn.Sequential(layer))
