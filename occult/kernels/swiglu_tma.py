"""The two expert products that carry a SwiGLU, with it in their epilogue, operands read through TMA (Hopper).

On the `_grouped_mm` path (`kernels.grouped_mm`) GEMM 1 of the training forward writes `[a; b]` and an elementwise
pass reads it back to make `hg = g silu(a) b`; the SwiGLU dgrad writes `u = dy_r down[e]` and a second pass reads
`u` and `[a; b]` back to make `d[a; b]` and the gate gradient. A one-GPU training step runs at the card's power
cap, where a step's time is its energy (docs/training.md), and those passes are energy the dense twin of each
product does not spend (docs/kernels.md, "Energy per FLOP"). Here each product runs as one persistent Triton
kernel over expert-sorted pair rows (the rows `grouped_mm.gather_pair_rows` copied), its operands moved by the
copy engine through device-side tensor descriptors (`tl.make_tensor_descriptor`), and the SwiGLU applied to the
fp32 accumulators before anything is stored:

- `gemm1_swiglu`: `[a; b] = x_sorted gate_up[e]^T` (two accumulators: the tile's gate and up columns), stores
  `[a; b]` (the backward's) and `hg`.
- `swiglu_dgrad`: `u = dy_sorted down[e]`, then the SwiGLU backward of `grouped_gemm_backward.swiglu_dgrad_epilogue`
  (d[a; b] stored, the gate gradient's per-column-tile partial sums), with `u` never written.

A tile's rows past its expert's end read the next expert's rows (masked at the store) and blocks past a tensor's end
read the descriptor's zeros; the contraction's columns past H are zeros in the row operand's descriptor, so the
weight rows they meet add nothing. `fits` says whether operands suit the descriptors (2-byte floats, 16-byte
strides and starts): the callers fall back to the `_grouped_mm` path otherwise. Setting `gemm1` / `dgrad1` = `tma`
selects these (docs/settings.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from occult.kernels import config as _config
from occult.kernels.grouped_gemm import num_programs
from occult.kernels.grouped_gemm_backward import swiglu_dgrad_epilogue
from occult.kernels.pairs import e_pow2, grouped_pid, max_tiles, tile_lookup, tile_schedule


def fits(rows_PK: torch.Tensor, *operands: torch.Tensor) -> bool:
    """Whether the kernels here take these operands: 2-byte floats of one dtype, contiguous, rows a multiple of 16
    bytes wide, every storage start 16-byte aligned (shapes, strides and offsets only: torch.compile traces it)."""
    if rows_PK.dtype not in (torch.bfloat16, torch.float16):
        return False
    if rows_PK.is_cuda and not _config.interpreting() and _capability(rows_PK.device) < 9:  # (TMA: Hopper on)
        return False
    for t in (rows_PK, *operands):
        if t.dtype != rows_PK.dtype or not t.is_contiguous() or t.shape[-1] % 8:
            return False
        if t.storage_offset() * t.element_size() % 16:
            return False
    return True


_CAPABILITY: dict[int, int] = {}


def _capability(device: torch.device) -> int:
    """The major compute capability of a CUDA device, asked once per device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)[0]
    return _CAPABILITY[index]


def _allocate_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global memory for the kernels' device-side descriptors (Triton asks at launch)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _set_allocator() -> None:
    """Triton keeps its allocator per thread (a ContextVar): set it in the thread that launches (the backward runs in
    autograd's), unless torch.compile traces the launch (its generated launcher sets its own)."""
    if not torch.compiler.is_compiling() and not _config.interpreting():
        triton.set_allocator(_allocate_scratch)


