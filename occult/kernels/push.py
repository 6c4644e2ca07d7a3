"""The device transport's all-to-all as one kernel of stores into the peers' memory (`occult.moe.symm`).

Every rank of the group maps every peer's receive buffer (CUDA symmetric memory: NVLink or PCIe
peer access on one host). A receive buffer holds one region of `stride` rows per source rank, so
no rank needs to know where another rank's rows start: rank r writes the rows it sends to rank d
into region r of d's buffer, and its row count into slot r of d's count vector. The counts never
leave the GPU and nothing is exchanged first (NVSHMEM's `all_to_all_vdev` swaps split sizes with a
team barrier before it moves a byte).

`push_rows`: rows `src[offsets[d] + i]`, i < counts[d], go to peer d's region `rank` (one program per
(destination, block of rows), a grid-stride loop over the rows), and counts[d] to peer d's count slot
`rank`. Rows are words of 4 bytes (the buffers' rows are padded to whole 64-byte lines). The caller
orders the stores before any read with a barrier of the group (`symm.DeviceTransport.exchange`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from occult.kernels import config as _config  # noqa: F401  (applies the interpreter's loop-bound fix)

BLOCKS_PER_PEER = 64  # programs per destination rank (each loops over its share of the rows)
BLOCK_ROWS = 4


@triton.jit
def _push_kernel(src_ptr, counts_ptr, offsets_ptr, peer_rows_ptr, peer_counts_ptr, rank, stride_rows,
                 W: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, NUM_BLOCKS: tl.constexpr):
    d = tl.program_id(0)
    blk = tl.program_id(1)
    n = tl.load(counts_ptr + d)
    first = tl.load(offsets_ptr + d)
    dst = tl.load(peer_rows_ptr + d).to(tl.pointer_type(tl.int32))
    if blk == 0:
        dst_counts = tl.load(peer_counts_ptr + d).to(tl.pointer_type(tl.int64))
        tl.store(dst_counts + rank, n)
    region = rank * stride_rows
    for r0 in range(blk * BLOCK_R, n, NUM_BLOCKS * BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R).to(tl.int64)
        live = rows < n
        for w0 in range(0, W, BLOCK_W):
            w = w0 + tl.arange(0, BLOCK_W)
            mask = live[:, None] & (w < W)[None, :]
            v = tl.load(src_ptr + (first + rows)[:, None] * W + w[None, :], mask=mask)
            tl.store(dst + (region + rows)[:, None] * W + w[None, :], v, mask=mask)


def push_rows(src_NW: torch.Tensor, counts_D: torch.Tensor, offsets_D: torch.Tensor, peer_rows_D: torch.Tensor,
              peer_counts_D: torch.Tensor, rank: int, stride_rows: int) -> None:
    """Store rows of `src_NW` (bytes, [N, W], W a multiple of 4) into the peers' receive regions.

    `counts_D`, `offsets_D` (int64, device): rows for rank d and where they start in `src_NW`;
    `peer_rows_D`, `peer_counts_D` (int64 addresses, device): each rank's receive rows and count
    vector, as this process maps them; `stride_rows`: rows per source region (>= every count)."""
    num_ranks, width = counts_D.shape[0], src_NW.shape[1]
    if width % 4:
        raise ValueError(f"rows must be whole 4-byte words, got {width} bytes")
    words = src_NW.view(torch.int32)
    W = width // 4
    _push_kernel[(num_ranks, BLOCKS_PER_PEER)](
        words, counts_D, offsets_D, peer_rows_D, peer_counts_D, rank, stride_rows,
        W=W, BLOCK_R=BLOCK_ROWS, BLOCK_W=min(1024, triton.next_power_of_2(W)), NUM_BLOCKS=BLOCKS_PER_PEER,
    )
