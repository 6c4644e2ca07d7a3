"""Forward grouped GEMMs of the expert MLP over expert-sorted (row, expert) pairs.

`gather_gemm_swiglu` (GEMM 1): for the pairs of each expert, `[a; b] = x[row] @ gate_up[e]^T`
with the rows gathered in the prologue (the k-fold expanded activation is never written), two
fp32 accumulators (gate and up columns of the same n-tile) and SwiGLU in the epilogue. The
epilogue also multiplies by the pair's gate weight: it stores `hg = g * silu(a) * b` at the
pair's sorted position (GEMM 2 is linear, so `down[e] @ hg = g * o`, and the weight gradient
of `down` needs no per-pair scaling). `[a; b]` is stored too when a backward will need it. Gate and up are two
tensors of one shape and strides (a joined weight's halves, or two weights kept apart).

`gemm_scatter` (GEMM 2, and the input gradient of GEMM 1 in the backward): contiguous pair
rows times a per-expert weight (whose K rows may come from two tensors: gate, then up); the
epilogue either stores each output row at its pair's flat index `r*K + k` (default:
`combine.combine_rows` then sums a row's K entries in fp32, deterministically) or atomically adds
into one fp32 row per received row (`atomic=True`; run-to-run bits may differ).

Both kernels walk a tile list whose length is only known on the device (`pairs.tile_schedule`), so no
host sync: by default persistently, `grid = min(#SMs, bound)` programs striding over the tiles (no empty
programs). Beside other streams' kernels (an overlapped schedule: NCCL's, another micro-batch's) a persistent
program that finds its SM busy starts late with its whole share of the tiles, and the kernel ends with it;
`OCCULT_KERNEL_GRID=tiles` launches one program per tile of the bound instead (those past the device's count
exit at once), so the GPU's scheduler hands tiles to whichever SM frees (`num_programs`; docs/overlap.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from occult import settings
from occult.kernels import config as _config
from occult.kernels.pairs import e_pow2, grouped_pid, max_tiles, tile_lookup, tile_schedule


@triton.jit
def _gather_gemm_swiglu_kernel(
    x_ptr,
    pair_ptr,
    offsets_ptr,
    wg_ptr,
    wu_ptr,
    gate_ptr,
    h_ptr,
    ab_ptr,
    num_experts,
    num_slots,
    H,
    F,
    stride_xr,
    stride_we,
    stride_wf,
    stride_wh,
    SAVE_AB: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    E_POW2: tl.constexpr,
    FLATTEN: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    e, lo, hi, ntiles, cum = tile_schedule(offsets_ptr, num_experts, BLOCK_M, E_POW2)
    tiles_m = tl.sum(ntiles, axis=0)
    tiles_n = tl.cdiv(F, BLOCK_N)
    for tile in tl.range(pid, tiles_m * tiles_n, nprog, flatten=FLATTEN):
        tile_m, tile_n = grouped_pid(tile, tiles_m, tiles_n, GROUP_M)
        expert, m_start, m_end = tile_lookup(e, lo, hi, ntiles, cum, tile_m, BLOCK_M)
        offs_m = m_start + tl.arange(0, BLOCK_M)
        mask_m = offs_m < m_end
        pair = tl.load(pair_ptr + offs_m, mask=mask_m, other=0)
        row = (pair // num_slots).to(tl.int64)  # rows past the expert's end read row 0, unused
        offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_nw = offs_n % F
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + row[:, None] * stride_xr + offs_k[None, :]
        w_offs = (
            expert.to(tl.int64) * stride_we + offs_nw[None, :].to(tl.int64) * stride_wf + offs_k[:, None] * stride_wh
        )
        wg_ptrs = wg_ptr + w_offs
        wu_ptrs = wu_ptr + w_offs
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
        g = tl.load(gate_ptr + pair, mask=mask_m, other=0.0).to(tl.float32)
        h = acc_a * tl.sigmoid(acc_a) * acc_b * g[:, None]
        offs_m64 = offs_m.to(tl.int64)
        mask = mask_m[:, None] & (offs_n < F)[None, :]
        tl.store(h_ptr + offs_m64[:, None] * F + offs_n[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)
        if SAVE_AB:
            ab_ptrs = ab_ptr + offs_m64[:, None] * (2 * F) + offs_n[None, :]
            tl.store(ab_ptrs, acc_a.to(ab_ptr.dtype.element_ty), mask=mask)
            tl.store(ab_ptrs + F, acc_b.to(ab_ptr.dtype.element_ty), mask=mask)


@triton.jit
def dot_over_k(
    acc,
    a_ptrs,
    b_ptrs,
    kd,
    stride_bk,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """acc += A[:, :kd] @ B[:kd, :] for one tile: `a_ptrs` [BLOCK_M, BLOCK_K] and `b_ptrs` [BLOCK_K, BLOCK_N]
    at k = 0 (A's columns unit-strided, B's rows `stride_bk` apart)."""
    offs_k = tl.arange(0, BLOCK_K)
    for k in range(0, tl.cdiv(kd, BLOCK_K)):
        if EVEN_K:
            at = tl.load(a_ptrs)
            bt = tl.load(b_ptrs)
        else:
            k_ok = offs_k < kd - k * BLOCK_K
            at = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            bt = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        if UPCAST:
            at = at.to(tl.float32)
            bt = bt.to(tl.float32)
        acc = tl.dot(at, bt, acc, input_precision=PREC)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def _gemm_scatter_kernel(
    a_ptr,
    pair_ptr,
    offsets_ptr,
    b_ptr,
    b2_ptr,
    out_ptr,
    num_experts,
    num_slots,
    N,
    KD,
    K1,
    stride_am,
    stride_be,
    stride_bk,
    stride_bn,
    stride_om,
    ATOMIC: tl.constexpr,
    TWO_B: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    E_POW2: tl.constexpr,
    FLATTEN: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    e, lo, hi, ntiles, cum = tile_schedule(offsets_ptr, num_experts, BLOCK_M, E_POW2)
    tiles_m = tl.sum(ntiles, axis=0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(pid, tiles_m * tiles_n, nprog, flatten=FLATTEN):
        tile_m, tile_n = grouped_pid(tile, tiles_m, tiles_n, GROUP_M)
        expert, m_start, m_end = tile_lookup(e, lo, hi, ntiles, cum, tile_m, BLOCK_M)
        offs_m = m_start + tl.arange(0, BLOCK_M)
        mask_m = offs_m < m_end
        a_rows = tl.where(mask_m, offs_m, m_start).to(tl.int64)
        offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_nw = offs_n % N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
        b_offs = (
            expert.to(tl.int64) * stride_be + offs_k[:, None] * stride_bk + offs_nw[None, :].to(tl.int64) * stride_bn
        )
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = dot_over_k(acc, a_ptrs, b_ptr + b_offs, K1, stride_bk, EVEN_K, UPCAST, PREC, BLOCK_K)
        if TWO_B:  # K rows K1.. of B from the second tensor (split gate and up weights)
            acc = dot_over_k(acc, a_ptrs + K1, b2_ptr + b_offs, KD - K1, stride_bk, EVEN_K, UPCAST, PREC, BLOCK_K)
        pair = tl.load(pair_ptr + offs_m, mask=mask_m, other=0)
        mask = mask_m[:, None] & (offs_n < N)[None, :]
        if ATOMIC:
            row = (pair // num_slots).to(tl.int64)
            tl.atomic_add(out_ptr + row[:, None] * stride_om + offs_n[None, :], acc, mask=mask, sem="relaxed")
        else:
            out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def num_programs(device: torch.device, bound: int, ctas_per_sm: int = 1) -> int:
    """Programs of a launch over at most `bound` tiles: one (or `ctas_per_sm`) per SM, persistent, or with
    `OCCULT_KERNEL_GRID=tiles` one per tile (module docstring)."""
    cpu = _config.interpreting() or device.type != "cuda"  # (the interpreter: 3 programs walk the tiles)
    resident = 3 if cpu else ctas_per_sm * _sm_count(device)
    return grid_programs(bound, resident, settings.current().kernel_grid)


def grid_programs(bound: int, resident: int, grid: str) -> int:
    """`grid` "persistent": `resident` programs (those the SMs hold at once), at most `bound`; "tiles": `bound`."""
    return max(1, bound if grid == "tiles" else min(bound, resident))


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def dot_flags(dtype: torch.dtype) -> tuple[bool, str]:
    """(UPCAST, PREC) for `tl.dot`: fp32 operands use exact ("ieee") products, not tf32; under
    the interpreter operands are upcast to fp32 (exact for bf16/fp16), since Triton 3.6's
    interpreter multiplies bf16 bit patterns as integers."""
    return _config.interpreting(), ("ieee" if dtype == torch.float32 else "tf32")


def gather_gemm_swiglu(
    x_RH: torch.Tensor,
    pair_P: torch.Tensor,
    offsets_E1: torch.Tensor,
    gate_EFH: torch.Tensor,
    up_EFH: torch.Tensor,
    gates_flat: torch.Tensor,
    num_slots: int,
    save_ab: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hg = gate * SwiGLU `[R*K, F]` (sorted-pair rows, only the first P written), optionally [a; b].

    `gate_EFH` and `up_EFH`: the gate and up weights, two tensors of one shape and strides (the halves of a
    `[E, 2F, H]` gate_up weight, or weights kept apart, as TorchTitan's `w1` and `w3`)."""
    if gate_EFH.shape != up_EFH.shape or gate_EFH.stride() != up_EFH.stride():
        raise ValueError(
            f"gate and up weights need one shape and strides, got {tuple(gate_EFH.shape)} {gate_EFH.stride()} "
            f"and {tuple(up_EFH.shape)} {up_EFH.stride()}"
        )
    num_experts, ffn, hidden = gate_EFH.shape
    two_f = 2 * ffn
    bound = pair_P.numel()
    h_PF = x_RH.new_empty((bound, ffn))
    ab_PF2 = x_RH.new_empty((bound, two_f)) if save_ab else None
    cfg = _config.get("gemm1", x_RH.dtype)
    tiles = max_tiles(bound, num_experts, cfg.block_m) * triton.cdiv(ffn, cfg.block_n)
    upcast, prec = dot_flags(x_RH.dtype)
    grid = (num_programs(x_RH.device, tiles, cfg.ctas_per_sm),)
    _gather_gemm_swiglu_kernel[grid](
        x_RH,
        pair_P,
        offsets_E1,
        gate_EFH,
        up_EFH,
        gates_flat,
        h_PF,
        ab_PF2 if save_ab else h_PF,
        num_experts,
        num_slots,
        hidden,
        ffn,
        x_RH.stride(0),
        gate_EFH.stride(0),
        gate_EFH.stride(1),
        gate_EFH.stride(2),
        SAVE_AB=save_ab,
        EVEN_K=hidden % cfg.block_k == 0,
        UPCAST=upcast,
        PREC=prec,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        E_POW2=e_pow2(num_experts),
        FLATTEN=cfg.flatten,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return h_PF, ab_PF2


def gemm_scatter(
    a_PK: torch.Tensor,
    pair_P: torch.Tensor,
    offsets_E1: torch.Tensor,
    b_EKN: torch.Tensor,
    num_slots: int,
    out: torch.Tensor,
    atomic: bool = False,
    config_name: str | None = None,
    b2_EKN: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[pair] = a[p] @ b[e] (stored at the pair's flat index), or with `atomic`
    out[row] += a[p] @ b[e] (fp32 `out` of one row per received row).

    `b_EKN` may be any strided view `[E, KD, N]` (e.g. `down.transpose(1, 2)`); `a_PK` rows
    are in sorted-pair order with unit stride along KD. `b2_EKN`: B's rows past `b_EKN`'s, a tensor of the
    same strides (`[gate; up]` kept as two weights), so `a` has the columns of both.
    """
    num_experts, k1, n = b_EKN.shape
    kd = k1
    if b2_EKN is not None:
        if b2_EKN.shape[::2] != b_EKN.shape[::2] or b2_EKN.stride() != b_EKN.stride():
            raise ValueError(
                f"b2 must match b but in its K rows: got {tuple(b_EKN.shape)} {b_EKN.stride()} and "
                f"{tuple(b2_EKN.shape)} {b2_EKN.stride()}"
            )
        kd = k1 + b2_EKN.shape[1]
    bound = pair_P.numel()
    cfg = _config.get(config_name or ("gemm2_atomic" if atomic else "gemm2"), a_PK.dtype)
    tiles = max_tiles(bound, num_experts, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    upcast, prec = dot_flags(a_PK.dtype)
    grid = (num_programs(a_PK.device, tiles, cfg.ctas_per_sm),)
    _gemm_scatter_kernel[grid](
        a_PK,
        pair_P,
        offsets_E1,
        b_EKN,
        b_EKN if b2_EKN is None else b2_EKN,
        out,
        num_experts,
        num_slots,
        n,
        kd,
        k1,
        a_PK.stride(0),
        b_EKN.stride(0),
        b_EKN.stride(1),
        b_EKN.stride(2),
        out.stride(0),
        ATOMIC=atomic,
        TWO_B=b2_EKN is not None,
        EVEN_K=k1 % cfg.block_k == 0 and kd % cfg.block_k == 0,
        UPCAST=upcast,
        PREC=prec,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        E_POW2=e_pow2(num_experts),
        FLATTEN=cfg.flatten,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
