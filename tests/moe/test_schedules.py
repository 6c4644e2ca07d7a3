"""Every dispatcher reports the same traffic under every schedule (no drift between paths).

On 4 gloo ranks laid out as 2 nodes x 2 GPUs (so inter- and intra-node rows are both non-zero),
each dispatcher runs the same tokens with the plain schedule and with every other schedule it
honours: pipelined over chunks, sync-free (against plain sync-free: fixed capacity sends more),
sync-free pipelined, and inside two-batch overlap (whose last half is compared with a plain run
of the same rows). Forward and backward `CommStats` must be field-for-field equal, and the
outputs equal the plain run's.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from occult import two_batch_overlap
from occult.distributed import run_ranks
from occult.moe.dense import DenseMoE
from occult.moe.layer import OccultMoE
from occult.moe.registry import DISPATCHERS, capabilities
from occult.placement import Placement

WORLD = 4


def _run(layer: OccultMoE, x: torch.Tensor, g: torch.Tensor, chunks: int, sync_free: bool, two_batch: bool = False):
    """(output, stats of the last forward + backward) of one schedule on fresh copies of x."""
    layer.overlap_chunks, layer.sync_free = chunks, sync_free
    x = x.clone().requires_grad_()
    y = two_batch_overlap(layer, x) if two_batch else layer(x)
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
        caps = capabilities(name)
        y, plain = _run(layer, x, g, 1, False)
        _, free = _run(layer, x, g, 1, True)
        res = {"plain": plain, "sync_free": free, "internode": plain["forward_internode_rows"],
               "intranode": plain["forward_intranode_rows"]}
        if caps.pipelined:
            y3, res["pipelined"] = _run(layer, x, g, 3, False)
            _, res["sync_free_pipelined"] = _run(layer, x, g, 3, True)
            res["pipelined_error"] = float((y3 - y).abs().max())
        y2, res["two_batch"] = _run(layer, x, g, 1, False, two_batch=True)
        res["two_batch_error"] = float((y2 - y).abs().max())
        cut = (tokens + 1) // 2
        _, res["second_half"] = _run(layer, x[cut:], g[cut:], 1, False)
        out[name] = res
    return out


def test_every_schedule_reports_the_plain_runs_traffic():
    per_rank = run_ranks(_worker, WORLD, random.randrange(2**31), timeout_s=300)
    for rank, out in enumerate(per_rank):
        for name, res in out.items():
            label = (rank, name)
            if capabilities(name).pipelined:
                assert res["pipelined"] == res["plain"], label
                assert res["sync_free_pipelined"] == res["sync_free"], label
                assert res["pipelined_error"] < 1e-12, label
            assert res["two_batch"] == res["second_half"], label
            assert res["two_batch_error"] < 1e-12, label
            for stats in (res["plain"], res["sync_free"]):
                assert stats["forward_rows"] == stats["backward_rows"] > 0, label
                assert stats["forward_internode_rows"] + stats["forward_intranode_rows"] == stats["forward_remote_rows"], label
    # the node layout is known to every dispatcher: across ranks, rows cross both kinds of link
    for name in DISPATCHERS:
        assert sum(out[name]["internode"] for out in per_rank) > 0, name
        assert sum(out[name]["intranode"] for out in per_rank) > 0, name