@triton.jit
def _gemm1_swiglu_kernel(
    x_ptr,
    w_ptr,
    pair_ptr,
    offsets_ptr,
    gate_ptr,
    ab_ptr,
    hg_ptr,
    num_experts,
    bound,
    H,
    F,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    E_POW2: tl.constexpr,
    FLATTEN: tl.constexpr,
):
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[bound, H], strides=[H, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(
        w_ptr, shape=[num_experts * 2 * F, H], strides=[H, 1], block_shape=[BLOCK_N, BLOCK_K]
    )
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    e, lo, hi, ntiles, cum = tile_schedule(offsets_ptr, num_experts, BLOCK_M, E_POW2)
    tiles_m = tl.sum(ntiles, axis=0)
    tiles_n = tl.cdiv(F, BLOCK_N)
    for tile in tl.range(pid, tiles_m * tiles_n, nprog, flatten=FLATTEN):
        tile_m, tile_n = grouped_pid(tile, tiles_m, tiles_n, GROUP_M)
        expert, m_start, m_end = tile_lookup(e, lo, hi, ntiles, cum, tile_m, BLOCK_M)
        row_a = expert * 2 * F + tile_n * BLOCK_N  # the tile's gate rows of gate_up; its up rows F further
        acc_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_b = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(H, BLOCK_K)):
            xt = x_desc.load([m_start, k * BLOCK_K])
            wa = w_desc.load([row_a, k * BLOCK_K]).T
            wb = w_desc.load([row_a + F, k * BLOCK_K]).T
            if UPCAST:  # (the interpreter multiplies half-precision bit patterns as integers: grouped_gemm.dot_flags)
                xt = xt.to(tl.float32)
                wa = wa.to(tl.float32)
                wb = wb.to(tl.float32)
            acc_a = tl.dot(xt, wa, acc_a)
            acc_b = tl.dot(xt, wb, acc_b)
        offs_m = m_start + tl.arange(0, BLOCK_M)
        mask_m = offs_m < m_end
        pair = tl.load(pair_ptr + offs_m, mask=mask_m, other=0)
        g = tl.load(gate_ptr + pair, mask=mask_m, other=0.0).to(tl.float32)
        offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m64 = offs_m.to(tl.int64)
        mask = mask_m[:, None] & (offs_n < F)[None, :]
        ab_ptrs = ab_ptr + offs_m64[:, None] * (2 * F) + offs_n[None, :]
        tl.store(ab_ptrs, acc_a.to(ab_ptr.dtype.element_ty), mask=mask)
        tl.store(ab_ptrs + F, acc_b.to(ab_ptr.dtype.element_ty), mask=mask)
        hg = acc_a * tl.sigmoid(acc_a) * acc_b * g[:, None]
        tl.store(hg_ptr + offs_m64[:, None] * F + offs_n[None, :], hg.to(hg_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_dgrad_kernel(
    dy_ptr,
    w_ptr,
    ab_ptr,
    pair_ptr,
    offsets_ptr,
    gate_ptr,
    dab_ptr,
    dg_ptr,
    num_experts,
    bound,
    H,
    F,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    E_POW2: tl.constexpr,
    FLATTEN: tl.constexpr,
    SPLIT: tl.constexpr,
):
    dy_desc = tl.make_tensor_descriptor(dy_ptr, shape=[bound, H], strides=[H, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(
        w_ptr, shape=[num_experts * H, F], strides=[F, 1], block_shape=[BLOCK_K, BLOCK_N]
    )
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    e, lo, hi, ntiles, cum = tile_schedule(offsets_ptr, num_experts, BLOCK_M, E_POW2)
    tiles_m = tl.sum(ntiles, axis=0)
    tiles_n = tl.cdiv(F, BLOCK_N)
    for tile in tl.range(pid, tiles_m * tiles_n, nprog, flatten=FLATTEN):
        tile_m, tile_n = grouped_pid(tile, tiles_m, tiles_n, GROUP_M)
        expert, m_start, m_end = tile_lookup(e, lo, hi, ntiles, cum, tile_m, BLOCK_M)
        first_n = tile_n * BLOCK_N
        u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(H, BLOCK_K)):
            dyt = dy_desc.load([m_start, k * BLOCK_K])
            wt = w_desc.load([expert * H + k * BLOCK_K, first_n])
            if UPCAST:
                dyt = dyt.to(tl.float32)
                wt = wt.to(tl.float32)
            u = tl.dot(dyt, wt, u)
        offs_m = m_start + tl.arange(0, BLOCK_M)
        mask_m = offs_m < m_end
        pair = tl.load(pair_ptr + offs_m, mask=mask_m, other=0)
        if SPLIT == 2:  # (the epilogue in two column halves: grouped_gemm_backward's register note)
            u0, u1 = tl.split(tl.permute(tl.reshape(u, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            dg = swiglu_dgrad_epilogue(u0, offs_m, mask_m, pair, first_n, ab_ptr, gate_ptr, dab_ptr, F, BLOCK_N // 2)
            dg += swiglu_dgrad_epilogue(
                u1, offs_m, mask_m, pair, first_n + BLOCK_N // 2, ab_ptr, gate_ptr, dab_ptr, F, BLOCK_N // 2
            )
        else:
            dg = swiglu_dgrad_epilogue(u, offs_m, mask_m, pair, first_n, ab_ptr, gate_ptr, dab_ptr, F, BLOCK_N)
        tl.store(dg_ptr + tile_n.to(tl.int64) * bound + pair, dg, mask=mask_m)


def _programs(bound: int, num_experts: int, width: int, cfg: _config.TileConfig, t: torch.Tensor) -> int:
    return num_programs(t.device, max_tiles(bound, num_experts, cfg.block_m) * triton.cdiv(width, cfg.block_n))


def gemm1_swiglu(
    x_sorted_PH: torch.Tensor,
    gate_up_EFH: torch.Tensor,
    pair_P: torch.Tensor,
    offsets_E1: torch.Tensor,
    gates_flat: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(hg `[R*K, F]`, [a; b] `[R*K, 2F]`) from x rows in sorted-pair order `[R*K, H]` and the joined weight
    `[E, 2F, H]`: `grouped_mm.gemm1_grouped`'s product and pass in one kernel (first P rows written)."""
    bound, hidden = x_sorted_PH.shape
    num_experts, two_f, _ = gate_up_EFH.shape
    ffn = two_f // 2
    ab = x_sorted_PH.new_empty((bound, two_f))
    hg = x_sorted_PH.new_empty((bound, ffn))
    if bound == 0 or ffn == 0 or num_experts == 0:
        return hg, ab
    cfg = _config.get("gemm1_tma")
    _set_allocator()
    _gemm1_swiglu_kernel[(_programs(bound, num_experts, ffn, cfg, x_sorted_PH),)](
        x_sorted_PH,
        gate_up_EFH,
        pair_P,
        offsets_E1,
        gates_flat,
        ab,
        hg,
        num_experts,
        bound,
        hidden,
        ffn,
        UPCAST=_config.interpreting(),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        E_POW2=e_pow2(num_experts),
        FLATTEN=cfg.flatten,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return hg, ab


def swiglu_dgrad(
    dy_sorted_PH: torch.Tensor,
    down_EHF: torch.Tensor,
    ab_PF2: torch.Tensor,
    pair_P: torch.Tensor,
    offsets_E1: torch.Tensor,
    gates_flat: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d[a; b] `[R*K, 2F]`, gate gradient `[R*K]` fp32 at the flat index) from dy rows in sorted-pair order:
    `grouped_mm.swiglu_dgrad_grouped`'s product and pass in one kernel, `u` kept in fp32 registers."""
    bound, hidden = dy_sorted_PH.shape
    num_experts, _, ffn = down_EHF.shape
    dab = dy_sorted_PH.new_empty((bound, 2 * ffn))
    if bound == 0 or ffn == 0 or num_experts == 0:
        return dab, torch.zeros(bound, device=dab.device, dtype=torch.float32)
    cfg = _config.get("dgrad1_tma")
    tiles_n = triton.cdiv(ffn, cfg.block_n)
    dg_part = torch.zeros((tiles_n, bound), device=dab.device, dtype=torch.float32)
    _set_allocator()
    _swiglu_dgrad_kernel[(_programs(bound, num_experts, ffn, cfg, dy_sorted_PH),)](
        dy_sorted_PH,
        down_EHF,
        ab_PF2,
        pair_P,
        offsets_E1,
        gates_flat,
        dab,
        dg_part,
        num_experts,
        bound,
        hidden,
        ffn,
        UPCAST=_config.interpreting(),
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
    return dab, (dg_part[0] if tiles_n == 1 else dg_part.sum(0))


__all__ = ["fits", "gemm1_swiglu", "swiglu_dgrad"]
