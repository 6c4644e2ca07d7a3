"""The backward's GEMMs through `torch._grouped_mm` (CUTLASS grouped GEMM), where it is faster.

`grad gate_up[e] = sum_p d[a;b]_p x_r^T` and `grad down[e] = sum_p dy_r hg_p^T` contract over
an expert's pairs. On Hopper with bf16 operands `torch._grouped_mm`'s K-grouped product (2-D x
2-D with `offs`: one `[M, N]` output per group, the contraction over the group's rows) runs
near dense cuBLAS speed (TMA, warp-specialised, clusters), the Triton `weight_grad` well below
it (docs/kernels.md). It needs both operands in sorted-pair order, so the row-indexed one
(`x` or `dy`) is first copied by `gather_pair_rows`: the first P rows only (P is read on the
device, no host sync), a copy which the faster GEMM more than repays (docs/kernels.md, "Design",
has its cost). Groups with no rows get zeros, rows past `offsets[E]` are never
read. `swiglu_dgrad_grouped` computes `u = down[e]^T dy_r` the same way from the copied dy rows
(2-D x 3-D), then the SwiGLU backward and gate gradient in one elementwise pass.

The training forward's GEMM 1 can go the same way (`gemm1_grouped`): x rows copied into sorted-pair
order, `[a; b] = _grouped_mm(x_sorted, gate_up^T)`, then `hg = g silu(a) b` in one elementwise pass
(`swiglu_forward_rows`). The copied rows are kept for the backward, whose `grad gate_up` reads them
instead of copying x again; the fused Triton GEMM 1 (`grouped_gemm.gather_gemm_swiglu`) stays the
inference path, where nothing would reuse the copy.

`use_grouped_mm` decides: CUDA, bf16, compute capability 9.x, 16-byte row strides; the settings
`wgrad` (weight gradients) / `dgrad1` (the dgrad) / `gemm1` (the training forward's GEMM 1) =
`triton` turn it off, `grouped_mm` forces it (also on CPU, where torch has a reference
implementation; the tests use that), `auto` (the default of all three) is the rule above (env
`OCCULT_WGRAD` / `OCCULT_DGRAD1` / `OCCULT_GEMM1`, docs/settings.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from occult import settings
from occult.kernels import config as _config


def use_grouped_mm(t: torch.Tensor, *widths: int, which: str = "wgrad") -> bool:
    """Whether the weight gradients (`which="wgrad"`), the SwiGLU dgrad (`"dgrad1"`) or the training
    forward's GEMM 1 (`"gemm1"`) of operands like `t` with row widths `widths` use
    `torch._grouped_mm` (module docstring); the mode is that setting of `occult.settings.current()`."""
    if which not in ("wgrad", "dgrad1", "gemm1"):
        raise ValueError(f"which must be 'wgrad', 'dgrad1' or 'gemm1', got {which!r}")
    mode = getattr(settings.current(), which)
    if mode == "triton" or not hasattr(torch, "_grouped_mm") or t.dtype != torch.bfloat16:
        return False
    if any(w % 8 for w in widths):  # 16-byte strides of bf16 rows
        return False
    if mode == "grouped_mm":
        return True
    if _config.interpreting() or t.device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(t.device)[0] == 9


def row_programs(bound: int, cfg: _config.TileConfig, t: torch.Tensor) -> int:
    """Programs of a persistent kernel over `bound` rows in tiles of `cfg.block_m` (the row passes
    here): one per tile, at most `cfg.ctas_per_sm` per SM of `t`'s GPU, at least one."""
    programs = triton.cdiv(bound, cfg.block_m)
    if not _config.interpreting() and t.is_cuda:
        programs = min(programs, cfg.ctas_per_sm * torch.cuda.get_device_properties(t.device).multi_processor_count)
    return max(1, programs)


