"""The Triton dedup and standard plans (`occult.kernels.plan`) == the torch plans, field by field.

Without a GPU it runs under Triton's CPU interpreter (`TRITON_INTERPRET=1`, set before Triton is
imported; in a fresh process when another test imported Triton first, as tests/kernels/test_kernels.py does).
"""

from __future__ import annotations

import random

import pytest
import torch

# first: Triton's CPU interpreter without a GPU, or this file in a fresh process (test_in_subprocess)
from _triton_interpreter import DEVICE, IN_PROCESS, needs_in_process, run_file_in_fresh_process

from occult.moe.plan import dedup_plan_torch, standard_plan_torch, static_dedup_plan, static_standard_plan


def _case(num_tokens: int, top_k: int, num_devices: int, per_device: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    E = num_devices * per_device
    ids = (
        torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(num_tokens)])
        if num_tokens
        else torch.zeros(0, top_k, dtype=torch.int64)
    )
    if num_tokens and seed % 3 == 0:  # skewed: most tokens on device 0's experts
        ids[: num_tokens // 2] = torch.arange(top_k) % per_device
        ids = torch.stack(
            [
                torch.unique(r, sorted=False)[:top_k]
                if len(torch.unique(r)) == top_k
                else torch.randperm(E, generator=g)[:top_k]
                for r in ids
            ]
        )
    device_E = torch.randperm(E, generator=g) % num_devices  # a random balanced placement
    slot_E = torch.empty(E, dtype=torch.int64)
    for d in range(num_devices):
        mine = (device_E == d).nonzero().squeeze(1)
        slot_E[mine] = torch.arange(mine.numel())
    return ids.to(DEVICE), device_E.to(DEVICE), slot_E.to(DEVICE)


@needs_in_process
@pytest.mark.parametrize(
    "num_tokens,top_k,num_devices,per_device",
    [
        (0, 2, 2, 4),
        (1, 1, 1, 4),
        (7, 2, 2, 4),
        (37, 4, 4, 4),
        (130, 8, 4, 16),
        (64, 8, 8, 8),
        (19, 3, 3, 2),
        (50, 6, 2, 3),  # top-k = all experts
        (33, 2, 16, 2),
        (300, 8, 2, 32),
    ],
)
def test_triton_plan_equals_torch_plan(num_tokens, top_k, num_devices, per_device):
    from occult.kernels.plan import dedup_plan_rows

    seed = random.randrange(2**31)
    ids, device_E, slot_E = _case(num_tokens, top_k, num_devices, per_device, seed)
    ref = dedup_plan_torch(ids, device_E, slot_E, num_devices)
    token_P, entry_PK, slot_PK, counts_D, row_TJ = dedup_plan_rows(ids, device_E, slot_E, num_devices)
    where = f"seed {seed}"
    assert torch.equal(counts_D.cpu(), ref.send_counts_D.cpu()), where
    assert torch.equal(token_P.cpu(), ref.token_P.cpu()), where  # rows past the true count: -1 in both
    assert torch.equal(entry_PK.cpu(), ref.entry_PK.cpu()), where
    assert torch.equal(slot_PK.cpu(), ref.slot_PK.cpu()), where
    assert torch.equal(row_TJ.cpu(), ref.row_TJ.cpu()), where


@needs_in_process
@pytest.mark.parametrize(
    "num_tokens,top_k,num_devices,per_device",
    [
        (0, 2, 2, 4),
        (1, 1, 1, 4),
        (7, 2, 2, 4),
        (37, 4, 4, 4),
        (130, 8, 4, 16),
        (19, 3, 3, 2),
        (33, 2, 16, 2),
    ],
)
def test_triton_standard_plan_equals_torch_plan(num_tokens, top_k, num_devices, per_device):
    from occult.kernels.plan import standard_plan_rows

    seed = random.randrange(2**31)
    ids, device_E, slot_E = _case(num_tokens, top_k, num_devices, per_device, seed)
    ref = standard_plan_torch(ids, device_E, slot_E, num_devices)
    got = standard_plan_rows(ids, device_E, slot_E, num_devices)
    for name, a, b in zip(
        ("token_P", "entry_PK", "slot_PK", "send_counts_D", "row_TJ"),
        got,
        (ref.token_P, ref.entry_PK, ref.slot_PK, ref.send_counts_D, ref.row_TJ),
    ):
        assert a.shape == b.shape and torch.equal(a.cpu(), b.cpu()), f"{name}, seed {seed}"


@needs_in_process
@pytest.mark.parametrize("deduplicated", [True, False])
@pytest.mark.parametrize(
    "num_tokens,top_k,num_devices,per_device",
    [
        (1, 1, 2, 4),
        (1, 8, 2, 32),
        (7, 2, 2, 4),
        (37, 4, 4, 4),
        (19, 3, 3, 2),
        (50, 6, 2, 3),  # top-k = all
        (64, 8, 2, 32),
        (33, 2, 16, 2),
        (1, 4, 8, 1),
    ],
)
def test_one_launch_plan_equals_torch_plan_and_status(deduplicated, num_tokens, top_k, num_devices, per_device):
    """`routed_plan_rows` (the decode-sized plan with the routing status, one program) == the torch
    plan of the clamped ids and `routing_status`, field by field, on good and on bad routing."""
    from occult.kernels.plan import routed_plan_fits, routed_plan_rows
    from occult.moe.counts import routing_status

    seed = random.randrange(2**31)
    ids, device_E, slot_E = _case(num_tokens, top_k, num_devices, per_device, seed)
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(num_tokens, top_k, generator=g).to(DEVICE, torch.bfloat16 if seed % 2 else torch.float32)
    bad = seed % 4  # 0 fine, 1 a NaN gate, 2 an id out of range, 3 an inf gate and a negative id
    if bad:
        t, j = int(torch.randint(0, num_tokens, (1,), generator=g)), int(torch.randint(0, top_k, (1,), generator=g))
        if bad != 2:
            weights[t, j] = float("nan") if bad == 1 else float("inf")
        if bad >= 2:
            ids = ids.clone()
            ids[t, j] = device_E.shape[0] + 3 if bad == 2 else -1
    assert routed_plan_fits(num_tokens, num_devices, top_k, not deduplicated)
    clamped, ref_status = routing_status(weights, ids, device_E.shape[0])
    planner = dedup_plan_torch if deduplicated else standard_plan_torch
    ref = planner(clamped, device_E, slot_E, num_devices)
    *got, status = routed_plan_rows(ids, weights, device_E, slot_E, num_devices, pairs=not deduplicated)
    where = f"seed {seed}, bad {bad}"
    assert int(status) == int(ref_status) == (0, 1, 2, 2)[bad], where
    for name, a, b in zip(
        ("token_P", "entry_PK", "slot_PK", "send_counts_D", "row_TJ"),
        got,
        (ref.token_P, ref.entry_PK, ref.slot_PK, ref.send_counts_D, ref.row_TJ),
    ):
        assert a.shape == b.shape and torch.equal(a.cpu(), b.cpu()), f"{name}, {where}"


@needs_in_process
@pytest.mark.parametrize("num_tokens,top_k,num_experts", [(1, 1, 4), (1, 8, 64), (37, 4, 16), (64, 8, 64), (5, 6, 6)])
def test_one_launch_slots_equal_torch_and_status(num_tokens, top_k, num_experts):
    """`routed_slots` (the one-rank dispatch's slots and routing status, one program) ==
    `slot_E[routing_status's clamped ids]` and its status, on good and on bad routing."""
    from occult.kernels.plan import routed_slots
    from occult.moe.counts import routing_status

    seed = random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)])
    slot_E = torch.randperm(num_experts, generator=g)
    weights = torch.rand(num_tokens, top_k, generator=g, dtype=torch.float16 if seed % 2 else torch.float32)
    bad = seed % 3  # 0 fine, 1 an inf gate, 2 an id out of range
    if bad == 1:
        weights[num_tokens - 1, 0] = float("inf")
    elif bad == 2:
        ids[0, top_k - 1] = -5
    ids, weights, slot_E = ids.to(DEVICE), weights.to(DEVICE), slot_E.to(DEVICE)
    clamped, ref_status = routing_status(weights, ids, num_experts)
    slots, status = routed_slots(ids, weights, slot_E)
    assert int(status) == int(ref_status) == bad, f"seed {seed}"
    assert torch.equal(slots.cpu(), slot_E[clamped].cpu()), f"seed {seed}"


