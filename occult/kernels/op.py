"""`expert_mlp` on Triton kernels: the autograd op tying pairs, GEMMs, combine and backward.

Forward (no host sync; every size the host uses is a shape):
  1. `pairs.build_pairs`: (row, slot) entries sorted by local expert, `[E+1]` offsets.
  2. `grouped_gemm.gather_gemm_swiglu`: hg_p = g_p * silu(x_r gate[e]^T) * (x_r up[e]^T).
     (Training on Hopper in bf16 with no padding slot, `dense`, setting `gemm1`: `grouped_mm.gemm1_grouped`
     instead, x rows copied into pair order, `torch._grouped_mm`, one elementwise pass; the copy is kept
     for the backward.)
  3. `grouped_gemm.gemm_scatter`: g_p o_p = down[e] hg_p, stored at the pair's flat index r*K+k.
  4. `combine.combine_rows`: y_r = sum_k g o (fp32, deterministic), cast to x's dtype.
  (`atomic=True` fuses 3-4: fp32 atomic adds into one row per received row.)
Backward: `grouped_gemm_backward.swiglu_dgrad` (d[a;b] and the gate gradient),
`gemm_scatter` + `combine_rows` (input gradient), the two weight gradients: on Hopper in bf16
`grouped_mm.gather_pair_rows` + `torch._grouped_mm`, else `grouped_gemm_backward.weight_grad`
(there, by default, `grouped_mm.swiglu_dgrad_grouped` replaces `swiglu_dgrad`: setting `dgrad1`).

Gate and up weights come as one `[E, 2F, H]` tensor or kept apart (`(gate, up)`, TorchTitan's `w1`, `w3`): GEMM 1
reads them through two pointers, the input gradient's GEMM over both (`gemm_scatter(..., b2_EKN=up)`), and each
gets its own gradient from its half of `d[a;b]`'s columns (`_weight_grads`); no joined copy is made but where the
kernel that runs takes only the joined weight (`_join_first`).

Intermediates are sized by the bound R*K (P, the number of valid pairs, is known only on the
device): `hg` [R*K, F], `[a;b]` and `d[a;b]` [R*K, 2F], pair outputs [R*K, H]; only the first P
rows (resp. the valid flat indices) are touched. Callers that pad `slots` to K = top_k while
rows hold far fewer local experts pay that in memory (not in time): pass the smallest K.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from occult import settings
from occult.kernels import deferred_wgrad
from occult.kernels.combine import combine_rows
from occult.kernels.grouped_gemm import gather_gemm_swiglu, gemm_scatter
from occult.kernels.grouped_gemm_backward import swiglu_dgrad, weight_grad
from occult.kernels.grouped_mm import (
    gather_pair_rows,
    gemm1_grouped,
    grouped_weight_grad,
    swiglu_dgrad_grouped,
    use_grouped_mm,
)
from occult.kernels.pairs import build_pairs
from occult.kernels.small_batch import expert_mlp_small_batch, use_small_batch

# The SwiGLU dgrad (setting `dgrad1`, docs/settings.md): torch._grouped_mm + one elementwise pass
# ("auto": on Hopper in bf16; `u` rounded to bf16 as the torch reference's autograd does) or the
# fused Triton kernel ("triton", fp32 `u`; the path everywhere else). "auto" is the default because
# it is faster at every benchmark shape and as exact: see docs/kernels.md, "Backward on one H200".


def _check(x_RH, slots_RK, gates_RK, gate_up_EFH, up_EFH, down_EHF) -> None:
    if x_RH.dim() != 2 or slots_RK.dim() != 2 or gates_RK.shape != slots_RK.shape:
        raise ValueError(
            f"expected x [R, H], slots [R, K], gates [R, K]; got {tuple(x_RH.shape)}, "
            f"{tuple(slots_RK.shape)}, {tuple(gates_RK.shape)}"
        )
    if slots_RK.shape[0] != x_RH.shape[0]:
        raise ValueError(f"slots has {slots_RK.shape[0]} rows, x has {x_RH.shape[0]}")
    if slots_RK.dtype.is_floating_point or slots_RK.dtype == torch.bool:
        raise ValueError(f"slots must be an integer tensor, got {slots_RK.dtype}")
    if up_EFH is not None:  # (gate, up) kept apart
        e, f, h = gate_up_EFH.shape
        if up_EFH.shape != gate_up_EFH.shape or h != x_RH.shape[1] or down_EHF.shape != (e, h, f):
            raise ValueError(
                f"weights do not match: x [R, {x_RH.shape[1]}], gate {tuple(gate_up_EFH.shape)}, up "
                f"{tuple(up_EFH.shape)}, down {tuple(down_EHF.shape)} (want gate and up [E, F, H], down [E, H, F])"
            )
        return
    e, two_f, h = gate_up_EFH.shape
    if h != x_RH.shape[1] or two_f % 2 or down_EHF.shape != (e, h, two_f // 2):
        raise ValueError(
            f"weights do not match: x [R, {x_RH.shape[1]}], gate_up {tuple(gate_up_EFH.shape)}, "
            f"down {tuple(down_EHF.shape)} (want gate_up [E, 2F, H], down [E, H, F])"
        )


def _gemm1_grouped(x: torch.Tensor, ffn: int, dense: bool) -> bool:
    """Whether a training forward's GEMM 1 goes through `grouped_mm.gemm1_grouped` (setting `gemm1`): forced
    by `grouped_mm`; under `auto` only where `dense` (no padding slot), because the x-row copy it keeps for
    the backward is sized by R*K: with expert-parallel rows padded to K slots it would hold several times
    the real pairs' bytes (docs/kernels.md)."""
    if not use_grouped_mm(x, x.shape[1], ffn, which="gemm1"):
        return False
    return dense or settings.current().gemm1 == "grouped_mm"


