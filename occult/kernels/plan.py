"""The deduplicated dispatch plan in five launches instead of ~30 torch ops.

One MoE layer's forward is host-bound at the benchmark shapes: the host takes longer to launch
its many small ops than the GPU to run them (docs/overlap.md, "The host's share of a layer", has
the numbers). The torch version of the dedup plan
(`occult.moe.plan.dedup_plan`) is the longest chain of small ops before the layer's host sync.
This builds the same plan — rows ordered by destination device, then by token; row `r` carries
token `token[r]` and, in column j, entry `t*k + j` and its local slot when the token's j-th
expert is on that device, else -1 — as a counting sort:

  1. `_count_kernel`: per block of tokens, how many of them use each device (bucket-major);
  2. one `torch.cumsum` over the counts: every (device, block) its first row;
  3. `_place_kernel`: each (token, device) pair its row (block start + rank inside the block),
     writes the row's token, entries, slots and the token's row table `row_TJ` [T, D].

Rows past the true count (known on the host only after the count exchange) stay -1 (one fill
of one buffer that holds token, entries and slots side by side). No host synchronisation.

`standard_plan_rows` is the baseline's plan (one row per (token, expert)) from the same kernels:
each (token, expert) pair is a "token" with one expert, so the counting sort orders pairs by
destination and keeps (token, j) order inside it, as the stable sort of the torch plan does.

The one-launch plans of decode-sized batches (`routed_plan_rows`, `routed_slots`,
`fixed_plan_rows`) live in `occult.kernels.decode_plan` and are importable from here too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from occult.kernels import config as _config  # noqa: F401  (applies the interpreter's loop-bound fix)
from occult.kernels.decode_plan import (
    ROUTED_TILE,
    fixed_plan_fits,
    fixed_plan_rows,
    routed_plan_fits,
    routed_plan_rows,
    routed_slots,
)

__all__ = [  # the decode-sized plans are re-exported: every plan imports from here
    "ROUTED_TILE",
    "dedup_plan_rows",
    "fixed_plan_fits",
    "fixed_plan_rows",
    "routed_plan_fits",
    "routed_plan_rows",
    "routed_slots",
    "standard_plan_rows",
    "supported",
]


@triton.jit
def _used(
    ids_ptr, device_of_ptr, blk, num_tokens, top_k, BLOCK_T: tl.constexpr, K_POW2: tl.constexpr, D_POW2: tl.constexpr
):
    """Tokens of block `blk`: their ids' devices [T, K] (-1 padding) and used[t, d] (int32)."""
    t = blk * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.arange(0, K_POW2)
    valid_TK = (t[:, None] < num_tokens) & (j[None, :] < top_k)
    ids_TK = tl.load(ids_ptr + t[:, None] * top_k + j[None, :], mask=valid_TK, other=0)
    dev_TK = tl.load(device_of_ptr + ids_TK, mask=valid_TK, other=-1)
    d = tl.arange(0, D_POW2)
    hit_TKD = (dev_TK[:, :, None] == d[None, None, :]).to(tl.int32)
    used_TD = tl.max(hit_TKD, axis=1)
    return t, j, ids_TK, dev_TK, d, used_TD


@triton.jit
def _count_kernel(
    ids_ptr,
    device_of_ptr,
    counts_ptr,
    num_tokens,
    top_k,
    num_devices,
    num_blocks,
    BLOCK_T: tl.constexpr,
    K_POW2: tl.constexpr,
    D_POW2: tl.constexpr,
):
    blk = tl.program_id(0)
    t, j, ids_TK, dev_TK, d, used_TD = _used(ids_ptr, device_of_ptr, blk, num_tokens, top_k, BLOCK_T, K_POW2, D_POW2)
    # device-major: counts[d * num_blocks + blk], so a flat cumsum numbers rows device by device
    tl.store(counts_ptr + d * num_blocks + blk, tl.sum(used_TD, axis=0), mask=d < num_devices)


@triton.jit
def _place_kernel(
    ids_ptr,
    device_of_ptr,
    slot_of_ptr,
    counts_ptr,
    cum_ptr,
    rows_ptr,
    row_TJ_ptr,
    num_tokens,
    top_k,
    num_devices,
    num_blocks,
    row_stride,
    BLOCK_T: tl.constexpr,
    K_POW2: tl.constexpr,
    D_POW2: tl.constexpr,
):
    blk = tl.program_id(0)
    t, j, ids_TK, dev_TK, d, used_TD = _used(ids_ptr, device_of_ptr, blk, num_tokens, top_k, BLOCK_T, K_POW2, D_POW2)
    d_ok = d < num_devices
    start_D = tl.load(cum_ptr + d * num_blocks + blk, mask=d_ok, other=0) - tl.load(
        counts_ptr + d * num_blocks + blk, mask=d_ok, other=0
    )
    rank_TD = tl.cumsum(used_TD, axis=0) - used_TD  # tokens of this block before t that use d
    row_TD = start_D[None, :] + rank_TD
    in_T = t < num_tokens
    live_TD = (used_TD > 0) & in_T[:, None] & d_ok[None, :]
    tl.store(
        row_TJ_ptr + t[:, None] * num_devices + d[None, :],
        tl.where(live_TD, row_TD, -1),
        mask=in_T[:, None] & d_ok[None, :],
    )
    # a row holds [token, entries (K), slots (K)]
    base_TD = row_TD.to(tl.int64) * row_stride
    tl.store(rows_ptr + base_TD, t.to(tl.int64)[:, None] + 0 * base_TD, mask=live_TD)
    slot_TK = tl.load(slot_of_ptr + ids_TK, mask=dev_TK >= 0, other=-1)
    hit_TDK = dev_TK[:, None, :] == d[None, :, None]
    entry_TDK = tl.where(hit_TDK, (t[:, None, None] * top_k + j[None, None, :]).to(tl.int64), -1)
    slot_TDK = tl.where(hit_TDK, slot_TK[:, None, :].to(tl.int64), -1)
    at_TDK = base_TD[:, :, None] + 1 + j[None, None, :]
    mask_TDK = live_TD[:, :, None] & (j[None, None, :] < top_k)
    tl.store(rows_ptr + at_TDK, entry_TDK, mask=mask_TDK)
    tl.store(rows_ptr + at_TDK + top_k, slot_TDK, mask=mask_TDK)