@needs_in_process
@pytest.mark.parametrize("standard", [False, True])
@pytest.mark.parametrize(
    "num_tokens,top_k,num_devices,per_device",
    [
        (1, 1, 2, 4),
        (1, 8, 2, 32),
        (7, 2, 2, 4),
        (37, 4, 4, 4),
        (19, 3, 3, 2),
        (50, 6, 2, 3),
        (16, 8, 2, 32),
        (33, 2, 16, 2),
        (1, 4, 8, 1),
    ],
)
def test_one_launch_fixed_plan_equals_torch(standard, num_tokens, top_k, num_devices, per_device):
    """`fixed_plan_rows` (the sync-free plans in one program) == `static_dedup_plan` / `static_standard_plan`
    of the clamped ids, field by field (ids out of range clamped as `clamp_ids` does)."""
    from occult.kernels.plan import fixed_plan_fits, fixed_plan_rows
    from occult.moe.counts import clamp_ids

    seed = random.randrange(2**31)
    ids, device_E, slot_E = _case(num_tokens, top_k, num_devices, per_device, seed)
    if seed % 3 == 1 and not standard:  # an id past the end and a negative one: clamped (the standard plan's
        ids = ids.clone()  # torch reference cannot take the duplicates clamping may make: next test)
        ids[0, 0], ids[-1, -1] = device_E.shape[0] + 7, -2
    J = min(top_k, per_device) if standard else None
    assert fixed_plan_fits(num_tokens, num_devices, top_k, J)
    clamped = clamp_ids(ids, device_E.shape[0])
    planner = static_standard_plan if standard else static_dedup_plan
    ref = planner(clamped, device_E, slot_E, num_devices, per_device)
    got = fixed_plan_rows(ids, device_E, slot_E, num_devices, J)
    for name, a, b in zip(
        ("token_P", "entry_PK", "slot_PK", "send_counts_D", "row_TJ"),
        got,
        (ref.token_P, ref.entry_PK, ref.slot_PK, ref.send_counts_D, ref.row_TJ),
    ):
        assert a.shape == b.shape and torch.equal(a.cpu(), b.cpu()), f"{name}, seed {seed}"


