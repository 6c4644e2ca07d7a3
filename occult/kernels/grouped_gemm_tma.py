"""`grouped_gemm.gemm_scatter`'s product with its operands read through TMA (tensor descriptors, Hopper).

The pointer kernel (`grouped_gemm._gemm_scatter_kernel`) computes every operand address of a tile in registers
and loads with `cp.async`; here the copy engine moves each `[BLOCK_M, BLOCK_K]` block of the contiguous pair rows
and each block of the expert's weight by descriptor, which frees the registers and issue slots the addresses
took. It serves the layouts the expert MLP has: pair rows `a` `[P, KD]` with rows `KD` apart, and a weight that
is one 2-D tensor expert after expert, either `[E, N, KD]` (K contiguous: `down` read as `down^T`, the forward's
GEMM 2) or `[E, KD, N]` (N contiguous: the joined `gate_up`, the dgrad of GEMM 1).
`layout` says whether (and how) a call fits; `gemm_scatter` falls back to the pointer kernel otherwise.

Blocks past an expert's rows (the tile's last rows, the weight's rows past the expert's K or N) read neighbours'
values or the descriptor's zeros: the rows are masked at the store, the columns past N are masked, and the K
columns past KD are zeros in `a` (its descriptor ends there), so they add nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from occult import settings
from occult.kernels.config import TileConfig, interpreting
from occult.kernels.pairs import grouped_pid, tile_lookup, tile_schedule


@triton.jit
def _gemm_scatter_tma_kernel(
    a_desc,
    b_desc,
    pair_ptr,
    offsets_ptr,
    out_ptr,
    num_experts,
    N,
    KD,
    b_rows_per_expert,
    stride_om,
    B_KMAJOR: tl.constexpr,
    UPCAST: tl.constexpr,
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
        n0 = tile_n * BLOCK_N
        b_row0 = expert * b_rows_per_expert
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(KD, BLOCK_K)):
            a = a_desc.load([m_start, k * BLOCK_K])
            if B_KMAJOR:
                b = b_desc.load([b_row0 + n0, k * BLOCK_K]).T
            else:
                b = b_desc.load([b_row0 + k * BLOCK_K, n0])
            if UPCAST:  # (the interpreter multiplies half-precision bit patterns as integers: grouped_gemm.dot_flags)
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc)
        offs_m = m_start + tl.arange(0, BLOCK_M)
        mask_m = offs_m < m_end
        pair = tl.load(pair_ptr + offs_m, mask=mask_m, other=0)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask = mask_m[:, None] & (offs_n < N)[None, :]
        out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def use_tma(t: torch.Tensor) -> bool:
    """Whether GEMM 2 and the GEMM-1 dgrad of operands like `t` take the TMA kernel (setting `tma`, env `OCCULT_TMA`):
    "auto" (the default) and "on" on a GPU with TMA (compute capability 9 or later), "off" never; under the CPU
    interpreter only "on" (the tests)."""
    mode = settings.current().tma
    if mode == "off":
        return False
    if t.is_cuda and not interpreting():
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        if index not in _CAPABILITY:
            _CAPABILITY[index] = torch.cuda.get_device_capability(index)[0]
        return _CAPABILITY[index] >= 9
    return mode == "on"


_CAPABILITY: dict[int, int] = {}


def layout(
    a_PK: torch.Tensor, b_EKN: torch.Tensor, b2_EKN: torch.Tensor | None, out: torch.Tensor
) -> tuple[torch.Tensor, bool] | None:
    """(the weight as one 2-D tensor, whether it is K-major) where the TMA kernel takes these operands, else None:
    2-byte floats (`out` too: a wider one would not fit the kernel's staging in shared memory), `a` rows of KD
    contiguous elements, the weight one contiguous tensor `[E, N, KD]` or `[E, KD, N]` (not gate and up kept apart:
    a joined weight comes as one), every operand 16-byte aligned where its storage starts (torch's allocations
    are). Shapes, strides and offsets only, so torch.compile traces it."""
    if b2_EKN is not None:
        return None
    num_experts, kd, n = b_EKN.shape
    if a_PK.dtype not in (torch.bfloat16, torch.float16) or b_EKN.dtype != a_PK.dtype or out.dtype != a_PK.dtype:
        return None
    if a_PK.shape[1] != kd or a_PK.stride() != (kd, 1) or out.stride(1) != 1 or kd % 8 or n % 8:
        return None
    if any(t.storage_offset() * t.element_size() % 16 for t in (a_PK, b_EKN)):
        return None
    if b_EKN.stride() == (n * kd, 1, kd):  # [E, N, KD] storage read transposed
        return torch.as_strided(b_EKN, (num_experts * n, kd), (kd, 1)), True
    if b_EKN.stride() == (kd * n, n, 1):
        return torch.as_strided(b_EKN, (num_experts * kd, n), (n, 1)), False
    return None


def gemm_scatter_tma(
    a_PK: torch.Tensor,
    b_2d: torch.Tensor,
    k_major: bool,
    pair_P: torch.Tensor,
    offsets_E1: torch.Tensor,
    num_experts: int,
    n: int,
    out: torch.Tensor,
    cfg: TileConfig,
    programs: int,
    e_pow2: int,
) -> torch.Tensor:
    """`out[pair] = a[p] @ b[e]` through descriptors (`layout` gave `b_2d`, `k_major`); `programs` persistent
    programs with `cfg`'s tiles."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    kd = a_PK.shape[1]
    a_desc = TensorDescriptor.from_tensor(a_PK, [cfg.block_m, cfg.block_k])
    b_block = [cfg.block_n, cfg.block_k] if k_major else [cfg.block_k, cfg.block_n]
    b_desc = TensorDescriptor.from_tensor(b_2d, b_block)
    _gemm_scatter_tma_kernel[(programs,)](
        a_desc,
        b_desc,
        pair_P,
        offsets_E1,
        out,
        num_experts,
        n,
        kd,
        n if k_major else kd,
        out.stride(0),
        B_KMAJOR=k_major,
        UPCAST=interpreting(),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        E_POW2=e_pow2,
        FLATTEN=cfg.flatten,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


__all__ = ["use_tma", "layout", "gemm_scatter_tma"]
