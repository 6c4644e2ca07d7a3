"""Every dispatcher's traffic under both schedules it honours, plain and sync-free.

On 4 gloo ranks laid out as 2 nodes x 2 GPUs (so inter- and intra-node rows are both non-zero),
each dispatcher runs the same tokens plainly and sync-free (fixed capacity sends more, so the
two are not compared with each other): backward sends as many rows as forward, remote rows are
split exactly into inter- and intra-node ones, and the sync-free output equals the plain one.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from occult.distributed import run_ranks
from occult.moe.dense import DenseMoE
from occult.moe.layer import OccultMoE
from occult.moe.registry import DISPATCHERS, capabilities
from occult.placement import Placement

WORLD = 4


def _run(layer: OccultMoE, x: torch.Tensor, g: torch.Tensor, sync_free: bool):
    """(output, stats of the last forward + backward) of one schedule on fresh copies of x."""
    layer.sync_free = sync_free
    x = x.clone().requires_grad_()
    y = layer(x)
    (y * g).sum().backward()
    return y.detach(), layer.last_comm_stats.as_dict()


def _worker(rank: int, world_size: int, seed: int) -> dict:
    torch.manual_seed(seed)
    dense = DenseMoE(16, 12, 8, 3, dtype=torch.float64)
    rng = np.random.default_rng(seed)
    placement = Placement(rng.permutation(np.arange(8) % world_size)[None], world_size, 2)
    tokens = 12  # the same on every rank: sync-free needs equal counts
    torch.manual_seed(seed + 1 + rank)
    x = torch.randn(tokens, 16, dtype=torch.float64)
    g = torch.randn(tokens, 16, dtype=torch.float64)
    out = {}
    for name in DISPATCHERS:
        layer = OccultMoE.from_dense(dense, placement=placement, dispatcher=name)
        assert capabilities(name).sync_free, name
        y, plain = _run(layer, x, g, False)
        y_free, free = _run(layer, x, g, True)
        out[name] = {
            "plain": plain,
            "sync_free": free,
            "internode": plain["forward_internode_rows"],
            "intranode": plain["forward_intranode_rows"],
            "sync_free_error": float((y_free - y).abs().max()),
        }
    return out


def test_every_schedule_reports_consistent_traffic():
    per_rank = run_ranks(_worker, WORLD, random.randrange(2**31), timeout_s=300)
    for rank, out in enumerate(per_rank):
        for name, res in out.items():
            label = (rank, name)
            assert res["sync_free_error"] < 1e-12, label
            for stats in (res["plain"], res["sync_free"]):
                assert stats["forward_rows"] == stats["backward_rows"] > 0, label
                assert (
                    stats["forward_internode_rows"] + stats["forward_intranode_rows"] == stats["forward_remote_rows"]
                ), label
    # the node layout is known to every dispatcher: across ranks, rows cross both kinds of link
    for name in DISPATCHERS:
        assert sum(out[name]["internode"] for out in per_rank) > 0, name
        assert sum(out[name]["intranode"] for out in per_rank) > 0, name