def _halves(w1: torch.Tensor, w3: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) weights `[E, F, H]`: `w1` and `w3` where kept apart, else views of `w1`'s halves."""
    return (w1, w3) if w3 is not None else w1.chunk(2, dim=1)


def _forward(x, slots, gates, w1, w3, w2, atomic: bool, save: bool, dense: bool = False):
    """`w1`: gate_up `[E, 2F, H]` with `w3` None, or the gate weight `[E, F, H]` with `w3` the up weight."""
    num_rows, hidden = x.shape
    num_slots = slots.shape[1]
    num_experts = w1.shape[0]
    if num_rows * num_slots == 0 or num_experts == 0:
        return x.new_zeros((num_rows, hidden)), None
    pair, offsets = build_pairs(slots, num_experts)
    x_sorted = None
    if save and w3 is None and _gemm1_grouped(x, w1.shape[1] // 2, dense):
        hg, ab, x_sorted = gemm1_grouped(x, pair, offsets, w1, gates.view(-1), num_slots)
    else:
        hg, ab = gather_gemm_swiglu(x, pair, offsets, *_halves(w1, w3), gates.view(-1), num_slots, save_ab=save)
    down_EFH = w2.transpose(1, 2)  # B[k = f, n = h] view, no copy
    if atomic:
        y32 = torch.zeros((num_rows, hidden), device=x.device, dtype=torch.float32)
        gemm_scatter(hg, pair, offsets, down_EFH, num_slots, y32, atomic=True)
        y = y32.to(x.dtype)
    else:
        o = x.new_empty((num_rows * num_slots, hidden))
        gemm_scatter(hg, pair, offsets, down_EFH, num_slots, o)
        y = combine_rows(o, slots, num_experts, x.dtype)
    return y, ((pair, offsets, hg, ab, x_sorted) if save else None)


class _Saved(NamedTuple):
    """What the op's forward keeps for its backward."""

    x: torch.Tensor
    slots: torch.Tensor
    gates: torch.Tensor
    w1: torch.Tensor
    w3: torch.Tensor | None
    w2: torch.Tensor
    pair: torch.Tensor
    offsets: torch.Tensor
    hg: torch.Tensor
    ab: torch.Tensor | None
    x_sorted: torch.Tensor | None


class _ExpertMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, slots, gates, w1, w3, w2, atomic, dense):
        y, saved = _forward(x, slots, gates, w1, w3, w2, atomic, save=True, dense=dense)
        ctx.atomic = atomic
        ctx.empty = saved is None
        if saved is None:
            ctx.save_for_backward(x, slots, gates, w1, w3, w2)
        else:
            if not ctx.needs_input_grad[3]:  # the x-row copy (gemm1) serves grad gate_up only: not kept
                saved = (*saved[:-1], None)
            ctx.save_for_backward(x, slots, gates, w1, w3, w2, *saved)
        return y

    @staticmethod
    def backward(ctx, dy):
        need_x, _, need_g, *need_w = ctx.needs_input_grad[:6]  # need_w: w1, w3, w2
        if ctx.empty:
            x, slots, gates, *weights = ctx.saved_tensors
            zeros = [torch.zeros_like(w) if w is not None and need else None for w, need in zip(weights, need_w)]
            return (
                torch.zeros_like(x) if need_x else None,
                None,
                torch.zeros_like(gates) if need_g else None,
                *zeros,
                None,
                None,
            )
        s = _Saved(*ctx.saved_tensors)
        dy = dy.to(s.x.dtype).contiguous()
        dx, dgates, dab, dy_rows, rows_buf = _input_grads(s, dy, ctx.atomic, need_x, need_g, need_w[0] or need_w[1])
        return dx, None, dgates, *_weight_grads(s, dy, dab, dy_rows, rows_buf, *need_w), None, None


