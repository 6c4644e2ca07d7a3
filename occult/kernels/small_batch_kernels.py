"""The Triton kernels of the small-batch (decode) expert MLP; `occult.kernels.small_batch` launches
them and its docstring says what each computes.

`gate_up_kernel` and `down_kernel` give each program one present expert (found from a histogram of
the slots in registers) and loop over that expert's pairs; `combine_kernel` sums a row's pair rows
in slot order; `down_rows_kernel` is the down product and the row sum in one (a GEMV per slot).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _expert_of_program(slots_ptr, n, num_experts, rank, N_POW2: tl.constexpr, B_POW2: tl.constexpr):
    """The `rank`-th present expert, its pair count (0 if none), and per flat entry: is it one of
    the expert's pairs, and its position among them (flat order)."""
    offs = tl.arange(0, N_POW2)
    s = tl.load(slots_ptr + offs, mask=offs < n, other=-1)
    valid = (s >= 0) & (s < num_experts) & (offs < n)
    key = tl.where(valid, s, num_experts).to(tl.int32)
    hist = tl.histogram(key, B_POW2, mask=offs < n)
    bins = tl.arange(0, B_POW2)
    present = (hist > 0) & (bins < num_experts)
    cum = tl.cumsum(present.to(tl.int32), axis=0)  # inclusive
    sel = present & (cum == rank + 1)
    expert = tl.sum(tl.where(sel, bins, 0), axis=0)
    count = tl.sum(tl.where(sel, hist, 0), axis=0)
    mine = valid & (s == expert)
    pos = tl.cumsum(mine.to(tl.int32), axis=0) - 1
    return expert, count, mine, pos, offs


@triton.jit
def _chunk_pairs(mine, pos, offs, count, chunk, BLOCK_M: tl.constexpr):
    """Flat indices of the expert's pairs `chunk*BLOCK_M ...` (0 past the end) and their mask."""
    target = chunk * BLOCK_M + tl.arange(0, BLOCK_M)
    match = mine[None, :] & (pos[None, :] == target[:, None])
    pair = tl.sum(tl.where(match, offs[None, :], 0), axis=1)
    return pair, target < count


