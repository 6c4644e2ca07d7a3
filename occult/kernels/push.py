"""The device transport's all-to-all as one kernel of stores into the peers' memory (`occult.moe.symm`).

Every rank of the group maps every peer's receive buffer (CUDA symmetric memory: NVLink or PCIe
peer access on one host). A receive buffer holds one region of `stride` rows per source rank, so
no rank needs to know where another rank's rows start: rank r writes the rows it sends to rank d
into region r of d's buffer, and its row count into slot r of d's count vector. The counts never
leave the GPU and nothing is exchanged first (NVSHMEM's `all_to_all_vdev` swaps split sizes with a
team barrier before it moves a byte).

`push_rows`: the rows for rank d are `counts[d]` rows of `src` starting at row `d * src_stride`
(rows in regions, as received) or, with `src_stride` 0, after the rows of every lower rank (rows
packed by destination, as a dispatch plan lists them; the prefix is summed in the kernel). They
go to peer d's region `rank` (one program per (destination, block of rows), a grid-stride loop over
the rows), counts[d] to peer d's count slot `rank`, and, for a dispatch, this rank's routing status to
its status slot `rank` (the statuses arrive with the rows: no all-reduce of their own). Rows are
words of 4 bytes (the buffers' rows are padded to whole 64-byte lines). The caller orders the stores
before any read with a barrier of the group (`symm.DeviceTransport.exchange`).

`region_rows`: where rows listed in plan order (packed by destination) come back in a
region-per-rank buffer: `index[i] = d * stride + p - start_d` for p = rows[i] >= 0 sent to rank d
(-1 stays -1); one launch for what takes ~8 torch ops (`occult.moe.byte_rows.region_index`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from occult.kernels import config as _config  # noqa: F401  (applies the interpreter's loop-bound fix)

BLOCKS_PER_PEER = 64  # programs per destination rank (each loops over its share of the rows)
BLOCK_ROWS = 4


@triton.jit
def _push_kernel(
    src_ptr,
    counts_ptr,
    status_ptr,
    peer_rows_ptr,
    peer_counts_ptr,
    rank,
    stride_rows,
    src_stride,
    D,
    status_slot,
    W: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
    NUM_BLOCKS: tl.constexpr,
    PACKED: tl.constexpr,
    D_POW2: tl.constexpr,
    HAS_STATUS: tl.constexpr,
):
    d = tl.program_id(0)
    blk = tl.program_id(1)
    n = tl.load(counts_ptr + d)
    if PACKED:
        lower = tl.arange(0, D_POW2)
        first = tl.sum(tl.load(counts_ptr + lower, mask=lower < d, other=0), axis=0).to(tl.int64)
    else:
        first = d.to(tl.int64) * src_stride
    # each peer's receive rows start 16-byte aligned (symm.DeviceTransport checks): with rows of whole 16-byte
    # units, 16-byte stores instead of 4-byte ones
    dst = tl.multiple_of(tl.load(peer_rows_ptr + d).to(tl.pointer_type(tl.int32)), 16)
    if blk == 0:
        dst_counts = tl.load(peer_counts_ptr + d).to(tl.pointer_type(tl.int64))
        tl.store(dst_counts + rank, n)
        if HAS_STATUS:
            tl.store(dst_counts + status_slot + rank, tl.load(status_ptr).to(tl.int64))
    region = rank * stride_rows
    for r0 in range(blk * BLOCK_R, n, NUM_BLOCKS * BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R).to(tl.int64)
        live = rows < n
        for w0 in range(0, W, BLOCK_W):
            w = w0 + tl.arange(0, BLOCK_W)
            mask = live[:, None] & (w < W)[None, :]
            v = tl.load(src_ptr + (first + rows)[:, None] * W + w[None, :], mask=mask)
            tl.store(dst + (region + rows)[:, None] * W + w[None, :], v, mask=mask)


@triton.jit
def region_of(p, counts_ptr, stride, D, D_POW2: tl.constexpr):
    """Rows `p` (plan order, packed by destination; -1 none) in a region-per-rank buffer (-1 stays -1,
    as do rows past the total)."""
    ranks = tl.arange(0, D_POW2)
    counts = tl.load(counts_ptr + ranks, mask=ranks < D, other=0)
    ends = tl.cumsum(counts, axis=0)
    # the destination of row p: how many ranks' rows end at or before it
    dest = tl.sum(((ends[None, :] <= p[:, None]) & (ranks[None, :] < D)).to(tl.int64), axis=1)
    dest = tl.minimum(dest, D - 1)
    start = tl.sum(tl.where(ranks[None, :] < dest[:, None], counts[None, :], 0), axis=1)
    index = dest.to(tl.int64) * stride + p - start
    return tl.where((p >= 0) & (p < tl.sum(counts, axis=0)), index, -1)


@triton.jit
def _region_rows_kernel(rows_ptr, counts_ptr, out_ptr, N, stride, D, BLOCK: tl.constexpr, D_POW2: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < N
    p = tl.load(rows_ptr + i, mask=live, other=-1)
    tl.store(out_ptr + i, region_of(p, counts_ptr, stride, D, D_POW2), mask=live)


def push_rows(
    src_NW: torch.Tensor,
    counts_D: torch.Tensor,
    peer_rows_D: torch.Tensor,
    peer_counts_D: torch.Tensor,
    rank: int,
    stride_rows: int,
    src_stride: int = 0,
    status: torch.Tensor | None = None,
    status_slot: int = 64,
) -> None:
    """Store rows of `src_NW` (bytes, [N, W], W a multiple of 4) into the peers' receive regions.

    `counts_D` (int64, device): rows for each rank; where they start in `src_NW`: `d * src_stride`,
    or packed by destination when `src_stride` is 0 (module docstring); `peer_rows_D`,
    `peer_counts_D` (int64 addresses, device): each rank's receive rows and count vector, as this
    process maps them; `stride_rows`: rows per receive region (>= every count). `status` (a device
    integer scalar, optional): also stored at entry `status_slot + rank` of every peer's count vector."""
    num_ranks, width = counts_D.shape[0], src_NW.shape[1]
    if width % 4 or src_NW.stride(1) != 1 or src_NW.stride(0) != width:
        raise ValueError(f"rows must be contiguous whole 4-byte words, got {width} bytes, strides {src_NW.stride()}")
    words = src_NW.view(torch.int32)
    W = width // 4
    _push_kernel[(num_ranks, BLOCKS_PER_PEER)](
        words,
        counts_D,
        counts_D if status is None else status,
        peer_rows_D,
        peer_counts_D,
        rank,
        stride_rows,
        src_stride,
        num_ranks,
        status_slot,
        W=W,
        BLOCK_R=BLOCK_ROWS,
        BLOCK_W=min(1024, triton.next_power_of_2(W)),
        NUM_BLOCKS=BLOCKS_PER_PEER,
        PACKED=src_stride == 0,
        D_POW2=triton.next_power_of_2(num_ranks),
        HAS_STATUS=status is not None,
    )


def region_rows(rows: torch.Tensor, counts_D: torch.Tensor, stride: int) -> torch.Tensor:
    """For row numbers in plan order (`rows`, any shape, -1 = none), their rows in a region-per-rank
    buffer (module docstring); same shape, int64."""
    flat = rows.reshape(-1).contiguous()
    out = torch.empty_like(flat, dtype=torch.int64)
    if flat.numel():
        D = counts_D.shape[0]
        block = 256
        _region_rows_kernel[(triton.cdiv(flat.numel(), block),)](
            flat, counts_D, out, flat.numel(), stride, D, BLOCK=block, D_POW2=triton.next_power_of_2(D)
        )
    return out.reshape(rows.shape)
