"""The device transport's kernels (`occult.kernels.push`): `push_rows` and `region_rows`, on one process.

Without a GPU they run under Triton's CPU interpreter (`TRITON_INTERPRET=1`, set by
_triton_interpreter.py); the "peers" are buffers of this process, their addresses passed as the
transport passes the peer-mapped ones. The GPU suite runs them between real GPUs.
"""

from __future__ import annotations

import random

import pytest
import torch

# first: Triton's CPU interpreter without a GPU, or this file in a fresh process (test_in_subprocess)
from _triton_interpreter import DEVICE, IN_PROCESS, needs_in_process, run_file_in_fresh_process

from occult.kernels.push import push_rows, region_rows


def _peers(D, stride, W):
    bufs = [torch.full((D * stride, W), 255, dtype=torch.uint8, device=DEVICE) for _ in range(D)]
    counts = [torch.full((D,), -1, dtype=torch.int64, device=DEVICE) for _ in range(D)]
    return (
        bufs,
        counts,
        torch.tensor([b.data_ptr() for b in bufs], device=DEVICE),
        torch.tensor([c.data_ptr() for c in counts], device=DEVICE),
    )


@needs_in_process
@pytest.mark.parametrize("source", ["packed", "regions"])
def test_rows_land_in_each_peers_region_and_nothing_else_is_written(source):
    """Rows for rank d (packed by destination, or in regions of `src_stride` rows) land in region
    `rank` of buffer d, counts[d] in its count slot `rank`; the rest of every buffer is untouched
    (empty destinations, uneven counts, odd widths)."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    for D, stride in ((3, 7), (2, 1), (4, 20)):
        W = 4 * int(torch.randint(1, 40, (1,), generator=gen))
        bufs, counts, peer_rows, peer_counts = _peers(D, stride, W)
        for rank in range(D):
            send_D = torch.randint(0, stride + 1, (D,), generator=gen)
            send_D[int(torch.randint(0, D, (1,), generator=gen))] = 0
            src_stride = stride + 2 if source == "regions" else 0
            first_D = torch.arange(D) * src_stride if src_stride else torch.cumsum(send_D, 0) - send_D
            src = torch.randint(0, 255, (int(first_D[-1] + send_D[-1]) + 2, W), dtype=torch.uint8, generator=gen)
            push_rows(src.to(DEVICE), send_D.to(DEVICE), peer_rows, peer_counts, rank, stride, src_stride)
            for d in range(D):
                n, o = int(send_D[d]), int(first_D[d])
                region = bufs[d][rank * stride : (rank + 1) * stride].cpu()
                assert torch.equal(region[:n], src[o : o + n]), (D, stride, rank, d)
                assert bool((region[n:] == 255).all()), (D, stride, rank, d)
                assert int(counts[d][rank]) == n


@needs_in_process
def test_region_rows_maps_plan_rows_to_their_regions():
    """Row p of a plan packed by destination comes back at d * stride + p - start_d; -1 and rows
    past the total stay -1; any shape."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    for D in (1, 2, 3, 8):
        stride = int(torch.randint(1, 9, (1,), generator=gen))
        counts_D = torch.randint(0, stride + 1, (D,), generator=gen)
        total = int(counts_D.sum())
        rows = torch.randint(-1, total + 3, (5, 4), generator=gen)
        got = region_rows(rows.to(DEVICE), counts_D.to(DEVICE), stride).cpu()
        starts = torch.cumsum(counts_D, 0) - counts_D
        for p, g in zip(rows.reshape(-1).tolist(), got.reshape(-1).tolist()):
            if p < 0 or p >= total:
                assert g == -1, (p, g)
                continue
            d = int((torch.cumsum(counts_D, 0) <= p).sum())
            assert g == d * stride + p - int(starts[d]), (D, stride, counts_D.tolist(), p, g)


@needs_in_process
def test_region_sums_equal_plan_order_sums():
    """The GPU combine of the device transport: each token's rows summed straight out of the
    region-per-rank buffer (`gather_sum` at `region_rows(row_TJ)`) equals reading the rows back in
    plan order first and summing them (the CPU path)."""
    from occult.kernels.rows import gather_sum

    gen = torch.Generator().manual_seed(random.randrange(2**31))
    D, stride, T, J, H = 3, 6, 7, 3, 8  # T * J >= D * stride: room for every plan row
    counts_D = torch.randint(0, stride + 1, (D,), generator=gen)
    total = int(counts_D.sum())
    row_TJ = torch.full((T, J), -1, dtype=torch.int64)
    for p in range(total):  # every plan row belongs to one token, at most J rows a token
        free = [(t, j) for t in range(T) for j in range(J) if row_TJ[t, j] < 0]
        t, j = free[int(torch.randint(0, len(free), (1,), generator=gen))]
        row_TJ[t, j] = p
    regions_RH = torch.randn(D * stride, H, generator=gen)
    starts = torch.cumsum(counts_D, 0) - counts_D
    plan_PH = (
        torch.stack([regions_RH[d * stride + i] for d in range(D) for i in range(int(counts_D[d]))])
        if total
        else torch.zeros(0, H)
    )
    expected = torch.stack([sum((plan_PH[p] for p in row_TJ[t].tolist() if p >= 0), torch.zeros(H)) for t in range(T)])
    rows_TJ = region_rows(row_TJ.to(DEVICE), counts_D.to(DEVICE), stride)
    got = gather_sum(regions_RH.to(DEVICE), rows_TJ, torch.float32).cpu()
    assert torch.allclose(got, expected, atol=1e-6), (counts_D.tolist(), starts.tolist())
    # the same with the region rows found in the sum's own launch (the combine's path)
    fused = gather_sum(
        regions_RH.to(DEVICE), row_TJ.to(DEVICE), torch.float32, regions=(counts_D.to(DEVICE), stride)
    ).cpu()
    assert torch.allclose(fused, expected, atol=1e-6), (counts_D.tolist(), starts.tolist())