class _DeferredExpertMLPFunction(_ExpertMLPFunction):
    """The op with its weight gradients deferred (`OCCULT_DEFER_WGRAD`, `occult.kernels.deferred_wgrad`): the
    backward returns the input and gate gradients, and the weight GEMMs run on a side stream, added to
    `leaves` (the weights as the caller holds them, before the cast to x's dtype) at the next deferral or the
    backward's end."""

    @staticmethod
    def forward(ctx, x, slots, gates, w1, w3, w2, atomic, dense, leaves):
        ctx.leaves = leaves
        return _ExpertMLPFunction.forward(ctx, x, slots, gates, w1, w3, w2, atomic, dense)

    @staticmethod
    def backward(ctx, dy):
        need_x, _, need_g, *need_w = ctx.needs_input_grad[:6]  # need_w: w1, w3, w2 (leaves: the same three)
        leaves = tuple(leaf if need else None for leaf, need in zip(ctx.leaves, need_w))
        if ctx.empty or not deferred_wgrad.deferrable(leaves):
            return (*_ExpertMLPFunction.backward(ctx, dy), None)
        s = _Saved(*ctx.saved_tensors)
        dy = dy.to(s.x.dtype).contiguous()
        dx, dgates, dab, dy_rows, rows_buf = _input_grads(s, dy, ctx.atomic, need_x, need_g, need_w[0] or need_w[1])
        held = (*s, dy, dab, dy_rows, rows_buf)  # (what the weight GEMMs read, alive until they are joined)
        deferred_wgrad.defer(lambda: _weight_grads(s, dy, dab, dy_rows, rows_buf, *need_w), leaves, held, s.x.device)
        return dx, None, dgates, None, None, None, None, None, None