@needs_in_process
def test_one_launch_fixed_standard_plan_drops_duplicates_clamping_makes():
    """Ids clamped onto one the token has already: its extra entry on a full device gets no row (-1), never
    another token's row (sync-free reports nothing; the torch plan would index out of range)."""
    from occult.kernels.plan import fixed_plan_rows

    device_E = torch.tensor([0, 0, 1, 1]).to(DEVICE)
    slot_E = torch.tensor([0, 1, 0, 1]).to(DEVICE)
    ids = torch.tensor([[0, 1, 9], [2, 3, 0]]).to(DEVICE)  # 9 -> 3: token 0 has two experts on device 1, fine
    ids_dup = torch.tensor([[1, 0, 9, 7]]).to(DEVICE)  # 9, 7 -> 3, 3: device 1 gets 2 entries, room for 2 (J = 2)
    _, _, _, _, row_TJ = fixed_plan_rows(ids, device_E, slot_E, 2, 2)
    assert (row_TJ >= 0).all() and int(row_TJ.max()) < 2 * 2 * 2
    ids_over = torch.tensor([[0, 1, 9, -1]]).to(DEVICE)  # -> 0, 1, 3, 0: device 0 gets 3 entries, room for 2
    _, entry_P1, _, _, row_TJ = fixed_plan_rows(ids_over, device_E, slot_E, 2, 2)
    assert row_TJ.cpu().tolist() == [[0, 1, 2, -1]], row_TJ
    assert int(fixed_plan_rows(ids_dup, device_E, slot_E, 2, 2)[4].max()) < 4


@needs_in_process
def test_one_launch_plan_fits_decode_batches_only():
    from occult.kernels.plan import routed_plan_fits

    assert routed_plan_fits(1, 2, 8, False) and routed_plan_fits(512, 2, 8, False) and routed_plan_fits(256, 2, 8, True)
    assert not routed_plan_fits(0, 2, 8, False) and not routed_plan_fits(513, 2, 8, False)
    assert not routed_plan_fits(257, 2, 8, True) and not routed_plan_fits(8192, 2, 8, False)


@needs_in_process
def test_shapes_too_large_for_the_tile_fall_back():
    from occult.kernels.plan import supported

    assert supported(8, 8) and supported(64, 8) and not supported(256, 32)


@pytest.mark.skipif(IN_PROCESS, reason="tested in this process")
def test_in_subprocess():
    run_file_in_fresh_process(__file__)
