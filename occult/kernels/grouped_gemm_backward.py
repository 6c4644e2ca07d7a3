"""Backward kernels of the expert MLP.

With pairs p = (row r, expert e, gate g), `h_p = silu(a_p) * b_p`, `o_p = down[e] @ h_p`,
`y_r = sum_p g_p o_p`, and the incoming `dy`:

- `swiglu_dgrad` (persistent, grouped over expert-sorted pairs, dy rows gathered in the
  prologue): `u_p = down[e]^T dy_r`; epilogue: `h_p` recomputed from the saved `[a; b]_p`,
  gate gradient `<u_p, h_p>` (per n-tile partial sums, reduced by the caller; `o_p` is
  neither stored nor recomputed), `dh_p = g_p u_p`, and back through SwiGLU to `d[a; b]_p`,
  stored at the pair's sorted position.
- the input gradient `dx_p = gate_up[e]^T d[a; b]_p` is `grouped_gemm.gemm_scatter` (gather
  and scatter swapped relative to GEMM 1), followed by `combine.combine_rows`.
- `weight_grad` (one program per (expert, m-tile, n-tile), looping over the expert's pairs):
  `out[e] = sum_p A[rowA_p]^T B[rowB_p]` with either operand gathered through the pair's
  row; `grad gate_up[e] = sum_p d[a;b]_p x_r^T`, `grad down[e] = sum_p dy_r (g_p h_p)^T` (the
  forward saved `g_p h_p`, GEMM 2's input, so no per-pair scaling happens here).
  Accumulated in fp32, written once (deterministic; experts with no pairs get zeros).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from occult.kernels import config as _config
from occult.kernels.grouped_gemm import dot_flags, dot_over_k, num_programs
from occult.kernels.pairs import e_pow2, grouped_pid, max_tiles, tile_lookup, tile_schedule


@triton.jit
def _swiglu_dgrad_epilogue(u, offs_m, mask_m, pair, first_n, ab_ptr, gate_ptr, dab_ptr, F, WIDTH: tl.constexpr):
    """SwiGLU backward of the `WIDTH` columns from `first_n` of one tile: stores d[a; b], returns
    the partial gate gradient `<u, h>` of each row over these columns."""
    offs_n = first_n + tl.arange(0, WIDTH)
    offs_m64 = offs_m.to(tl.int64)
    mask = mask_m[:, None] & (offs_n < F)[None, :]
    ab_ptrs = ab_ptr + offs_m64[:, None] * (2 * F) + offs_n[None, :]
    a = tl.load(ab_ptrs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(ab_ptrs + F, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + pair, mask=mask_m, other=0.0).to(tl.float32)
    sig = tl.sigmoid(a)
    silu = a * sig
    dg = tl.sum(u * silu * b, axis=1)  # <u, h>; masked columns have a = b = 0
    dh = u * g[:, None]
    da = dh * b * (sig + silu * (1.0 - sig))
    db = dh * silu
    dab_ptrs = dab_ptr + offs_m64[:, None] * (2 * F) + offs_n[None, :]
    tl.store(dab_ptrs, da.to(dab_ptr.dtype.element_ty), mask=mask)
    tl.store(dab_ptrs + F, db.to(dab_ptr.dtype.element_ty), mask=mask)
    return dg


@triton.jit
def _swiglu_dgrad_kernel(
    dy_ptr,
    pair_ptr,
    offsets_ptr,
    w_ptr,
    ab_ptr,
    gate_ptr,
    dab_ptr,
    dg_ptr,
    num_experts,
    num_slots,
    num_pairs_bound,
    H,
    F,
    stride_dyr,
    stride_we,
    stride_wh,
    stride_wf,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    E_POW2: tl.constexpr,
    FLATTEN: tl.constexpr,
    SPLIT: tl.constexpr,
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
        row = (pair // num_slots).to(tl.int64)
        offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_nw = offs_n % F
        offs_k = tl.arange(0, BLOCK_K)
        dy_ptrs = dy_ptr + row[:, None] * stride_dyr + offs_k[None, :]
        w_ptrs = (
            w_ptr
            + expert.to(tl.int64) * stride_we
            + offs_k[:, None].to(tl.int64) * stride_wh
            + offs_nw[None, :] * stride_wf
        )
        u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        u = dot_over_k(u, dy_ptrs, w_ptrs, H, stride_wh, EVEN_K, UPCAST, PREC, BLOCK_K)
        # Epilogue in SPLIT column slices: a 128 x 128 fp32 tile at once spilled registers and
        # made Triton compute it in two layouts (two fp32 layout conversions, sigmoid twice).
        first_n = tile_n * BLOCK_N
        if SPLIT == 2:
            u0, u1 = tl.split(tl.permute(tl.reshape(u, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            dg = _swiglu_dgrad_epilogue(u0, offs_m, mask_m, pair, first_n, ab_ptr, gate_ptr, dab_ptr, F, BLOCK_N // 2)
            dg += _swiglu_dgrad_epilogue(
                u1, offs_m, mask_m, pair, first_n + BLOCK_N // 2, ab_ptr, gate_ptr, dab_ptr, F, BLOCK_N // 2
            )
        else:
            dg = _swiglu_dgrad_epilogue(u, offs_m, mask_m, pair, first_n, ab_ptr, gate_ptr, dab_ptr, F, BLOCK_N)
        tl.store(dg_ptr + tile_n.to(tl.int64) * num_pairs_bound + pair, dg, mask=mask_m)


@triton.jit
def _weight_grad_kernel(
    a_ptr,
    b_ptr,
    pair_ptr,
    offsets_ptr,
    out_ptr,
    num_slots,
    M,
    N,
    stride_a,
    stride_b,
    stride_oe,
    stride_om,
    stride_on,
    A_GATHER: tl.constexpr,
    B_GATHER: tl.constexpr,
    UPCAST: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_expert = tiles_m * tiles_n
    expert = pid // per_expert
    t = pid % per_expert
    tile_m = t // tiles_n
    tile_n = t % tiles_n
    start = tl.load(offsets_ptr + expert)
    end = tl.load(offsets_ptr + expert + 1)
    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_mw = offs_m % M
    offs_nw = offs_n % N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # One masked loop over chunks of BLOCK_K pairs. The pair indices of a chunk are loaded one
    # iteration ahead (loop-carried): Triton's pipeliner then streams the gathered rows with
    # `num_stages` buffers; an index load feeding a data load of the same iteration left it
    # double-buffered with a full wait every step (`async_wait num = 0`).
    offs_p = start + tl.arange(0, BLOCK_K)
    rows = (tl.load(pair_ptr + offs_p, mask=offs_p < end, other=0) // num_slots).to(tl.int64)
    for _it in range(0, tl.cdiv(end - start, BLOCK_K)):
        mask_p = offs_p < end
        rows_a = rows if A_GATHER else offs_p.to(tl.int64)
        rows_b = rows if B_GATHER else offs_p.to(tl.int64)
        at = tl.load(a_ptr + rows_a[:, None] * stride_a + offs_mw[None, :], mask=mask_p[:, None], other=0.0)
        bt = tl.load(b_ptr + rows_b[:, None] * stride_b + offs_nw[None, :], mask=mask_p[:, None], other=0.0)
        if UPCAST:
            at = at.to(tl.float32)
            bt = bt.to(tl.float32)
        acc = tl.dot(tl.trans(at), bt, acc, input_precision=PREC)
        offs_p += BLOCK_K
        rows = (tl.load(pair_ptr + offs_p, mask=offs_p < end, other=0) // num_slots).to(tl.int64)
    out_ptrs = (
        out_ptr
        + expert.to(tl.int64) * stride_oe
        + offs_m.to(tl.int64)[:, None] * stride_om
        + offs_n[None, :] * stride_on
    )
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def swiglu_dgrad(
    dy_RH: torch.Tensor,
    pair_P: torch.Tensor,
    offsets_E1: torch.Tensor,
    down_EHF: torch.Tensor,
    ab_PF2: torch.Tensor,
    gates_flat: torch.Tensor,
    num_slots: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d[a; b] `[R*K, 2F]` in sorted-pair order, gate gradient `[R*K]` fp32 by flat index)."""
    num_experts, hidden, ffn = down_EHF.shape
    bound = pair_P.numel()
    cfg = _config.get("dgrad1", dy_RH.dtype)
    tiles_n = triton.cdiv(ffn, cfg.block_n)
    dab = dy_RH.new_empty((bound, 2 * ffn))
    dg_part = torch.zeros((tiles_n, bound), device=dy_RH.device, dtype=torch.float32)
    upcast, prec = dot_flags(dy_RH.dtype)
    tiles = max_tiles(bound, num_experts, cfg.block_m) * tiles_n
    grid = (num_programs(dy_RH.device, tiles, cfg.ctas_per_sm),)
    _swiglu_dgrad_kernel[grid](
        dy_RH,
        pair_P,
        offsets_E1,
        down_EHF,
        ab_PF2,
        gates_flat,
        dab,
        dg_part,
        num_experts,
        num_slots,
        bound,
        hidden,
        ffn,
        dy_RH.stride(0),
        down_EHF.stride(0),
        down_EHF.stride(1),
        down_EHF.stride(2),
        EVEN_K=hidden % cfg.block_k == 0,
        UPCAST=upcast,
        PREC=prec,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        E_POW2=e_pow2(num_experts),
        FLATTEN=cfg.flatten,
        SPLIT=cfg.split,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    dg = dg_part[0] if tiles_n == 1 else dg_part.sum(0)
    return dab, dg


def weight_grad(
    a: torch.Tensor,
    b: torch.Tensor,
    pair_P: torch.Tensor,
    offsets_E1: torch.Tensor,
    num_slots: int,
    out: torch.Tensor,
    a_gather: bool,
    b_gather: bool,
) -> torch.Tensor:
    """out[e] `[M, N]` = sum over expert e's pairs of a[rowA_p]^T b[rowB_p].

    A gathered operand is indexed by the pair's row (`pair // K`), the other by its sorted
    position. Both need unit stride along their columns.
    """
    num_experts, m, n = out.shape
    cfg = _config.get("wgrad", a.dtype)
    upcast, prec = dot_flags(a.dtype)
    grid = (num_experts * triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    if grid[0] == 0:
        return out
    _weight_grad_kernel[grid](
        a,
        b,
        pair_P,
        offsets_E1,
        out,
        num_slots,
        m,
        n,
        a.stride(0),
        b.stride(0),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        A_GATHER=a_gather,
        B_GATHER=b_gather,
        UPCAST=upcast,
        PREC=prec,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
