"""Small-batch (decode) expert MLP: each selected expert's weights read once, no pair sort.

For inference when the number of (row, slot) entries `R*K` is small (a decode step): the
grouped-GEMM path (`op._forward`) sorts pairs (3 launches), runs persistent GEMMs with
128-row tiles that are almost empty, and combines; here three launches do everything, and the
grid is sized from bounds only (no host sync, capturable in a CUDA graph):

  1. `gate_up_kernel`, grid `(min(R*K, E), cdiv(F, BLOCK_N))`: program `(i, n)` finds the
     i-th present expert (ascending id) from a histogram of the slots in registers, gathers
     that expert's pairs (in flat order `r*K+k`, `BLOCK_M` at a time, a loop bounded by the
     expert's count) and computes `h = silu(x Wg^T) * (x Wu^T)` for one `BLOCK_N` column slice
     of the gate and of the up rows (fp32 accumulators), stored in x's dtype at the pair's
     flat index in `h [R*K, F]`. Programs whose rank has no expert do nothing. At batch 1 the
     8 experts x `F/BLOCK_N` slices fill the SMs (split along N, as vLLM's fused_moe does).
  2. `down_kernel`, grid `(min(R*K, E), cdiv(H, BLOCK_N))`: the same expert lookup,
     `o = g * (h Wd^T)` (fp32) stored at the pair's flat index in `o [R*K, H]` (fp32).
  3. `combine_kernel`: `y[r] = sum_k valid(r, k) * o[r*K+k]` in fp32 in slot order, cast once
     (deterministic, no atomics, no zero-fill; a row of padding only gets zeros).

`down_by_row=True` replaces 2+3 by one `down_rows_kernel` (grid `(R, cdiv(H, BLOCK_N))`, a
GEMV per slot, the row's sum in registers): two launches, but an expert shared by several rows
is read once per row (from L2 if lucky); see docs/kernels.md for which wins where.

Slots -1 and slots outside `[0, E)` are padding. Arithmetic: fp32 accumulation, fp32 operands
use exact ("ieee") products; `h` is rounded to x's dtype (as the torch reference rounds its
SwiGLU output), the gate is applied in fp32.
"""

from __future__ import annotations

import torch
import triton

from occult.kernels import config as _config
from occult.kernels.grouped_gemm import dot_flags
from occult.kernels.small_batch_kernels import combine_kernel, down_kernel, down_rows_kernel, gate_up_kernel

# Largest R*K for which `op.expert_mlp` takes this path in inference (0 turns it off; a module
# setting until occult.settings exists). From the H100 measurement in docs/kernels.md.
MAX_PAIRS = 512
# `down_by_row` is used for R <= this many rows (docs/kernels.md)
DOWN_BY_ROW_MAX_ROWS = 0


def use_small_batch(num_pairs: int) -> bool:
    """Whether an inference call with `num_pairs = R*K` entries takes this path."""
    return num_pairs <= MAX_PAIRS


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
    gate_up_kernel[(min(n, num_experts), triton.cdiv(ffn, cfg.block_n))](
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
    num_experts, hidden, _ = down_EHF.shape
    y_RH = torch.empty((num_rows, hidden), device=h_PF.device, dtype=out_dtype)
    if num_rows * num_slots == 0 or num_experts == 0:
        return y_RH.zero_()
    if down_by_row:
        _down_by_row(h_PF, slots_RK, gates_RK, down_EHF, y_RH)
    else:
        _combine_pair_rows(_down_pair_rows(h_PF, slots_RK, gates_RK, down_EHF), slots_RK, num_experts, y_RH)
    return y_RH


def _down_by_row(
    h_PF: torch.Tensor, slots_RK: torch.Tensor, gates_RK: torch.Tensor, down_EHF: torch.Tensor, y_RH: torch.Tensor
) -> None:
    """`y_RH[r] = sum_k g[r,k] * Wd[s] h[r*K+k]`, one launch of `down_rows_kernel`."""
    num_rows, num_slots = slots_RK.shape
    num_experts, hidden, ffn = down_EHF.shape
    cfg = _config.get("small_down_row", h_PF.dtype)
    down_rows_kernel[(num_rows, triton.cdiv(hidden, cfg.block_n))](
        h_PF,
        slots_RK,
        gates_RK,
        down_EHF,
        y_RH,
        num_slots,
        num_experts,
        hidden,
        ffn,
        down_EHF.stride(0),
        down_EHF.stride(1),
        down_EHF.stride(2),
        y_RH.stride(0),
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def _down_pair_rows(
    h_PF: torch.Tensor, slots_RK: torch.Tensor, gates_RK: torch.Tensor, down_EHF: torch.Tensor
) -> torch.Tensor:
    """`o_PH[i] = g[i] * Wd[s] h[i]` (fp32) per pair, expert-grouped: one launch of `down_kernel`."""
    n = slots_RK.numel()
    num_experts, hidden, ffn = down_EHF.shape
    upcast, prec = dot_flags(h_PF.dtype)
    o_PH = torch.empty((n, hidden), device=h_PF.device, dtype=torch.float32)
    cfg = _config.get("small_down", h_PF.dtype)
    down_kernel[(min(n, num_experts), triton.cdiv(hidden, cfg.block_n))](
        h_PF,
        slots_RK,
        gates_RK,
        down_EHF,
        o_PH,
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
    return o_PH


def _combine_pair_rows(o_PH: torch.Tensor, slots_RK: torch.Tensor, num_experts: int, y_RH: torch.Tensor) -> None:
    """`y_RH[r] = sum_k valid(r, k) * o_PH[r*K+k]` in fp32, slot order (a slot is valid in
    [0, num_experts)): one launch of `combine_kernel`."""
    num_rows, num_slots = slots_RK.shape
    hidden = y_RH.shape[1]
    cfg = _config.get("small_combine")
    block_n = min(cfg.block_n, triton.next_power_of_2(hidden))
    combine_kernel[(triton.cdiv(num_rows, cfg.block_m), triton.cdiv(hidden, block_n))](
        o_PH,
        slots_RK,
        y_RH,
        num_rows,
        num_slots,
        num_experts,
        hidden,
        y_RH.stride(0),
        BLOCK_R=cfg.block_m,
        BLOCK_N=block_n,
        num_warps=cfg.num_warps,
    )


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
