"""Small-batch (decode) expert MLP: each selected expert's weights read once, no pair sort.

For inference when the number of (row, slot) entries `R*K` is small (a decode step): the
grouped-GEMM path (`op._forward`) sorts pairs (3 launches), runs persistent GEMMs with
128-row tiles that are almost empty, and combines; here three launches do everything, and the
grid is sized from bounds only (no host sync, capturable in a CUDA graph):

  1. `_gate_up_kernel`, grid `(min(R*K, E), cdiv(F, BLOCK_N))`: program `(i, n)` finds the
     i-th present expert (ascending id) from a histogram of the slots in registers, gathers
     that expert's pairs (in flat order `r*K+k`, `BLOCK_M` at a time, a loop bounded by the
     expert's count) and computes `h = silu(x Wg^T) * (x Wu^T)` for one `BLOCK_N` column slice
     of the gate and of the up rows (fp32 accumulators), stored in x's dtype at the pair's
     flat index in `h [R*K, F]`. Programs whose rank has no expert do nothing. At batch 1 the
     8 experts x `F/BLOCK_N` slices fill the SMs (split along N, as vLLM's fused_moe does).
  2. `_down_kernel`, grid `(min(R*K, E), cdiv(H, BLOCK_N))`: the same expert lookup,
     `o = g * (h Wd^T)` (fp32) stored at the pair's flat index in `o [R*K, H]` (fp32).
  3. `_combine_kernel`: `y[r] = sum_k valid(r, k) * o[r*K+k]` in fp32 in slot order, cast once
     (deterministic, no atomics, no zero-fill; a row of padding only gets zeros).

`down_by_row=True` replaces 2+3 by one `_down_rows_kernel` (grid `(R, cdiv(H, BLOCK_N))`, a
GEMV per slot, the row's sum in registers): two launches, but an expert shared by several rows
is read once per row (from L2 if lucky); see docs/kernels.md for which wins where.

Slots -1 and slots outside `[0, E)` are padding. Arithmetic: fp32 accumulation, fp32 operands
use exact ("ieee") products; `h` is rounded to x's dtype (as the torch reference rounds its
SwiGLU output), the gate is applied in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from occult.kernels import config as _config
from occult.kernels.grouped_gemm import dot_flags

# Largest R*K for which `op.expert_mlp` takes this path in inference (0 turns it off; a module
# setting until occult.settings exists). From the H100 measurement in docs/kernels.md.
MAX_PAIRS = 512
# `down_by_row` is used for R <= this many rows (docs/kernels.md)
DOWN_BY_ROW_MAX_ROWS = 0


def use_small_batch(num_pairs: int) -> bool:
    """Whether an inference call with `num_pairs = R*K` entries takes this path."""
    return num_pairs <= MAX_PAIRS


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
def _gate_up_kernel(
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
def _down_kernel(
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
def _combine_kernel(
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
def _down_rows_kernel(
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


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def swiglu_small_batch(x_RH: torch.Tensor, slots_RK: torch.Tensor, gate_up_EFH: torch.Tensor) -> torch.Tensor:
    """Stage 1: `h [R*K, F]` (x's dtype), `h[r*K+k] = silu(x_r Wg^T) * (x_r Wu^T)` for valid
    slots (padding rows of `h` are left unwritten). One launch, `min(R*K, E) x cdiv(F, BLOCK_N)`
    programs."""
    num_rows, hidden = x_RH.shape
    num_slots = slots_RK.shape[1]
    num_experts, two_f, _ = gate_up_EFH.shape
    n, ffn = num_rows * num_slots, two_f // 2
    h = x_RH.new_empty((n, ffn))
    if n == 0 or num_experts == 0:
        return h
    upcast, prec = dot_flags(x_RH.dtype)
    cfg = _config.get("small_gate_up", x_RH.dtype)
    _gate_up_kernel[(min(n, num_experts), triton.cdiv(ffn, cfg.block_n))](
        x_RH,
        slots_RK,
        gate_up_EFH,
        h,
        n,
        num_slots,
        num_experts,
        hidden,
        ffn,
        x_RH.stride(0),
        gate_up_EFH.stride(0),
        gate_up_EFH.stride(1),
        gate_up_EFH.stride(2),
        EVEN_K=hidden % cfg.block_k == 0,
        UPCAST=upcast,
        PREC=prec,
        N_POW2=_pow2(n),
        B_POW2=_pow2(num_experts + 1),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return h


def down_combine_small_batch(
    h_PF: torch.Tensor,
    slots_RK: torch.Tensor,
    gates_RK: torch.Tensor,
    down_EHF: torch.Tensor,
    down_by_row: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Stage 2: `y[r] = sum_k g[r,k] * Wd[s] h[r*K+k]` over valid slots (fp32), in `out_dtype`.
    Two launches (expert-grouped down product into fp32 pair rows, then the row combine), or
    one with `down_by_row` (a GEMV per (row, slot); an expert is read once per row using it)."""
    num_rows, num_slots = slots_RK.shape
    num_experts, hidden, ffn = down_EHF.shape
    n = num_rows * num_slots
    y = torch.empty((num_rows, hidden), device=h_PF.device, dtype=out_dtype)
    if n == 0 or num_experts == 0:
        return y.zero_()
    if down_by_row:
        cfg = _config.get("small_down_row", h_PF.dtype)
        _down_rows_kernel[(num_rows, triton.cdiv(hidden, cfg.block_n))](
            h_PF,
            slots_RK,
            gates_RK,
            down_EHF,
            y,
            num_slots,
            num_experts,
            hidden,
            ffn,
            down_EHF.stride(0),
            down_EHF.stride(1),
            down_EHF.stride(2),
            y.stride(0),
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        return y
    upcast, prec = dot_flags(h_PF.dtype)
    o = torch.empty((n, hidden), device=h_PF.device, dtype=torch.float32)
    cfg = _config.get("small_down", h_PF.dtype)
    _down_kernel[(min(n, num_experts), triton.cdiv(hidden, cfg.block_n))](
        h_PF,
        slots_RK,
        gates_RK,
        down_EHF,
        o,
        n,
        num_experts,
        hidden,
        ffn,
        down_EHF.stride(0),
        down_EHF.stride(1),
        down_EHF.stride(2),
        EVEN_K=ffn % cfg.block_k == 0,
        UPCAST=upcast,
        PREC=prec,
        N_POW2=_pow2(n),
        B_POW2=_pow2(num_experts + 1),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    cfg = _config.get("small_combine")
    block_n = min(cfg.block_n, triton.next_power_of_2(hidden))
    _combine_kernel[(triton.cdiv(num_rows, cfg.block_m), triton.cdiv(hidden, block_n))](
        o,
        slots_RK,
        y,
        num_rows,
        num_slots,
        num_experts,
        hidden,
        y.stride(0),
        BLOCK_R=cfg.block_m,
        BLOCK_N=block_n,
        num_warps=cfg.num_warps,
    )
    return y


def expert_mlp_small_batch(
    x_RH: torch.Tensor,
    slots_RK: torch.Tensor,
    gates_RK: torch.Tensor,
    gate_up_EFH: torch.Tensor,
    down_EHF: torch.Tensor,
    *,
    down_by_row: bool | None = None,
) -> torch.Tensor:
    """`expert_mlp` forward for small `R*K` (module docstring): 3 launches (2 with `down_by_row`;
    default: `R <= DOWN_BY_ROW_MAX_ROWS`).

    Inputs as `op.expert_mlp` passes them: x, slots and gates contiguous, weights in x's dtype
    (any strides). No autograd. `R*K` is the grid bound; nothing is read back to the host.
    """
    if down_by_row is None:
        down_by_row = x_RH.shape[0] <= DOWN_BY_ROW_MAX_ROWS
    h = swiglu_small_batch(x_RH, slots_RK, gate_up_EFH)
    return down_combine_small_batch(h, slots_RK, gates_RK, down_EHF, down_by_row, x_RH.dtype)
