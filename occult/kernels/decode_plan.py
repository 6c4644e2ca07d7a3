"""One-launch dispatch plans for batches one program can hold (a decode step).

At batch 1 a layer's expert-parallel work is a chain of tiny kernels; each plan here replaces
about a dozen of them with one launch, the unused rows' fill included.

`routed_plan_rows`: the whole plan of either kind (dedup, or with `pairs` the standard one: row
layout as `occult.kernels.plan` builds it for any batch) and the routing status
(`occult.moe.counts.routing_status`: ids clamped into range, 2 where any was out of it, else 1 for
NaN/inf gates). `routed_slots` is the one-rank case: the local slots of the clamped ids and the
status. `fixed_plan_rows`: the sync-free (fixed-capacity) plans of either kind, ids clamped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from occult.kernels import config as _config  # noqa: F401  (applies the interpreter's loop-bound fix)


@triton.jit
def _clamped_ids(ids_ptr, num_tokens, top_k, num_experts, BLOCK_T: tl.constexpr, K_POW2: tl.constexpr):
    """A batch's ids [T, K] as given and clamped into [0, E), with their token and column indices."""
    t = tl.arange(0, BLOCK_T)
    j = tl.arange(0, K_POW2)
    in_T = t < num_tokens
    valid_TK = in_T[:, None] & (j[None, :] < top_k)
    raw_TK = tl.load(ids_ptr + t[:, None] * top_k + j[None, :], mask=valid_TK, other=0)
    return t, j, in_T, valid_TK, raw_TK, tl.minimum(tl.maximum(raw_TK, 0), num_experts - 1)


@triton.jit
def _checked_ids(
    ids_ptr, w_ptr, status_ptr, num_tokens, top_k, num_experts, BLOCK_T: tl.constexpr, K_POW2: tl.constexpr
):
    """A batch's ids [T, K] clamped into [0, E), and its routing status stored (2 ids out of range,
    else 1 NaN/inf gates, else 0; gates checked in fp32)."""
    t, j, in_T, valid_TK, raw_TK, ids_TK = _clamped_ids(ids_ptr, num_tokens, top_k, num_experts, BLOCK_T, K_POW2)
    w_TK = tl.load(w_ptr + t[:, None] * top_k + j[None, :], mask=valid_TK, other=0.0).to(tl.float32)
    bad_ids = tl.max(tl.max((valid_TK & (raw_TK != ids_TK)).to(tl.int32), axis=1), axis=0)
    bad_w = tl.max(tl.max((valid_TK & ((w_TK - w_TK) != 0)).to(tl.int32), axis=1), axis=0)  # NaN or inf
    tl.store(status_ptr, tl.where(bad_ids > 0, 2, bad_w).to(tl.int64))
    return t, j, in_T, valid_TK, ids_TK


@triton.jit
def _routed_slots_kernel(
    ids_ptr,
    w_ptr,
    slot_of_ptr,
    slots_ptr,
    status_ptr,
    num_tokens,
    top_k,
    num_experts,
    BLOCK_T: tl.constexpr,
    K_POW2: tl.constexpr,
):
    t, j, in_T, valid_TK, ids_TK = _checked_ids(
        ids_ptr, w_ptr, status_ptr, num_tokens, top_k, num_experts, BLOCK_T, K_POW2
    )
    tl.store(slots_ptr + t[:, None] * top_k + j[None, :], tl.load(slot_of_ptr + ids_TK, mask=valid_TK), mask=valid_TK)