def _input_grads(s: _Saved, dy: torch.Tensor, atomic: bool, need_x: bool, need_g: bool, need_w1: bool):
    """The input and gate gradients: (dx, dgates, dab, dy_rows, rows_buf), the last three for `_weight_grads`
    (the SwiGLU dgrad, dy gathered into sorted-pair order where the dgrad ran on torch._grouped_mm, the pair
    buffer dx was summed from).

    torch._grouped_mm on Hopper/bf16 (kernels.grouped_mm): the weight gradients (setting wgrad), and
    optionally the SwiGLU dgrad (setting dgrad1); their row-indexed operands are gathered into sorted-pair
    order first, [R*K, H] each: dy once (first if the dgrad needs it), x into `rows_buf` (the dx pair buffer
    once it is consumed; dy goes there too when gathered last) unless the forward kept its copy (`x_sorted`,
    setting gemm1), which is never overwritten."""
    x, slots, gates, w1, w3, w2, pair, offsets = s.x, s.slots, s.gates, s.w1, s.w3, s.w2, s.pair, s.offsets
    num_rows, num_slots = slots.shape
    num_experts = w1.shape[0]
    gates_flat = gates.view(-1)
    hidden, ffn = x.shape[1], w2.shape[2]
    dx = dgates = dab = dy_rows = rows_buf = None
    if not (need_x or need_g or need_w1):
        return dx, dgates, dab, dy_rows, rows_buf
    if use_grouped_mm(x, hidden, ffn, which="dgrad1"):
        dy_rows = gather_pair_rows(dy, pair, offsets, num_slots)
        dab, dg = swiglu_dgrad_grouped(dy_rows, pair, offsets, w2, s.ab, gates_flat)
    else:
        dab, dg = swiglu_dgrad(dy, pair, offsets, w2, s.ab, gates_flat, num_slots)
    if need_g:
        dgates = dg.view(num_rows, num_slots).to(gates.dtype)
    if need_x:
        if atomic:
            dx32 = torch.zeros(x.shape, device=x.device, dtype=torch.float32)
            gemm_scatter(dab, pair, offsets, w1, num_slots, dx32, atomic=True, b2_EKN=w3)
            dx = dx32.to(x.dtype)
        else:
            rows_buf = x.new_empty((num_rows * num_slots, hidden))
            gemm_scatter(dab, pair, offsets, w1, num_slots, rows_buf, config_name="dgrad2", b2_EKN=w3)
            dx = combine_rows(rows_buf, slots, num_experts, x.dtype)
    return dx, dgates, dab, dy_rows, rows_buf


def _weight_grads(s: _Saved, dy, dab, dy_rows, rows_buf, need_w1: bool, need_w3: bool, need_w2: bool):
    """(d w1, d w3, d down) from what `_input_grads` left (`dab` for the first two): d gate_up and None where `w3` is
    None, else d gate and d up, each its own `[E, F, H]` tensor (from the halves of `dab`'s columns)."""
    x, pair, offsets = s.x, s.pair, s.offsets
    num_slots, ffn = s.slots.shape[1], s.w2.shape[2]
    gmm = (need_w1 or need_w3 or need_w2) and use_grouped_mm(x, x.shape[1], ffn)
    x_sorted = s.x_sorted
    if gmm and (need_w1 or need_w3) and x_sorted is None:  # (the forward's GEMM 1 copied x rows on _grouped_mm)
        x_sorted = rows_buf = gather_pair_rows(x, pair, offsets, num_slots, out=rows_buf)
    parts = [(dab, s.w1, need_w1)] if s.w3 is None else [(dab[:, :ffn], s.w1, need_w1), (dab[:, ffn:], s.w3, need_w3)]
    grads = [None, None]
    for i, (d_ab, w, need) in enumerate(parts):
        if need and gmm:
            grads[i] = grouped_weight_grad(d_ab, x_sorted, offsets)
        elif need:
            grads[i] = weight_grad(
                d_ab, x, pair, offsets, num_slots, torch.empty_like(w), a_gather=False, b_gather=True
            )
    dw2 = None
    if need_w2 and gmm:
        if dy_rows is None:
            dy_rows = gather_pair_rows(dy, pair, offsets, num_slots, out=rows_buf)
        dw2 = grouped_weight_grad(dy_rows, s.hg, offsets)
    elif need_w2:
        dw2 = weight_grad(dy, s.hg, pair, offsets, num_slots, torch.empty_like(s.w2), a_gather=True, b_gather=False)
    return grads[0], grads[1], dw2


