"""Token-side row sums: `out[t] = sum_j src[index[t, j]]` (index -1 = none), fp32, deterministic.

Used by the dispatcher on both sides of the all-to-all: the combine (a token's result rows
from every device it was sent to) and the backward of the dispatch gather (a token's gradient
rows). Replaces an fp32 `index_add_` plus casts with one pass that reads every row once and
writes every token once. With `regions`, the combine reads a token's plan rows where the device
transport returned them, the index conversion in the same pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from occult.kernels import config as _config
from occult.kernels.push import region_of


@triton.jit
def _gather_sum_kernel(
    src_ptr,
    index_ptr,
    out_ptr,
    counts_ptr,
    T,
    N,
    J,
    stride_src,
    stride_out,
    region_stride,
    D,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    REGIONS: tl.constexpr,
    D_POW2: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < T
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for j in range(0, J):
        row = tl.load(index_ptr + offs_t.to(tl.int64) * J + j, mask=mask_t, other=-1)
        if REGIONS:  # plan rows, read where they came back (occult.kernels.push.region_of)
            row = region_of(row, counts_ptr, region_stride, D, D_POW2)
        valid = mask_t & (row >= 0)
        v = tl.load(
            src_ptr + row.to(tl.int64)[:, None] * stride_src + offs_n[None, :],
            mask=valid[:, None] & mask_n[None, :],
            other=0.0,
        )
        acc += v.to(tl.float32)
    out_ptrs = out_ptr + offs_t.to(tl.int64)[:, None] * stride_out + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_n[None, :])


def gather_sum(
    src_PN: torch.Tensor,
    index_TJ: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    regions: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """`out[t] = sum_j src[index[t, j]]` over valid (>= 0) entries, accumulated in fp32.

    `regions` = (counts_D, stride): `index` holds plan rows (packed by destination, `counts_D[d]` to
    rank d) and `src` the region-per-rank buffer they came back in; each is read at its region row
    (`occult.kernels.push.region_rows`, computed in the same launch)."""
    num_tokens, num_j = index_TJ.shape
    n = src_PN.shape[1]
    out = src_PN.new_empty((num_tokens, n), dtype=out_dtype or src_PN.dtype)
    if num_tokens == 0 or n == 0:
        return out
    if src_PN.stride(1) != 1:
        src_PN = src_PN.contiguous()
    index_TJ = index_TJ.contiguous()
    cfg = _config.get("combine")
    block_n = min(cfg.block_n, triton.next_power_of_2(n))
    grid = (triton.cdiv(num_tokens, cfg.block_m), triton.cdiv(n, block_n))
    counts_D, region_stride = regions if regions is not None else (index_TJ, 0)
    num_ranks = counts_D.shape[0] if regions is not None else 1  # (a constant without regions: one compile)
    _gather_sum_kernel[grid](
        src_PN,
        index_TJ,
        out,
        counts_D,
        num_tokens,
        n,
        num_j,
        src_PN.stride(0),
        out.stride(0),
        region_stride,
        num_ranks,
        BLOCK_T=cfg.block_m,
        BLOCK_N=block_n,
        REGIONS=regions is not None,
        D_POW2=triton.next_power_of_2(num_ranks),
        num_warps=cfg.num_warps,
    )
    return out