@triton.jit
def _routed_plan_kernel(
    ids_ptr,
    w_ptr,
    device_of_ptr,
    slot_of_ptr,
    rows_ptr,
    row_TJ_ptr,
    counts_ptr,
    status_ptr,
    num_tokens,
    top_k,
    pair_k,
    num_devices,
    num_experts,
    capacity,
    row_stride,
    BLOCK_T: tl.constexpr,
    K_POW2: tl.constexpr,
    D_POW2: tl.constexpr,
    C_POW2: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PAIRS: tl.constexpr,
):
    t, j, in_T, valid_TK, ids_TK = _checked_ids(
        ids_ptr, w_ptr, status_ptr, num_tokens, top_k, num_experts, BLOCK_T, K_POW2
    )
    dev_TK = tl.load(device_of_ptr + ids_TK, mask=valid_TK, other=-1)
    d = tl.arange(0, D_POW2)
    d_ok = d < num_devices
    used_TD = tl.max((dev_TK[:, :, None] == d[None, None, :]).to(tl.int32), axis=1)
    count_D = tl.sum(used_TD, axis=0)
    tl.store(counts_ptr + d, count_D.to(tl.int64), mask=d_ok)
    row_TD = (tl.cumsum(count_D, axis=0) - count_D)[None, :] + tl.cumsum(used_TD, axis=0) - used_TD
    live_TD = (used_TD > 0) & in_T[:, None] & d_ok[None, :]
    if PAIRS:  # one row per pair: its row on its one device
        tl.store(row_TJ_ptr + t, tl.max(tl.where(live_TD, row_TD, -1), axis=1), mask=in_T)
        token_T = t // pair_k
    else:
        tl.store(
            row_TJ_ptr + t[:, None] * num_devices + d[None, :],
            tl.where(live_TD, row_TD, -1),
            mask=in_T[:, None] & d_ok[None, :],
        )
        token_T = t
    base_TD = row_TD.to(tl.int64) * row_stride
    tl.store(rows_ptr + base_TD, token_T.to(tl.int64)[:, None] + 0 * base_TD, mask=live_TD)
    slot_TK = tl.load(slot_of_ptr + ids_TK, mask=dev_TK >= 0, other=-1)
    hit_TDK = dev_TK[:, None, :] == d[None, :, None]
    at_TDK = base_TD[:, :, None] + 1 + j[None, None, :]
    mask_TDK = live_TD[:, :, None] & (j[None, None, :] < top_k)
    tl.store(
        rows_ptr + at_TDK,
        tl.where(hit_TDK, (t[:, None, None] * top_k + j[None, None, :]).to(tl.int64), -1),
        mask=mask_TDK,
    )
    tl.store(rows_ptr + at_TDK + top_k, tl.where(hit_TDK, slot_TK[:, None, :].to(tl.int64), -1), mask=mask_TDK)
    total = tl.sum(count_D, axis=0)
    c = tl.arange(0, C_POW2)
    for r0 in range(0, capacity, BLOCK_R):  # the rows past the true count: all -1
        r = r0 + tl.arange(0, BLOCK_R)
        tl.store(
            rows_ptr + r.to(tl.int64)[:, None] * row_stride + c[None, :],
            tl.full((BLOCK_R, C_POW2), -1, tl.int64),
            mask=((r >= total) & (r < capacity))[:, None] & (c < row_stride)[None, :],
        )


ROUTED_TILE = 8192  # [T, D, K] elements one program of `_routed_plan_kernel` may hold


def routed_plan_fits(num_tokens: int, num_devices: int, top_k: int, pairs: bool) -> bool:
    """Whether one program plans this batch (`routed_plan_rows`): a decode-sized [T, D, K] tile."""
    rows, k = (num_tokens * top_k, 1) if pairs else (num_tokens, top_k)
    return 0 < rows and triton.next_power_of_2(rows) * _pow2(num_devices) * _pow2(k) <= ROUTED_TILE


def _pow2(n: int) -> int:
    return max(2, triton.next_power_of_2(n))


