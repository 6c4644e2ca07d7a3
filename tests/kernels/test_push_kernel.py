"""The device transport's all-to-all kernel (`occult.kernels.push.push_rows`), on one process.

Without a GPU it runs under Triton's CPU interpreter (`TRITON_INTERPRET=1`, set by
_triton_interpreter.py); the "peers" are buffers of this process, their addresses passed as the
transport passes the peer-mapped ones. The GPU suite runs it between real GPUs.
"""

from __future__ import annotations

import random

import pytest
import torch

# first: Triton's CPU interpreter without a GPU, or this file in a fresh process (test_in_subprocess)
from _triton_interpreter import DEVICE, IN_PROCESS, needs_in_process, run_file_in_fresh_process

from occult.kernels.push import push_rows


@needs_in_process
def test_rows_land_in_each_peers_region_and_nothing_else_is_written():
    """Rows offsets[d]..+counts[d] land in region `rank` of buffer d, counts[d] in its count slot
    `rank`; the rest of every buffer is untouched (empty destinations, uneven counts, odd widths)."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    for D, stride in ((3, 7), (2, 1), (4, 20)):
        W = 4 * int(torch.randint(1, 40, (1,), generator=gen))
        bufs = [torch.full((D * stride, W), 255, dtype=torch.uint8, device=DEVICE) for _ in range(D)]
        counts = [torch.full((D,), -1, dtype=torch.int64, device=DEVICE) for _ in range(D)]
        peer_rows = torch.tensor([b.data_ptr() for b in bufs], device=DEVICE)
        peer_counts = torch.tensor([c.data_ptr() for c in counts], device=DEVICE)
        for rank in range(D):
            send_D = torch.randint(0, stride + 1, (D,), generator=gen)
            send_D[int(torch.randint(0, D, (1,), generator=gen))] = 0
            src = torch.randint(0, 255, (int(send_D.sum()) + 2, W), dtype=torch.uint8, generator=gen)
            offsets_D = torch.cumsum(send_D, 0) - send_D
            push_rows(src.to(DEVICE), send_D.to(DEVICE), offsets_D.to(DEVICE), peer_rows, peer_counts, rank, stride)
            for d in range(D):
                n, o = int(send_D[d]), int(offsets_D[d])
                region = bufs[d][rank * stride : (rank + 1) * stride].cpu()
                assert torch.equal(region[:n], src[o : o + n]), (D, stride, rank, d)
                assert bool((region[n:] == 255).all()), (D, stride, rank, d)
                assert int(counts[d][rank]) == n


def test_rows_must_be_whole_words():
    bad = torch.zeros((2, 6), dtype=torch.uint8, device=DEVICE)
    zeros = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    try:
        push_rows(bad, zeros, zeros, zeros, zeros, 0, 2)
    except ValueError as err:
        assert "4-byte words" in str(err)
    else:
        raise AssertionError("a 6-byte row was accepted")


@pytest.mark.skipif(IN_PROCESS, reason="kernels already tested in this process")
def test_in_subprocess():
    run_file_in_fresh_process(__file__)
