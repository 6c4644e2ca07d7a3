"""Dispatch plans: which rows a rank sends to which rank, and what each row carries.

A plan lists the rows to send, grouped by destination rank. Each row is one token's
activation plus, for the destination, up to K local expert slots (-1 = padding) and the
matching top-k entries (whose gate weights travel with the row). The two plans differ only
in how rows are formed:

- standard: one row per (token, expert) pair, K = 1 entry per row: T*k rows;
- dedup: one row per (token, device) pair, carrying every one of the token's experts on
  that device: sum_t C_T rows, with C_T the number of distinct devices among its k experts.

Both are built with a few vectorised ops and no host synchronisation; only the per-rank
counts are needed on the host (for the all-to-all split sizes), see `occult.moe.dispatch`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from occult import settings


@dataclass
class DispatchPlan:
    """Rows to send, grouped by destination rank.

    token_P:    source token of each row.
    entry_PK:   flat index `t * k + j` into the token's top-k entries for each carried expert,
                -1 for padding (standard plans have one column).
    slot_PK:    destination-local expert slot of each entry, -1 for padding.
    send_counts_D: rows for each destination rank (device tensor; synced once by the dispatcher).
    row_TJ:     the inverse of `token_P`: each token's rows, -1 padded (J = k for standard,
                J = number of ranks for dedup); used to sum a token's rows without atomics.
    """

    token_P: torch.Tensor
    entry_PK: torch.Tensor
    slot_PK: torch.Tensor
    send_counts_D: torch.Tensor
    row_TJ: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.token_P.shape[0]


def standard_plan(
    ids_TK: torch.Tensor, expert_device_E: torch.Tensor, expert_slot_E: torch.Tensor, num_devices: int
) -> DispatchPlan:
    """One row per (token, expert), as Megatron-Core's alltoall dispatcher and TorchTitan send.

    On a GPU the Triton counting sort of `occult.kernels.plan` builds it, as for dedup (so the
    baseline and ours differ in the plan's rows, not in how fast the plan is built); elsewhere
    `standard_plan_torch`.
    """
    if _plan_kernel_usable(ids_TK, num_devices, top_k=1):
        from occult.kernels.plan import standard_plan_rows

        return DispatchPlan(*standard_plan_rows(ids_TK, expert_device_E, expert_slot_E, num_devices))  # field order
    return standard_plan_torch(ids_TK, expert_device_E, expert_slot_E, num_devices)


def standard_plan_torch(
    ids_TK: torch.Tensor, expert_device_E: torch.Tensor, expert_slot_E: torch.Tensor, num_devices: int
) -> DispatchPlan:
    """`standard_plan` from torch ops (CPU, and the reference of the Triton plan)."""
    num_tokens, top_k = ids_TK.shape
    flat_ids = ids_TK.reshape(-1)
    device_N = expert_device_E[flat_ids]
    # Stable sort by destination keeps (token, j) order inside each destination.
    order_P = torch.sort(device_N, stable=True).indices
    row_N = torch.empty_like(order_P)
    row_N[order_P] = torch.arange(order_P.shape[0], device=order_P.device)
    return DispatchPlan(
        token_P=order_P // top_k,
        entry_PK=order_P[:, None],
        slot_PK=expert_slot_E[flat_ids[order_P]][:, None],
        # (not bincount: on CUDA it reads the maximum back to the host)
        send_counts_D=torch.zeros(num_devices, dtype=torch.int64, device=ids_TK.device).index_add_(
            0, device_N, torch.ones_like(device_N)
        ),
        row_TJ=row_N.view(num_tokens, top_k),
    )


def _plan_kernel_usable(ids_TK: torch.Tensor, num_devices: int, top_k: int | None = None) -> bool:
    """The Triton plans (`occult.kernels.plan`) serve CUDA tensors; `OCCULT_PLAN=torch` turns them off,
    `OCCULT_PLAN=triton` on for CPU tensors too under Triton's interpreter (`TRITON_INTERPRET=1`: tests)."""
    chosen = settings.current()
    if chosen.plan == "torch" or not (ids_TK.is_cuda or (chosen.plan == "triton" and chosen.triton_interpret)):
        return False
    from occult import kernels

    if not kernels.available(ids_TK.device):
        return False
    from occult.kernels.plan import supported

    return supported(num_devices, ids_TK.shape[1] if top_k is None else top_k)


def dedup_plan(
    ids_TK: torch.Tensor, expert_device_E: torch.Tensor, expert_slot_E: torch.Tensor, num_devices: int
) -> DispatchPlan:
    """One row per (token, device): a token goes once to each device holding any of its experts.

    On a GPU five launches of `occult.kernels.plan` build it (the layer's forward is host-bound:
    every op counts); elsewhere `dedup_plan_torch`, the same plan from torch ops.
    """
    if _plan_kernel_usable(ids_TK, num_devices):
        from occult.kernels.plan import dedup_plan_rows

        return DispatchPlan(*dedup_plan_rows(ids_TK, expert_device_E, expert_slot_E, num_devices))  # field order
    return dedup_plan_torch(ids_TK, expert_device_E, expert_slot_E, num_devices)


_ROUTED_GATES = (torch.float16, torch.bfloat16, torch.float32)  # what the one-launch plan checks for NaN/inf


def _routed_usable(
    ids_TK: torch.Tensor, weights_TK: torch.Tensor, num_devices: int, top_k: int | None = None, sync_free: bool = False
) -> bool:
    """The one-launch kernels serve these tensors: the plan kernels' conditions, gates they check (none
    when sync-free), and not while torch.compile traces (the torch ops trace, and inductor fuses them)."""
    return (
        (sync_free or weights_TK.dtype in _ROUTED_GATES)
        and not torch.compiler.is_compiling()
        and _plan_kernel_usable(ids_TK, num_devices, top_k)
    )


def routed_plan(
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    expert_device_E: torch.Tensor,
    expert_slot_E: torch.Tensor,
    num_devices: int,
    deduplicated: bool,
    sync_free: bool = False,
) -> tuple[DispatchPlan, torch.Tensor | None] | None:
    """(the dedup or standard plan, the routing status) from one launch, for a batch one Triton program
    holds on a GPU (a decode step: the layer is a chain of tiny kernels there); None elsewhere, where
    the caller makes them apart (`occult.moe.counts.routing_status`, then the plan). `sync_free`: the
    fixed-capacity plan of the clamped ids (`static_dedup_plan`, `static_standard_plan`) and no status."""
    pairs = not deduplicated
    if not ids_TK.shape[1] or not _routed_usable(ids_TK, weights_TK, num_devices, 1 if pairs else None, sync_free):
        return None
    from occult.kernels.plan import fixed_plan_fits, fixed_plan_rows, routed_plan_fits, routed_plan_rows

    num_tokens, top_k = ids_TK.shape
    if sync_free:
        per_device = min(top_k, expert_device_E.shape[0] // num_devices) if pairs else None
        if not fixed_plan_fits(num_tokens, num_devices, top_k, per_device):
            return None
        return DispatchPlan(*fixed_plan_rows(ids_TK, expert_device_E, expert_slot_E, num_devices, per_device)), None
    if not routed_plan_fits(num_tokens, num_devices, top_k, pairs):
        return None
    *fields, status = routed_plan_rows(ids_TK, weights_TK, expert_device_E, expert_slot_E, num_devices, pairs)
    return DispatchPlan(*fields), status


def routed_slots(
    ids_TK: torch.Tensor, weights_TK: torch.Tensor, expert_slot_E: torch.Tensor, sync_free: bool = False
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(local slots of the clamped ids, routing status) from one launch, for a one-rank dispatch of a
    batch as `routed_plan` takes; None elsewhere. `sync_free`: the caller drops the status (then any gates do)."""
    if not ids_TK.shape[0] or not ids_TK.shape[1] or not _routed_usable(ids_TK, weights_TK, 1, None, sync_free):
        return None
    from occult.kernels.plan import routed_plan_fits
    from occult.kernels.plan import routed_slots as routed_slots_rows

    if not routed_plan_fits(ids_TK.shape[0], 1, ids_TK.shape[1], False):
        return None
    return routed_slots_rows(ids_TK, weights_TK, expert_slot_E)


def dedup_plan_torch(
    ids_TK: torch.Tensor, expert_device_E: torch.Tensor, expert_slot_E: torch.Tensor, num_devices: int
) -> DispatchPlan:
    """`dedup_plan` from torch ops (CPU, and the reference of the Triton plan)."""
    num_tokens, top_k = ids_TK.shape
    device_TK = expert_device_E[ids_TK]
    token_TK = torch.arange(num_tokens, device=ids_TK.device)[:, None].expand(num_tokens, top_k)
    # used_DT[d, t]: token t has an expert on device d. Rows are its True entries, device-major.
    # (scatter_ with a scalar, not `used[...] = True`: that copies the scalar host-to-device,
    # a synchronisation that drains the GPU queue before the count exchange even starts)
    used_DT = torch.zeros(num_devices * num_tokens, dtype=torch.bool, device=ids_TK.device)
    used_DT = used_DT.scatter_(0, (device_TK * num_tokens + token_TK).reshape(-1), True).view(num_devices, num_tokens)
    flat_used = used_DT.reshape(-1)
    row_of_DT = (torch.cumsum(flat_used, 0) - 1).view(num_devices, num_tokens)
    # Upper bound T*min(k, D) rows; the true count is only known on the host after the sync,
    # so rows are written into a buffer with one spare slot that absorbs the unused entries.
    capacity = num_tokens * min(top_k, num_devices)
    target = torch.where(flat_used, row_of_DT.reshape(-1), capacity)
    token_buf = torch.full((capacity + 1,), -1, dtype=torch.int64, device=ids_TK.device)
    token_buf.scatter_(0, target, torch.arange(num_tokens, device=ids_TK.device).repeat(num_devices))
    row_TK = row_of_DT[device_TK, token_TK]
    entry_buf = torch.full((capacity, top_k), -1, dtype=torch.int64, device=ids_TK.device)
    slot_buf = torch.full((capacity, top_k), -1, dtype=torch.int64, device=ids_TK.device)
    column_TK = torch.arange(top_k, device=ids_TK.device).expand(num_tokens, top_k)
    entry_buf[row_TK, column_TK] = torch.arange(num_tokens * top_k, device=ids_TK.device).view(num_tokens, top_k)
    slot_buf[row_TK, column_TK] = expert_slot_E[ids_TK]
    return DispatchPlan(
        token_P=token_buf[:capacity],
        entry_PK=entry_buf,
        slot_PK=slot_buf,
        send_counts_D=used_DT.sum(dim=1),
        row_TJ=torch.where(used_DT, row_of_DT, -1).t().contiguous(),
    )


def static_standard_plan(
    ids_TK: torch.Tensor,
    expert_device_E: torch.Tensor,
    expert_slot_E: torch.Tensor,
    num_devices: int,
    experts_per_device: int,
) -> DispatchPlan:
    """Standard plan in fixed-capacity form: destination d's rows are `[d*C, (d+1)*C)`.

    Row `d*C + t*J + i` carries token t's i-th expert on device d (J = min(k, E/D)); unused rows
    carry the token with slot -1 (nothing is computed for them, their result is never read).
    The shapes depend only on T, k, E/D and D: no host synchronisation, CUDA-graph capturable.
    """
    num_tokens, top_k = ids_TK.shape
    dev = ids_TK.device
    J = min(top_k, experts_per_device)
    capacity = num_tokens * J
    device_TK = expert_device_E[ids_TK]
    # position of each entry among the token's entries on the same device (0 .. J-1)
    same_TKK = device_TK[:, :, None] == device_TK[:, None, :]
    pos_TK = torch.tril(same_TKK.to(torch.int64), diagonal=-1).sum(dim=2)
    token_T1 = torch.arange(num_tokens, device=dev)[:, None]
    row_TK = device_TK * capacity + token_T1 * J + pos_TK
    num_rows = num_devices * capacity
    entry_P1 = torch.full((num_rows, 1), -1, dtype=torch.int64, device=dev)
    slot_P1 = torch.full((num_rows, 1), -1, dtype=torch.int64, device=dev)
    entry_P1[row_TK.reshape(-1), 0] = torch.arange(num_tokens * top_k, device=dev)
    slot_P1[row_TK.reshape(-1), 0] = expert_slot_E[ids_TK].reshape(-1)
    return DispatchPlan(
        token_P=(torch.arange(num_rows, device=dev) // J) % max(num_tokens, 1),
        entry_PK=entry_P1,
        slot_PK=slot_P1,
        send_counts_D=torch.full((num_devices,), capacity, dtype=torch.int64, device=dev),
        row_TJ=row_TK,
    )


def static_dedup_plan(
    ids_TK: torch.Tensor,
    expert_device_E: torch.Tensor,
    expert_slot_E: torch.Tensor,
    num_devices: int,
    experts_per_device: int,
) -> DispatchPlan:
    """Dedup plan in fixed-capacity form: row `d*T + t` is token t's copy for device d.

    The row carries the token's expert slots on d (all -1 when it has none there: nothing is
    computed, the result is never read). No host synchronisation, CUDA-graph capturable.
    """
    num_tokens, top_k = ids_TK.shape
    dev = ids_TK.device
    device_TK = expert_device_E[ids_TK]
    token_T1 = torch.arange(num_tokens, device=dev)[:, None]
    row_TK = device_TK * num_tokens + token_T1
    column_TK = torch.arange(top_k, device=dev).expand(num_tokens, top_k)
    num_rows = num_devices * num_tokens
    entry_PK = torch.full((num_rows, top_k), -1, dtype=torch.int64, device=dev)
    slot_PK = torch.full((num_rows, top_k), -1, dtype=torch.int64, device=dev)
    entry_PK[row_TK, column_TK] = torch.arange(num_tokens * top_k, device=dev).view(num_tokens, top_k)
    slot_PK[row_TK, column_TK] = expert_slot_E[ids_TK]
    # (a comparison, not `used[...] = True`: the scalar would be a host-to-device copy, which a
    # CUDA graph cannot capture)
    used_TD = (device_TK[:, :, None] == torch.arange(num_devices, device=dev)).any(dim=1)
    rows_TD = torch.arange(num_devices, device=dev)[None, :] * num_tokens + token_T1
    return DispatchPlan(
        token_P=torch.arange(num_tokens, device=dev).repeat(num_devices),
        entry_PK=entry_PK,
        slot_PK=slot_PK,
        send_counts_D=torch.full((num_devices,), num_tokens, dtype=torch.int64, device=dev),
        row_TJ=torch.where(used_TD, rows_TD, -1),
    )


def bounded_rows(num_tokens: int, capacity: float) -> int:
    """Rows a sync-free dedup plan reserves for each other rank: ceil(capacity x T), at most T (a product a rounding
    error puts just above an integer, 7 / 25 x 25, counts as that integer)."""
    return min(num_tokens, math.ceil(capacity * num_tokens - 1e-6))


HEADER_DROPPED = -2  # a block's header slot where its sender dropped copies (any block's): `bounded_dedup_plan`


def bounded_splits(num_tokens: int, num_devices: int, rank: int, remote_rows: int) -> list[int]:
    """Rows to (and from) each rank under `bounded_dedup_plan`: T for this rank, `remote_rows` and a header row for
    the others."""
    return [num_tokens if d == rank else remote_rows + 1 for d in range(num_devices)]


def header_rows(num_tokens: int, num_devices: int, rank: int, remote_rows: int, device: torch.device) -> torch.Tensor:
    """[D] where each rank's block in `bounded_splits` order has its header row (its last; for `rank` itself, which
    has none, the total row count: one past the end), made on `device` (no copy from the host: a CUDA graph
    records it)."""
    ranks_D = torch.arange(num_devices, device=device)
    block = remote_rows + 1
    start_D = ranks_D * block + (ranks_D > rank) * (num_tokens - block)
    return torch.where(ranks_D == rank, num_tokens + (num_devices - 1) * block, start_D + remote_rows)


def bounded_dedup_plan(
    ids_TK: torch.Tensor, expert_map_E: tuple[torch.Tensor, torch.Tensor], num_devices: int, rank: int, remote_rows: int
) -> tuple[DispatchPlan, torch.Tensor]:
    """(plan, rows dropped [1]): the sync-free dedup plan with `remote_rows` rows for each other rank.

    Destination d's rows are a block of `bounded_splits` (T rows for this rank itself: its copies never
    cross a link), filled in token order with the tokens that use d; a token's copy past its block's
    `remote_rows` is dropped (counted, never sent: the layer reports it, `ExecConfig.sync_free_capacity`), the
    rest of a block is padding (slots -1). Each other rank's block ends in a header row (`header_rows`: no token,
    nothing computed) whose first slot is `HEADER_DROPPED` where this rank dropped copies for any rank, else -1: so
    every rank learns of a drop in the same call (`DedupDispatcher`). Shapes follow from T, D and the bound alone:
    no host synchronisation.
    """
    expert_device_E, expert_slot_E = expert_map_E
    num_tokens, top_k = ids_TK.shape
    dev = ids_TK.device
    ranks_D = torch.arange(num_devices, device=dev)
    size_D = torch.where(ranks_D == rank, num_tokens, remote_rows + 1)
    start_D = torch.cumsum(size_D, 0) - size_D
    num_rows = num_tokens + (num_devices - 1) * (remote_rows + 1)
    device_TK = expert_device_E[ids_TK]
    used_TD = (device_TK[:, :, None] == ranks_D).any(dim=1)
    place_TD = torch.cumsum(used_TD.to(torch.int64), 0) - 1  # the token's place among those sent to d
    kept_TD = used_TD & (place_TD < torch.where(ranks_D == rank, num_tokens, remote_rows))
    row_TD = torch.where(kept_TD, start_D + place_TD, -1)
    target_TD = torch.where(kept_TD, row_TD, num_rows)  # dropped copies and padding: one spare row
    token_T1 = torch.arange(num_tokens, device=dev)[:, None]
    token_P = torch.full((num_rows + 1,), -1, dtype=torch.int64, device=dev)
    token_P.scatter_(0, target_TD.reshape(-1), token_T1.expand(num_tokens, num_devices).reshape(-1))
    row_TK = target_TD.gather(1, device_TK)
    column_TK = torch.arange(top_k, device=dev).expand(num_tokens, top_k)
    entry_PK = torch.full((num_rows + 1, top_k), -1, dtype=torch.int64, device=dev)
    slot_PK = torch.full((num_rows + 1, top_k), -1, dtype=torch.int64, device=dev)
    entry_PK[row_TK, column_TK] = torch.arange(num_tokens * top_k, device=dev).view(num_tokens, top_k)
    slot_PK[row_TK, column_TK] = expert_slot_E[ids_TK]
    dropped_1 = (used_TD & ~kept_TD).sum().reshape(1)
    header_D = header_rows(num_tokens, num_devices, rank, remote_rows, dev)  # (this rank's: the spare row)
    slot_PK[header_D, 0] = torch.where(dropped_1 > 0, HEADER_DROPPED, -1).expand(num_devices)
    plan = DispatchPlan(token_P[:num_rows], entry_PK[:num_rows], slot_PK[:num_rows], size_D, row_TD)
    return plan, dropped_1


def trim(plan: DispatchPlan, num_rows: int) -> DispatchPlan:
    """Drop the unused tail of a capacity-sized plan once the true row count is known."""
    if plan.num_rows == num_rows:
        return plan
    return DispatchPlan(
        token_P=plan.token_P[:num_rows],
        entry_PK=plan.entry_PK[:num_rows],
        slot_PK=plan.slot_PK[:num_rows],
        send_counts_D=plan.send_counts_D,
        row_TJ=plan.row_TJ,
    )


PLANNERS = {"standard": standard_plan, "dedup": dedup_plan}
STATIC_PLANNERS = {"standard": static_standard_plan, "dedup": static_dedup_plan}