def routed_plan_rows(
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    expert_device_E: torch.Tensor,
    expert_slot_E: torch.Tensor,
    num_devices: int,
    pairs: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token_P, entry_PK, slot_PK, send_counts_D, row_TJ, status) in one launch (module docstring):
    the dedup plan, or with `pairs` the standard one, of ids clamped into range, as `dedup_plan_rows`
    and `standard_plan_rows` give them; status int64 0-dim. Only where `routed_plan_fits`, for fp16,
    bf16 or fp32 gates (checked in fp32: a finite fp64 gate could overflow it)."""
    num_tokens, top_k = ids_TK.shape
    dev = ids_TK.device
    if pairs:
        rows_n, k, capacity = num_tokens * top_k, 1, num_tokens * top_k
    else:
        rows_n, k, capacity = num_tokens, top_k, num_tokens * min(top_k, num_devices)
    rows = torch.empty((capacity, 1 + 2 * k), dtype=torch.int64, device=dev)
    row_TJ = torch.empty((num_tokens, top_k if pairs else num_devices), dtype=torch.int64, device=dev)
    counts = torch.empty(num_devices, dtype=torch.int64, device=dev)
    status = torch.empty((), dtype=torch.int64, device=dev)
    _routed_plan_kernel[(1,)](
        ids_TK.contiguous(),
        weights_TK.contiguous(),
        expert_device_E.contiguous(),
        expert_slot_E.contiguous(),
        rows,
        row_TJ,
        counts,
        status,
        rows_n,
        k,
        top_k,
        num_devices,
        expert_device_E.shape[0],
        capacity,
        rows.stride(0),
        BLOCK_T=triton.next_power_of_2(rows_n),
        K_POW2=_pow2(k),
        D_POW2=_pow2(num_devices),
        C_POW2=triton.next_power_of_2(1 + 2 * k),
        BLOCK_R=64,
        PAIRS=pairs,
        num_warps=4,
    )
    return rows[:, 0], rows[:, 1 : 1 + k], rows[:, 1 + k :], counts, row_TJ, status


def routed_slots(
    ids_TK: torch.Tensor, weights_TK: torch.Tensor, expert_slot_E: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(local slots of the clamped ids [T, K] int64, routing status) in one launch: the one-rank
    dispatch's share of `routed_plan_rows` (every expert local). Only where `routed_plan_fits(T, 1, K)`."""
    num_tokens, top_k = ids_TK.shape
    slots = torch.empty((num_tokens, top_k), dtype=torch.int64, device=ids_TK.device)
    status = torch.empty((), dtype=torch.int64, device=ids_TK.device)
    _routed_slots_kernel[(1,)](
        ids_TK.contiguous(),
        weights_TK.contiguous(),
        expert_slot_E.contiguous(),
        slots,
        status,
        num_tokens,
        top_k,
        expert_slot_E.shape[0],
        BLOCK_T=triton.next_power_of_2(num_tokens),
        K_POW2=_pow2(top_k),
        num_warps=4,
    )
    return slots, status


@triton.jit
def _fixed_plan_kernel(
    ids_ptr,
    device_of_ptr,
    slot_of_ptr,
    rows_ptr,
    row_TJ_ptr,
    counts_ptr,
    num_tokens,
    top_k,
    num_devices,
    num_experts,
    per_device,
    row_stride,
    BLOCK_T: tl.constexpr,
    K_POW2: tl.constexpr,
    D_POW2: tl.constexpr,
    J_POW2: tl.constexpr,
    STANDARD: tl.constexpr,
):
    """The fixed-capacity plans of `occult.moe.plan.static_dedup_plan` / `static_standard_plan`, ids clamped
    (sync-free: nothing is reported); every row written once (no fill, no ordering between stores)."""
    t, j, in_T, valid_TK, _, ids_TK = _clamped_ids(ids_ptr, num_tokens, top_k, num_experts, BLOCK_T, K_POW2)
    dev_TK = tl.load(device_of_ptr + ids_TK, mask=valid_TK, other=-1)
    slot_TK = tl.load(slot_of_ptr + ids_TK, mask=valid_TK, other=-1)
    d = tl.arange(0, D_POW2)
    d_ok = d < num_devices
    entry_TK = (t[:, None] * top_k + j[None, :]).to(tl.int64)
    if STANDARD:  # row d*C + t*J + i: token t's i-th expert on device d (C = T*J)
        earlier_TKK = (j[None, None, :] < j[None, :, None]) & (dev_TK[:, None, :] == dev_TK[:, :, None])
        pos_TK = tl.sum(earlier_TKK.to(tl.int32), axis=2)
        capacity = num_tokens * per_device
        # (an entry past J only comes from ids clamped onto an id the token already has: dropped, as
        # sync-free reports nothing, rather than pointing into another token's rows)
        tl.store(
            row_TJ_ptr + t[:, None] * top_k + j[None, :],
            tl.where(pos_TK < per_device, dev_TK.to(tl.int64) * capacity + t[:, None] * per_device + pos_TK, -1),
            mask=valid_TK,
        )
        m = tl.arange(0, D_POW2 * J_POW2)  # (device, i) pairs on one axis: tiles stay [T, M, K]
        d_M, i_M = m // J_POW2, m % J_POW2
        match_TMK = (
            (dev_TK[:, None, :] == d_M[None, :, None])
            & (pos_TK[:, None, :] == i_M[None, :, None])
            & valid_TK[:, None, :]
        )
        entry_TM = tl.max(tl.where(match_TMK, entry_TK[:, None, :], -1), axis=2)
        slot_TM = tl.max(tl.where(match_TMK, slot_TK[:, None, :].to(tl.int64), -1), axis=2)
        at_TM = (d_M[None, :].to(tl.int64) * capacity + t[:, None] * per_device + i_M[None, :]) * row_stride
        mask_TM = in_T[:, None] & (d_M < num_devices)[None, :] & (i_M < per_device)[None, :]
        tl.store(rows_ptr + at_TM, t[:, None].to(tl.int64) + 0 * at_TM, mask=mask_TM)
        tl.store(rows_ptr + at_TM + 1, entry_TM, mask=mask_TM)
        tl.store(rows_ptr + at_TM + 2, slot_TM, mask=mask_TM)
        tl.store(counts_ptr + d, (capacity + 0 * d).to(tl.int64), mask=d_ok)
    else:  # row d*T + t: token t's copy for device d, its experts there (all -1 when none)
        row_TD = d[None, :].to(tl.int64) * num_tokens + t[:, None]
        mask_TD = in_T[:, None] & d_ok[None, :]
        hit_TDK = dev_TK[:, None, :] == d[None, :, None]
        tl.store(
            row_TJ_ptr + t[:, None] * num_devices + d[None, :],
            tl.where(tl.max(hit_TDK.to(tl.int32), axis=2) > 0, row_TD, -1),
            mask=mask_TD,
        )
        at_TDK = row_TD[:, :, None] * row_stride + 1 + j[None, None, :]
        mask_TDK = mask_TD[:, :, None] & (j < top_k)[None, None, :]
        tl.store(rows_ptr + row_TD * row_stride, t[:, None].to(tl.int64) + 0 * row_TD, mask=mask_TD)
        tl.store(rows_ptr + at_TDK, tl.where(hit_TDK, entry_TK[:, None, :], -1), mask=mask_TDK)
        tl.store(rows_ptr + at_TDK + top_k, tl.where(hit_TDK, slot_TK[:, None, :].to(tl.int64), -1), mask=mask_TDK)
        tl.store(counts_ptr + d, (num_tokens + 0 * d).to(tl.int64), mask=d_ok)