@triton.jit
def gate_up_kernel(
    x_ptr,
    slots_ptr,
    w_ptr,
    h_ptr,
    n,
    num_slots,
    num_experts,
    H,
    F,
    stride_xr,
    stride_we,
    stride_wf,
    stride_wh,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PREC: tl.constexpr,
    N_POW2: tl.constexpr,
    B_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rank = tl.program_id(0)
    tile_n = tl.program_id(1)
    expert, count, mine, pos, offs = _expert_of_program(slots_ptr, n, num_experts, rank, N_POW2, B_POW2)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_nw = offs_n % F
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    for chunk in range(0, tl.cdiv(count, BLOCK_M)):
        pair, ok = _chunk_pairs(mine, pos, offs, count, chunk, BLOCK_M)
        row = (pair // num_slots).to(tl.int64)
        x_ptrs = x_ptr + row[:, None] * stride_xr + offs_k[None, :]
        wg_ptrs = w_base + offs_nw[None, :].to(tl.int64) * stride_wf + offs_k[:, None] * stride_wh
        wu_ptrs = wg_ptrs + F * stride_wf
        acc_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_b = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(H, BLOCK_K)):
            if EVEN_K:
                xt = tl.load(x_ptrs)
                wg = tl.load(wg_ptrs)
                wu = tl.load(wu_ptrs)
            else:
                k_ok = offs_k < H - k * BLOCK_K
                xt = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
                wg = tl.load(wg_ptrs, mask=k_ok[:, None], other=0.0)
                wu = tl.load(wu_ptrs, mask=k_ok[:, None], other=0.0)
            if UPCAST:
                xt = xt.to(tl.float32)
                wg = wg.to(tl.float32)
                wu = wu.to(tl.float32)
            acc_a = tl.dot(xt, wg, acc_a, input_precision=PREC)
            acc_b = tl.dot(xt, wu, acc_b, input_precision=PREC)
            x_ptrs += BLOCK_K
            wg_ptrs += BLOCK_K * stride_wh
            wu_ptrs += BLOCK_K * stride_wh
        h = acc_a * tl.sigmoid(acc_a) * acc_b
        mask = ok[:, None] & (offs_n < F)[None, :]
        tl.store(h_ptr + pair.to(tl.int64)[:, None] * F + offs_n[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def down_kernel(
    h_ptr,
    slots_ptr,
    gates_ptr,
    w_ptr,
    o_ptr,
    n,
    num_experts,
    H,
    F,
    stride_we,
    stride_wh,
    stride_wf,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PREC: tl.constexpr,
    N_POW2: tl.constexpr,
    B_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rank = tl.program_id(0)
    tile_n = tl.program_id(1)
    expert, count, mine, pos, offs = _expert_of_program(slots_ptr, n, num_experts, rank, N_POW2, B_POW2)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_nw = offs_n % H
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    for chunk in range(0, tl.cdiv(count, BLOCK_M)):
        pair, ok = _chunk_pairs(mine, pos, offs, count, chunk, BLOCK_M)
        pair64 = pair.to(tl.int64)
        h_ptrs = h_ptr + pair64[:, None] * F + offs_k[None, :]
        w_ptrs = w_base + offs_k[:, None] * stride_wf + offs_nw[None, :].to(tl.int64) * stride_wh
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(F, BLOCK_K)):
            # h rows past the expert's count were never written: masked (rows of a dot are independent,
            # but NaN bits there would still trip checkers)
            if EVEN_K:
                ht = tl.load(h_ptrs, mask=ok[:, None], other=0.0)
                wt = tl.load(w_ptrs)
            else:
                k_ok = offs_k < F - k * BLOCK_K
                ht = tl.load(h_ptrs, mask=ok[:, None] & k_ok[None, :], other=0.0)
                wt = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
            if UPCAST:
                ht = ht.to(tl.float32)
                wt = wt.to(tl.float32)
            acc = tl.dot(ht, wt, acc, input_precision=PREC)
            h_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wf
        g = tl.load(gates_ptr + pair, mask=ok, other=0.0).to(tl.float32)
        mask = ok[:, None] & (offs_n < H)[None, :]
        tl.store(o_ptr + pair64[:, None] * H + offs_n[None, :], acc * g[:, None], mask=mask)


@triton.jit
def combine_kernel(
    o_ptr,
    slots_ptr,
    y_ptr,
    R,
    num_slots,
    num_experts,
    H,
    stride_yr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_r = offs_r < R
    mask_n = offs_n < H
    acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    for k in range(0, num_slots):
        flat = offs_r.to(tl.int64) * num_slots + k
        s = tl.load(slots_ptr + flat, mask=mask_r, other=-1)
        valid = mask_r & (s >= 0) & (s < num_experts)
        acc += tl.load(o_ptr + flat[:, None] * H + offs_n[None, :], mask=valid[:, None] & mask_n[None, :], other=0.0)
    y_ptrs = y_ptr + offs_r.to(tl.int64)[:, None] * stride_yr + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_r[:, None] & mask_n[None, :])


@triton.jit
def down_rows_kernel(
    h_ptr,
    slots_ptr,
    gates_ptr,
    w_ptr,
    y_ptr,
    num_slots,
    num_experts,
    H,
    F,
    stride_we,
    stride_wh,
    stride_wf,
    stride_yr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in range(0, num_slots):
        flat = row.to(tl.int64) * num_slots + k
        s = tl.load(slots_ptr + flat)
        valid = (s >= 0) & (s < num_experts)
        g = tl.load(gates_ptr + flat).to(tl.float32)
        w_ptrs = (
            w_ptr
            + tl.where(valid, s, 0).to(tl.int64) * stride_we
            + offs_n[:, None].to(tl.int64) * stride_wh
            + offs_k[None, :] * stride_wf
        )
        h_ptrs = h_ptr + flat * F + offs_k
        part = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for f in range(0, tl.cdiv(F, BLOCK_K)):
            k_ok = (offs_k < F - f * BLOCK_K) & valid
            wt = tl.load(w_ptrs, mask=mask_n[:, None] & k_ok[None, :], other=0.0)
            ht = tl.load(h_ptrs, mask=k_ok, other=0.0)
            part += tl.sum(wt.to(tl.float32) * ht.to(tl.float32)[None, :], axis=1)
            w_ptrs += BLOCK_K * stride_wf
            h_ptrs += BLOCK_K
        acc += tl.where(valid, g, 0.0) * part
    tl.store(y_ptr + row.to(tl.int64) * stride_yr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=mask_n)