@needs_in_process
def test_status_lands_in_each_peers_status_slot():
    """With `status`, every peer's count vector gets it at `status_slot + rank` (next to the count)."""
    D, stride, W = 3, 4, 8
    bufs, counts, peer_rows, peer_counts = _peers(D, stride, W)
    counts = [torch.full((2 * D,), -1, dtype=torch.int64, device=DEVICE) for _ in range(D)]
    peer_counts = torch.tensor([c.data_ptr() for c in counts], device=DEVICE)
    for rank, status in enumerate((0, 2, 1)):
        send_D = torch.tensor([1, 2, 0])
        src = torch.zeros((3, W), dtype=torch.uint8)
        push_rows(
            src.to(DEVICE),
            send_D.to(DEVICE),
            peer_rows,
            peer_counts,
            rank,
            stride,
            status=torch.tensor(status, device=DEVICE),
            status_slot=D,
        )
    for d in range(D):
        assert counts[d].tolist() == [[1, 2, 0][d]] * D + [0, 2, 1], (d, counts[d].tolist())


@needs_in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_push_equals_pack_then_push(dtype):
    """`pack_push_rows` (the dispatch's rows gathered straight into the peers' regions) leaves every
    peer's buffer, counts and statuses as `pack_rows` into staging rows and then `push_rows` do;
    unused plan rows (token -1 past the total) and empty destinations included."""
    from occult.kernels.pack import pack_push_rows, pack_rows

    seed = random.randrange(2**31)
    D, stride, T, K, H = 3, 6, 7, 3, 24
    W = 4 * (-(-(H * torch.finfo(dtype).bits // 8 + 8 * K) // 4) + 1)  # odd padding on purpose
    gate_byte, slot_byte = H * torch.finfo(dtype).bits // 8, H * torch.finfo(dtype).bits // 8 + 4 * K
    results = []
    for fused in (True, False):
        bufs, counts, peer_rows, peer_counts = _peers(D, stride, W)
        counts = [torch.full((2 * D,), -1, dtype=torch.int64, device=DEVICE) for _ in range(D)]
        peer_counts = torch.tensor([c.data_ptr() for c in counts], device=DEVICE)
        g = torch.Generator().manual_seed(seed)  # the same plans for both ways
        for rank in range(D):
            send_D = torch.randint(0, stride + 1, (D,), generator=g)
            send_D[rank % D] = 0 if rank == 1 else send_D[rank % D]
            total, P = int(send_D.sum()), int(send_D.sum()) + 2
            token_P = torch.cat([torch.randint(0, T, (total,), generator=g), torch.full((2,), -1)])
            x_TH = torch.randn(T, H, generator=g).to(dtype)
            weights_TK = torch.rand(T, K, generator=g)
            entry_PK = torch.randint(-1, T * K, (P, K), generator=g)
            slot_PK = torch.randint(-1, 5, (P, K), generator=g)
            status = torch.tensor(rank + 1, device=DEVICE)
            args = [t.to(DEVICE) for t in (x_TH, token_P, weights_TK, entry_PK, slot_PK)]
            if fused:
                pack_push_rows(
                    *args, gate_byte, slot_byte, W, send_D.to(DEVICE), peer_rows, peer_counts, rank, stride, status, D
                )
            else:
                staging = torch.zeros((P, W), dtype=torch.uint8, device=DEVICE)
                pack_rows(staging, args[0], args[1], args[2], args[3], args[4], gate_byte, slot_byte)
                push_rows(
                    staging, send_D.to(DEVICE), peer_rows, peer_counts, rank, stride, status=status, status_slot=D
                )
        results.append(([b.cpu() for b in bufs], [c.cpu() for c in counts]))
    for d in range(D):
        assert torch.equal(results[0][1][d], results[1][1][d]), d
        used = slot_byte + 4 * K  # a row's bytes (its padding is never read: staging has zeros there)
        for r in range(D):
            fused, staged = (results[i][0][d][r * stride : (r + 1) * stride, :used] for i in (0, 1))
            assert torch.equal(fused, staged), (d, r)


def test_rows_must_be_contiguous_whole_words():
    zeros = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    for bad in (
        torch.zeros((2, 6), dtype=torch.uint8, device=DEVICE),
        torch.zeros((2, 16), dtype=torch.uint8, device=DEVICE)[:, :8],
    ):
        with pytest.raises(ValueError, match="4-byte words"):
            push_rows(bad, zeros, zeros, zeros, 0, 2)


@pytest.mark.skipif(IN_PROCESS, reason="kernels already tested in this process")
def test_in_subprocess():
    run_file_in_fresh_process(__file__)
