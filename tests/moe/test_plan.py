"""Dispatch plans: every (token, expert) entry is carried exactly once, to the right rank and slot."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # Triton kernels run under the CPU interpreter (set before triton loads)
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np
import pytest
import torch

from occult.moe.plan import dedup_plan, standard_plan, static_dedup_plan, static_standard_plan, trim
from occult.placement import Placement


def _random_case(num_tokens: int, num_experts: int, top_k: int, num_devices: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    ids_TK = (
        torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
        if num_tokens
        else torch.zeros(0, top_k, dtype=torch.int64)
    )
    rng = np.random.default_rng(seed)
    placement = Placement(rng.permutation(np.arange(num_experts) % num_devices)[None], num_devices)
    device_E, slot_E = placement.tensors(0)
    return ids_TK, device_E, slot_E


def _check_plan(plan, ids_TK, device_E, slot_E, num_devices, dedup):
    num_tokens, top_k = ids_TK.shape
    plan = trim(plan, int(plan.send_counts_D.sum()))
    counts = plan.send_counts_D.tolist()
    dest_P = torch.repeat_interleave(torch.arange(num_devices), torch.tensor(counts))
    # every entry carried once, by a row of its token, to its expert's device, with its slot
    entries = plan.entry_PK[plan.entry_PK >= 0]
    assert sorted(entries.tolist()) == list(range(num_tokens * top_k))
    rows, cols = (plan.entry_PK >= 0).nonzero(as_tuple=True)
    flat = plan.entry_PK[rows, cols]
    assert torch.equal(plan.token_P[rows], flat // top_k)
    assert torch.equal(dest_P[rows], device_E[ids_TK.reshape(-1)[flat]])
    assert torch.equal(plan.slot_PK[rows, cols], slot_E[ids_TK.reshape(-1)[flat]])
    assert torch.equal((plan.slot_PK >= 0), (plan.entry_PK >= 0))
    # row_TJ is the inverse of token_P
    valid = plan.row_TJ >= 0
    t_idx = torch.arange(num_tokens)[:, None].expand_as(plan.row_TJ)
    assert torch.equal(plan.token_P[plan.row_TJ[valid]], t_idx[valid])
    assert int(valid.sum()) == plan.num_rows
    if dedup:
        # one row per (token, device): rows == sum_t C_T, and no two rows share (token, dest)
        pairs = set(zip(plan.token_P.tolist(), dest_P.tolist()))
        assert len(pairs) == plan.num_rows
        ct = torch.zeros(num_tokens, num_devices, dtype=torch.bool)
        if num_tokens:
            ct[torch.arange(num_tokens)[:, None], device_E[ids_TK]] = True
        assert plan.num_rows == int(ct.sum())
    else:
        assert plan.num_rows == num_tokens * top_k


@pytest.mark.parametrize("dedup", [True, False])
@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k,num_devices",
    [
        (50, 16, 4, 4),
        (7, 8, 8, 2),
        (30, 12, 1, 3),
        (0, 8, 2, 2),
        (40, 64, 8, 8),
        (25, 6, 6, 1),
    ],
)
def test_plan_carries_every_entry_once(dedup, num_tokens, num_experts, top_k, num_devices):
    seed = int(np.random.SeedSequence().entropy % 2**31)
    ids_TK, device_E, slot_E = _random_case(num_tokens, num_experts, top_k, num_devices, seed)
    build = dedup_plan if dedup else standard_plan
    _check_plan(build(ids_TK, device_E, slot_E, num_devices), ids_TK, device_E, slot_E, num_devices, dedup)


def test_token_sum_kernel_matches_index_add():
    """The GPU combine (gather-sum over row_TJ) equals index_add over token_P, for both plans."""
    pytest.importorskip("triton")
    from occult.kernels.rows import gather_sum

    for build in (dedup_plan, standard_plan):
        ids_TK, device_E, slot_E = _random_case(33, 16, 4, 4, seed=int(np.random.SeedSequence().entropy % 2**31))
        plan = build(ids_TK, device_E, slot_E, 4)
        plan = trim(plan, int(plan.send_counts_D.sum()))
        y_PH = torch.randn(plan.num_rows, 24)
        ref = torch.zeros(33, 24).index_add_(0, plan.token_P, y_PH)
        # the same <= J rows per token summed in two orders: each within (J - 1) eps * sum |rows| of the exact sum
        terms = torch.zeros(33, 24).index_add_(0, plan.token_P, y_PH.abs())
        bound = 2 * (plan.row_TJ.shape[1] - 1) * torch.finfo(torch.float32).eps * terms
        err = (gather_sum(y_PH, plan.row_TJ) - ref).abs()
        assert (err <= bound).all(), float((err - bound).max())


@pytest.mark.parametrize("dedup", [True, False])
@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k,num_devices",
    [
        (50, 16, 4, 4),
        (7, 8, 8, 2),
        (30, 12, 1, 3),
        (0, 8, 2, 2),
        (40, 64, 8, 8),
        (25, 6, 6, 1),
        (20, 16, 6, 2),
    ],
)
def test_static_plan_carries_every_entry_once_in_fixed_capacity(dedup, num_tokens, num_experts, top_k, num_devices):
    """Sync-free plans: the same entries, rows and slots, in slots of a fixed capacity per destination."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    ids_TK, device_E, slot_E = _random_case(num_tokens, num_experts, top_k, num_devices, seed)
    per_device = num_experts // num_devices
    build = static_dedup_plan if dedup else static_standard_plan
    plan = build(ids_TK, device_E, slot_E, num_devices, per_device)
    capacity = num_tokens * (1 if dedup else min(top_k, per_device))
    assert plan.send_counts_D.tolist() == [capacity] * num_devices and plan.num_rows == num_devices * capacity
    # every entry once, to its expert's device and slot (rows outside the capacity would be caught here)
    dest_P = torch.arange(plan.num_rows) // max(capacity, 1)
    rows, cols = (plan.entry_PK >= 0).nonzero(as_tuple=True)
    flat = plan.entry_PK[rows, cols]
    assert sorted(flat.tolist()) == list(range(num_tokens * top_k))
    assert torch.equal(plan.token_P[rows], flat // top_k)
    assert torch.equal(dest_P[rows], device_E[ids_TK.reshape(-1)[flat]])
    assert torch.equal(plan.slot_PK[rows, cols], slot_E[ids_TK.reshape(-1)[flat]])
    assert torch.equal((plan.slot_PK >= 0), (plan.entry_PK >= 0))
    # row_TJ lists exactly each token's used rows (those carrying an entry)
    valid = plan.row_TJ >= 0
    t_idx = torch.arange(num_tokens)[:, None].expand_as(plan.row_TJ)
    assert torch.equal(plan.token_P[plan.row_TJ[valid]], t_idx[valid])
    assert sorted(plan.row_TJ[valid].tolist()) == sorted(set(rows.tolist()))
    # the compact plan's rows are exactly the used ones
    compact = (dedup_plan if dedup else standard_plan)(ids_TK, device_E, slot_E, num_devices)
    assert int(valid.sum()) == int(compact.send_counts_D.sum())