def fixed_plan_fits(num_tokens: int, num_devices: int, top_k: int, per_device: int | None) -> bool:
    """Whether one program builds this fixed-capacity plan (`fixed_plan_rows`; `per_device` = J for the
    standard plan, None for dedup): a decode-sized [T, D, (J,) K] tile."""
    tile = triton.next_power_of_2(max(num_tokens, 1)) * _pow2(num_devices) * _pow2(top_k)
    return 0 < num_tokens and tile * (_pow2(per_device) if per_device else 1) <= ROUTED_TILE


def fixed_plan_rows(
    ids_TK: torch.Tensor,
    expert_device_E: torch.Tensor,
    expert_slot_E: torch.Tensor,
    num_devices: int,
    per_device: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token_P, entry_PK, slot_PK, send_counts_D, row_TJ) of the fixed-capacity dedup plan, or with
    `per_device` = J = min(k, E/D) the standard one, as `static_dedup_plan` / `static_standard_plan` give
    them, of ids clamped into range, in one launch. Only where `fixed_plan_fits`."""
    num_tokens, top_k = ids_TK.shape
    dev = ids_TK.device
    k = 1 if per_device else top_k
    num_rows = num_devices * num_tokens * (per_device or 1)
    rows = torch.empty((num_rows, 1 + 2 * k), dtype=torch.int64, device=dev)
    row_TJ = torch.empty((num_tokens, top_k if per_device else num_devices), dtype=torch.int64, device=dev)
    counts = torch.empty(num_devices, dtype=torch.int64, device=dev)
    _fixed_plan_kernel[(1,)](
        ids_TK.contiguous(),
        expert_device_E.contiguous(),
        expert_slot_E.contiguous(),
        rows,
        row_TJ,
        counts,
        num_tokens,
        top_k,
        num_devices,
        expert_device_E.shape[0],
        per_device or 1,
        rows.stride(0),
        BLOCK_T=triton.next_power_of_2(num_tokens),
        K_POW2=_pow2(top_k),
        D_POW2=_pow2(num_devices),
        J_POW2=_pow2(per_device or 1),
        STANDARD=bool(per_device),
        num_warps=4,
    )
    return rows[:, 0], rows[:, 1 : 1 + k], rows[:, 1 + k :], counts, row_TJ
