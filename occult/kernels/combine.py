"""Row combine: the local pre-reduction of a row's K pair outputs, in fp32, deterministic.

`y[r] = sum_k [slot[r,k] valid] * buf[r*K + k]` (the forward's pair outputs already carry the
gate weight, see `grouped_gemm`), accumulated in fp32 in slot order and written once in the
output dtype. `buf` rows of padding entries are never read (they were never written either).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from occult.kernels import config as _config


@triton.jit
def _combine_rows_kernel(
    buf_ptr, slots_ptr, out_ptr,
    R, N, num_slots, num_experts,
    stride_bm, stride_om,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    for k in range(0, num_slots):
        flat = offs_r.to(tl.int64) * num_slots + k
        slot = tl.load(slots_ptr + flat, mask=mask_r, other=-1)
        valid = mask_r & (slot >= 0) & (slot < num_experts)
        v = tl.load(buf_ptr + flat[:, None] * stride_bm + offs_n[None, :],
                    mask=valid[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
        acc += v
    out_ptrs = out_ptr + offs_r.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_r[:, None] & mask_n[None, :])


def combine_rows(
    buf: torch.Tensor,
    slots_RK: torch.Tensor,
    num_experts: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Sum each row's valid pair rows of `buf` `[R*K, N]` in fp32."""
    num_rows, num_slots = slots_RK.shape
    n = buf.shape[1]
    out = buf.new_empty((num_rows, n), dtype=out_dtype)
    if num_rows == 0 or n == 0:
        return out
    cfg = _config.get("combine")
    block_n = min(cfg.block_n, triton.next_power_of_2(n))
    grid = (triton.cdiv(num_rows, cfg.block_m), triton.cdiv(n, block_n))
    _combine_rows_kernel[grid](
        buf, slots_RK, out,
        num_rows, n, num_slots, num_experts,
        buf.stride(0), out.stride(0),
        BLOCK_R=cfg.block_m, BLOCK_N=block_n, num_warps=cfg.num_warps,
    )
    return out
