"""A rank that dies under NCCL: the others end in an error within the collective timeout, never a hang.

Spawns its own 2 NCCL ranks (one GPU each), so it runs in a plain pytest process
(tests/gpu/run.sh's second stage), not under torchrun.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from occult import OccultMoE
from occult.distributed import RankFailure, run_ranks

COLLECTIVE_TIMEOUT_S = 15


def dead_peer_worker(rank: int, world_size: int) -> str:
    dev = torch.device("cuda", rank)
    layer = OccultMoE(256, 128, 8, 2, dtype=torch.bfloat16, device=dev)
    layer(torch.randn(64, 256, dtype=torch.bfloat16, device=dev))  # one good step together
    torch.cuda.synchronize()
    if rank == 1:
        os._exit(0)  # dies without a word
    y = layer(torch.randn(64, 256, dtype=torch.bfloat16, device=dev))
    torch.cuda.synchronize()
    return f"finished: {y.shape}"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_dead_peer_under_nccl_ends_within_timeout():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(dead_peer_worker, 2, backend="nccl", timeout_s=240, collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "rank 1 died" in message, message
    # rank 0 either raised (its traceback is in the message) or was ended by NCCL's watchdog
    assert "--- rank 0 ---" in message and "did not finish" not in message, message
    assert elapsed < COLLECTIVE_TIMEOUT_S + 90, elapsed