def _block_tokens(d_pow2: int, k_pow2: int) -> int:
    """Tokens per program: the [T, D, K] tile of `_place_kernel` stays at ~8k elements."""
    return max(1, min(128, 8192 // (d_pow2 * k_pow2)))


def supported(num_devices: int, top_k: int) -> bool:
    """Shapes the kernels are built for (the [T, D, K] tile must fit); larger ones use torch."""
    return triton.next_power_of_2(max(num_devices, 1)) * triton.next_power_of_2(max(top_k, 1)) <= 4096


def dedup_plan_rows(
    ids_TK: torch.Tensor, expert_device_E: torch.Tensor, expert_slot_E: torch.Tensor, num_devices: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token_P, entry_PK, slot_PK, send_counts_D, row_TJ) of the dedup plan (module docstring).

    The first three are views of one [T*min(k, D), 1 + 2k] int64 buffer, rows past the true
    count all -1; `send_counts_D` int64 [D]; `row_TJ` int64 [T, D].
    """
    num_tokens, top_k = ids_TK.shape
    dev = ids_TK.device
    capacity = num_tokens * min(top_k, num_devices)
    rows = torch.full((capacity, 1 + 2 * top_k), -1, dtype=torch.int64, device=dev)
    row_TJ = torch.empty((num_tokens, num_devices), dtype=torch.int64, device=dev)
    if num_tokens == 0:
        return (
            rows[:, 0],
            rows[:, 1 : 1 + top_k],
            rows[:, 1 + top_k :],
            torch.zeros(num_devices, dtype=torch.int64, device=dev),
            row_TJ,
        )
    d_pow2 = max(2, triton.next_power_of_2(num_devices))
    k_pow2 = max(2, triton.next_power_of_2(top_k))
    block_t = _block_tokens(d_pow2, k_pow2)
    num_blocks = triton.cdiv(num_tokens, block_t)
    ids = ids_TK.contiguous()
    device_of = expert_device_E.contiguous()
    slot_of = expert_slot_E.contiguous()
    counts = torch.empty(num_devices * num_blocks, dtype=torch.int32, device=dev)
    _count_kernel[(num_blocks,)](
        ids,
        device_of,
        counts,
        num_tokens,
        top_k,
        num_devices,
        num_blocks,
        BLOCK_T=block_t,
        K_POW2=k_pow2,
        D_POW2=d_pow2,
    )
    cum = torch.cumsum(counts, 0, dtype=torch.int32)
    _place_kernel[(num_blocks,)](
        ids,
        device_of,
        slot_of,
        counts,
        cum,
        rows,
        row_TJ,
        num_tokens,
        top_k,
        num_devices,
        num_blocks,
        rows.stride(0),
        BLOCK_T=block_t,
        K_POW2=k_pow2,
        D_POW2=d_pow2,
    )
    send_counts_D = counts.view(num_devices, num_blocks).sum(dim=1, dtype=torch.int64)
    return rows[:, 0], rows[:, 1 : 1 + top_k], rows[:, 1 + top_k :], send_counts_D, row_TJ


def standard_plan_rows(
    ids_TK: torch.Tensor, expert_device_E: torch.Tensor, expert_slot_E: torch.Tensor, num_devices: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token_P, entry_PK, slot_PK, send_counts_D, row_TJ) of the standard plan (`occult.moe.plan.standard_plan`):
    the dedup kernels over the T*k pairs, each a one-expert token; every row is used (P = T*k)."""
    num_tokens, top_k = ids_TK.shape
    pair_P, entry_P1, slot_P1, send_counts_D, row_ND = dedup_plan_rows(
        ids_TK.reshape(-1, 1), expert_device_E, expert_slot_E, num_devices
    )
    # a pair has one row, on its expert's device, and -1 elsewhere: the max over devices is that row
    row_TJ = row_ND.amax(dim=1).view(num_tokens, top_k) if num_tokens else row_ND.new_empty((0, top_k))
    return pair_P // top_k, entry_P1, slot_P1, send_counts_D, row_TJ