def expert_mlp(
    x_RH: torch.Tensor,
    slots_RK: torch.Tensor,
    gates_RK: torch.Tensor,
    gate_up_proj_EFH: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    down_proj_EHF: torch.Tensor,
    *,
    atomic: bool | None = None,
    dense: bool = False,
) -> torch.Tensor:
    """`y[r] = sum_k gates[r,k] * down[s] @ (silu(gate[s] @ x[r]) * up[s] @ x[r])`, s = slots[r,k].

    The contract of `occult.moe.experts.expert_mlp_reference` (docs/design.md): slot -1 is padding
    (slots outside [0, E) are treated as padding too: nothing is checked on the device), fp32
    accumulation, output in x's dtype, differentiable w.r.t. x, gates, gate_up and down.
    `gate_up_proj_EFH`: `[E, 2F, H]` (each expert's gate rows, then its up rows), or a pair (gate, up) of
    `[E, F, H]` weights kept apart (TorchTitan's `w1`, `w3`): the kernels read both where they are, and their
    gradients come back as two tensors (no joined copy, no strided gradient halves); only the `_grouped_mm` GEMM 1
    and the decode kernels join them first (`_join_first`).
    Weights are used in x's dtype. `atomic` (default: setting `scatter` == "atomic", env `OCCULT_SCATTER`) replaces the
    deterministic row combine by fp32 atomic adds in GEMM 2's epilogue. Without autograd and for
    `R*K <= small_batch.MAX_PAIRS` (decode) the `small_batch` kernels run instead (`atomic` unused).
    `dense`: no slot is padding (one rank's rows); a training call may then take the `_grouped_mm` GEMM 1
    under the setting's `auto` (`_gemm1_grouped`).
    """
    gate_EFH, up_EFH = gate_up_proj_EFH if isinstance(gate_up_proj_EFH, tuple) else (gate_up_proj_EFH, None)
    _check(x_RH, slots_RK, gates_RK, gate_EFH, up_EFH, down_proj_EHF)
    if atomic is None:
        atomic = settings.current().scatter == "atomic"
    x = x_RH.contiguous()
    slots = slots_RK.contiguous()
    gates = gates_RK.contiguous()
    w1, w2 = gate_EFH.to(x.dtype), down_proj_EHF.to(x.dtype)
    w3 = None if up_EFH is None else up_EFH.to(x.dtype)
    training = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, gates, w1, w3, w2))
    if w3 is not None and _join_first(x, slots, w2.shape[2], training, dense):
        w1, w3 = torch.cat([w1, w3], dim=1), None  # (autograd splits its gradient)
        gate_EFH, up_EFH = w1, None
    elif w3 is not None and w1.stride() != w3.stride():  # (the kernels read both with one set of strides)
        w1, w3 = w1.contiguous(), w3.contiguous()
    if training:
        if settings.current().defer_wgrad and not torch.compiler.is_compiling():
            leaves = (gate_EFH, up_EFH, down_proj_EHF)  # their gradients are added to these (deferred_wgrad)
            return _DeferredExpertMLPFunction.apply(x, slots, gates, w1, w3, w2, bool(atomic), bool(dense), leaves)
        return _ExpertMLPFunction.apply(x, slots, gates, w1, w3, w2, bool(atomic), bool(dense))
    if use_small_batch(slots.numel()):  # decode-sized inference: kernels.small_batch
        return expert_mlp_small_batch(x, slots, gates, w1, w2)
    return _forward(x, slots, gates, w1, w3, w2, bool(atomic), save=False)[0]


def _join_first(x: torch.Tensor, slots: torch.Tensor, ffn: int, training: bool, dense: bool) -> bool:
    """Whether gate and up weights kept apart are joined into one `[E, 2F, H]` copy before the kernels: where the
    kernel that runs takes only the joined weight (the `_grouped_mm` GEMM 1 of a training call, decode's)."""
    if training:
        return _gemm1_grouped(x, ffn, dense)
    return use_small_batch(slots.numel())