@triton.jit
def _gather_pair_rows_kernel(
    src_ptr,
    pair_ptr,
    offsets_ptr,
    out_ptr,
    num_experts,
    num_slots,
    N,
    stride_src,
    stride_out,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_pairs = tl.load(offsets_ptr + num_experts)
    for blk in range(pid, tl.cdiv(num_pairs, BLOCK_R), nprog):
        offs_r = blk * BLOCK_R + tl.arange(0, BLOCK_R)
        mask_r = offs_r < num_pairs
        pair = tl.load(pair_ptr + offs_r, mask=mask_r, other=0)
        row = (pair // num_slots).to(tl.int64)
        for n0 in range(0, N, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask = mask_r[:, None] & (offs_n < N)[None, :]
            v = tl.load(src_ptr + row[:, None] * stride_src + offs_n[None, :], mask=mask)
            tl.store(out_ptr + offs_r.to(tl.int64)[:, None] * stride_out + offs_n[None, :], v, mask=mask)


def gather_pair_rows(
    src_RN: torch.Tensor,
    pair_P: torch.Tensor,
    offsets_E1: torch.Tensor,
    num_slots: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`out[i] = src[pair[i] // K]` for the first P = `offsets[E]` sorted pairs; `out` is
    `[R*K, N]` (allocated if None; later rows are left as they are)."""
    bound, n = pair_P.numel(), src_RN.shape[1]
    if out is None:
        out = src_RN.new_empty((bound, n))
    if bound == 0 or n == 0:
        return out
    if src_RN.stride(1) != 1:
        src_RN = src_RN.contiguous()
    cfg = _config.get("gather")
    block_n = min(cfg.block_n, triton.next_power_of_2(n))
    _gather_pair_rows_kernel[(row_programs(bound, cfg, src_RN),)](
        src_RN,
        pair_P,
        offsets_E1,
        out,
        offsets_E1.numel() - 1,
        num_slots,
        n,
        src_RN.stride(0),
        out.stride(0),
        BLOCK_R=cfg.block_m,
        BLOCK_N=block_n,
        num_warps=cfg.num_warps,
    )
    return out


def grouped_weight_grad(a_PM: torch.Tensor, b_PN: torch.Tensor, offsets_E1: torch.Tensor) -> torch.Tensor:
    """`out[e] = a[s:t]^T b[s:t]` `[E, M, N]` for expert e's sorted-pair rows `s:t` (zeros when
    empty), through `torch._grouped_mm`. Both operands `[>= P, ·]` with unit column stride."""
    return torch._grouped_mm(a_PM.t(), b_PN, offs=offsets_E1[1:])


@triton.jit
def _swiglu_backward_rows_kernel(
    u_ptr,
    ab_ptr,
    pair_ptr,
    offsets_ptr,
    gate_ptr,
    dab_ptr,
    dg_ptr,
    num_experts,
    F,
    stride_u,
    BLOCK_R: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_pairs = tl.load(offsets_ptr + num_experts)
    for blk in range(pid, tl.cdiv(num_pairs, BLOCK_R), nprog):
        offs_r = blk * BLOCK_R + tl.arange(0, BLOCK_R)
        mask_r = offs_r < num_pairs
        pair = tl.load(pair_ptr + offs_r, mask=mask_r, other=0)
        g = tl.load(gate_ptr + pair, mask=mask_r, other=0.0).to(tl.float32)
        r64 = offs_r.to(tl.int64)
        dg = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for f0 in range(0, F, BLOCK_F):
            offs_f = f0 + tl.arange(0, BLOCK_F)
            mask = mask_r[:, None] & (offs_f < F)[None, :]
            u = tl.load(u_ptr + r64[:, None] * stride_u + offs_f[None, :], mask=mask, other=0.0).to(tl.float32)
            ab_ptrs = ab_ptr + r64[:, None] * (2 * F) + offs_f[None, :]
            a = tl.load(ab_ptrs, mask=mask, other=0.0).to(tl.float32)
            b = tl.load(ab_ptrs + F, mask=mask, other=0.0).to(tl.float32)
            sig = tl.sigmoid(a)
            silu = a * sig
            dg += tl.sum(u * silu * b, axis=1)
            dh = u * g[:, None]
            dab_ptrs = dab_ptr + r64[:, None] * (2 * F) + offs_f[None, :]
            tl.store(dab_ptrs, (dh * b * (sig + silu * (1.0 - sig))).to(dab_ptr.dtype.element_ty), mask=mask)
            tl.store(dab_ptrs + F, (dh * silu).to(dab_ptr.dtype.element_ty), mask=mask)
        tl.store(dg_ptr + pair, dg, mask=mask_r)


def swiglu_backward_rows(
    u_PF: torch.Tensor,
    ab_PF2: torch.Tensor,
    pair_P: torch.Tensor,
    offsets_E1: torch.Tensor,
    gates_flat: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The elementwise half of the SwiGLU dgrad, one pass over the first P sorted pairs:
    `dh = g u`, `d[a; b]` from the saved `[a; b]`, and the gate gradient `<u, silu(a) b>` over a
    full row (no partial sums). Returns (d[a; b] `[R*K, 2F]`, dg `[R*K]` fp32 at the flat index)."""
    bound, ffn = pair_P.numel(), ab_PF2.shape[1] // 2
    dab = ab_PF2.new_empty((bound, 2 * ffn))
    dg = torch.zeros(bound, device=ab_PF2.device, dtype=torch.float32)
    if bound == 0 or ffn == 0:
        return dab, dg
    cfg = _config.get("swiglu_rows")
    _swiglu_backward_rows_kernel[(row_programs(bound, cfg, u_PF),)](
        u_PF,
        ab_PF2,
        pair_P,
        offsets_E1,
        gates_flat,
        dab,
        dg,
        offsets_E1.numel() - 1,
        ffn,
        u_PF.stride(0),
        BLOCK_R=cfg.block_m,
        BLOCK_F=min(cfg.block_n, triton.next_power_of_2(ffn)),
        num_warps=cfg.num_warps,
    )
    return dab, dg


def swiglu_dgrad_grouped(
    dy_sorted: torch.Tensor,
    pair_P: torch.Tensor,
    offsets_E1: torch.Tensor,
    down_EHF: torch.Tensor,
    ab_PF2: torch.Tensor,
    gates_flat: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`grouped_gemm_backward.swiglu_dgrad` from dy rows already in sorted-pair order:
    `u = torch._grouped_mm(dy_sorted, down)` (bf16), then `swiglu_backward_rows`. Same outputs:
    (d[a; b], dg)."""
    u = torch._grouped_mm(dy_sorted, down_EHF, offs=offsets_E1[1:])
    return swiglu_backward_rows(u, ab_PF2, pair_P, offsets_E1, gates_flat)


@triton.jit
def _swiglu_forward_rows_kernel(
    ab_ptr,
    pair_ptr,
    offsets_ptr,
    gate_ptr,
    hg_ptr,
    num_experts,
    F,
    BLOCK_R: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_pairs = tl.load(offsets_ptr + num_experts)
    for blk in range(pid, tl.cdiv(num_pairs, BLOCK_R), nprog):
        offs_r = blk * BLOCK_R + tl.arange(0, BLOCK_R)
        mask_r = offs_r < num_pairs
        pair = tl.load(pair_ptr + offs_r, mask=mask_r, other=0)
        g = tl.load(gate_ptr + pair, mask=mask_r, other=0.0).to(tl.float32)
        r64 = offs_r.to(tl.int64)
        for f0 in range(0, F, BLOCK_F):
            offs_f = f0 + tl.arange(0, BLOCK_F)
            mask = mask_r[:, None] & (offs_f < F)[None, :]
            ab_ptrs = ab_ptr + r64[:, None] * (2 * F) + offs_f[None, :]
            a = tl.load(ab_ptrs, mask=mask, other=0.0).to(tl.float32)
            b = tl.load(ab_ptrs + F, mask=mask, other=0.0).to(tl.float32)
            hg = g[:, None] * (a * tl.sigmoid(a)) * b
            tl.store(hg_ptr + r64[:, None] * F + offs_f[None, :], hg.to(hg_ptr.dtype.element_ty), mask=mask)


def swiglu_forward_rows(
    ab_PF2: torch.Tensor, pair_P: torch.Tensor, offsets_E1: torch.Tensor, gates_flat: torch.Tensor
) -> torch.Tensor:
    """The elementwise half of GEMM 1, one pass over the first P sorted pairs: `hg = g silu(a) b`
    `[R*K, F]` in `[a; b]`'s dtype (later rows left unwritten), g the pair's gate."""
    bound, ffn = pair_P.numel(), ab_PF2.shape[1] // 2
    hg = ab_PF2.new_empty((bound, ffn))
    if bound == 0 or ffn == 0:
        return hg
    cfg = _config.get("swiglu_rows")
    _swiglu_forward_rows_kernel[(row_programs(bound, cfg, ab_PF2),)](
        ab_PF2,
        pair_P,
        offsets_E1,
        gates_flat,
        hg,
        offsets_E1.numel() - 1,
        ffn,
        BLOCK_R=cfg.block_m,
        BLOCK_F=min(cfg.block_n, triton.next_power_of_2(ffn)),
        num_warps=cfg.num_warps,
    )
    return hg


def gemm1_grouped(
    x_RH: torch.Tensor,
    pair_P: torch.Tensor,
    offsets_E1: torch.Tensor,
    gate_up_EFH: torch.Tensor,
    gates_flat: torch.Tensor,
    num_slots: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GEMM 1 of the training forward through `torch._grouped_mm` (module docstring): returns
    (hg `[R*K, F]`, [a; b] `[R*K, 2F]`, x rows in sorted-pair order `[R*K, H]`), the first P rows
    of each written, as `grouped_gemm.gather_gemm_swiglu(..., save_ab=True)` plus the copied rows."""
    x_sorted = gather_pair_rows(x_RH, pair_P, offsets_E1, num_slots)
    ab = torch._grouped_mm(x_sorted, gate_up_EFH.transpose(1, 2), offs=offsets_E1[1:])
    return swiglu_forward_rows(ab, pair_P, offsets_E1, gates_flat), ab, x_sorted
