"""Bounded sync-free blocks (`ExecConfig.sync_free_capacity`): the plan's rows, what it drops and how that is
reported, and the settings it refuses. Exactness against the dense reference: tests/moe/test_layer.py ("fit"
cases, 1-4 gloo ranks) and tests/gpu/test_collective_layer.py (NCCL, fp32/bf16/fp16)."""

from __future__ import annotations

import random

import pytest
import torch

from occult.distributed import run_ranks
from occult.moe.config import ExecConfig
from occult.moe.counts import RoutingError
from occult.moe.dense import DenseMoE
from occult.moe.layer import OccultMoE
from occult.moe.plan import (
    HEADER_DROPPED,
    bounded_dedup_plan,
    bounded_rows,
    bounded_splits,
    header_rows,
    static_dedup_plan,
)
from occult.moe.status import check_routing


def _routing(num_tokens: int, top_k: int, num_experts: int, num_devices: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]
    ids_TK = torch.stack(rows) if rows else torch.empty(0, top_k, dtype=torch.int64)  # (T = 0: no tokens)
    device_E = torch.randperm(num_experts, generator=gen) % num_devices
    slot_E = torch.empty_like(device_E)
    for d in range(num_devices):
        on_d = (device_E == d).nonzero().flatten()
        slot_E[on_d] = torch.arange(on_d.numel())
    return ids_TK.reshape(num_tokens, top_k), device_E, slot_E


@pytest.mark.parametrize("trial", range(6))
def test_bounded_plan_keeps_the_first_copies_of_each_block_and_counts_the_rest(trial):
    """Each destination's block holds, in token order, the first copies that fit (T for the rank itself, the
    bound for the others); each kept row carries what the unbounded plan's row for that (token, device) carries;
    every other copy is counted as dropped; each other rank's block ends in a header row whose first slot says
    whether this rank dropped any copy."""
    rng = random.Random()
    D, E = rng.choice([(2, 8), (3, 12), (4, 16)])
    T, K = rng.randrange(0, 40), rng.randrange(1, 5)
    rank, bound = rng.randrange(D), rng.randrange(0, 41)
    bound = min(bound, T)
    ids_TK, device_E, slot_E = _routing(T, K, E, D, rng.randrange(2**31))
    plan, dropped_1 = bounded_dedup_plan(ids_TK, (device_E, slot_E), D, rank, bound)
    full = static_dedup_plan(ids_TK, device_E, slot_E, D, E // D)
    sizes, room = [T if d == rank else bound + 1 for d in range(D)], [T if d == rank else bound for d in range(D)]
    assert plan.num_rows == sum(sizes) and plan.send_counts_D.tolist() == sizes
    assert bounded_splits(T, D, rank, bound) == sizes
    starts, dropped = [sum(sizes[:d]) for d in range(D)], 0
    for d in range(D):
        users = [t for t in range(T) if bool((device_E[ids_TK[t]] == d).any())]
        kept, dropped = users[: room[d]], dropped + max(0, len(users) - room[d])
        for place, t in enumerate(kept):
            row = starts[d] + place
            assert int(plan.row_TJ[t, d]) == row and int(plan.token_P[row]) == t
            assert torch.equal(plan.slot_PK[row], full.slot_PK[d * T + t])
            assert torch.equal(plan.entry_PK[row], full.entry_PK[d * T + t])
        for t in users[room[d] :]:
            assert int(plan.row_TJ[t, d]) == -1
        for row in range(starts[d] + len(kept), starts[d] + room[d]):  # padding: nothing computed, never read
            assert int(plan.token_P[row]) == -1 and bool((plan.slot_PK[row] == -1).all())
    assert int(dropped_1) == dropped
    headers = header_rows(T, D, rank, bound, torch.device("cpu")).tolist()
    assert headers == [sum(sizes) if d == rank else starts[d] + bound for d in range(D)]
    for d in (d for d in range(D) if d != rank):  # no token, nothing computed; the flag in the first slot
        row = headers[d]
        assert int(plan.token_P[row]) == -1 and bool((plan.entry_PK[row] == -1).all())
        assert plan.slot_PK[row].tolist() == [HEADER_DROPPED if dropped else -1] + [-1] * (K - 1)


def test_bounded_rows_is_the_ceiling_of_the_fraction_and_at_most_t():
    cases = {(64, 0.75): 48, (8192, 0.8): 6554, (10, 0.01): 1, (0, 0.5): 0, (5, 1.0): 5, (7, 0.999): 7, (3, 0.34): 2}
    cases |= {(T, b / T): b for T in range(1, 41) for b in range(1, T + 1)}  # b / T x T lands just above b for some
    assert {key: bounded_rows(*key) for key in cases} == cases


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, 1.5, float("nan"), True, "0.8", None])
def test_capacity_outside_zero_to_one_is_refused(bad):
    with pytest.raises(ValueError, match="sync_free_capacity must be a number in \\(0, 1\\]"):
        ExecConfig(sync_free_capacity=bad)


def test_capacity_below_one_needs_the_dedup_dispatcher():
    with pytest.raises(ValueError, match="dispatcher='dedup'"):
        OccultMoE(16, 8, 8, 2, dispatcher="standard", sync_free=True, sync_free_capacity=0.5)
    OccultMoE(16, 8, 8, 2, dispatcher="standard", sync_free=True, sync_free_capacity=1.0)


def _dropping_worker(rank: int, world_size: int, seed: int) -> dict:
    torch.manual_seed(seed)
    dense = DenseMoE(16, 12, 8, 2, dtype=torch.float64)
    x_all = torch.randn(world_size * 20, 16, dtype=torch.float64)
    out = {}
    for capacity in (0.05, 1.0):
        layer = OccultMoE.from_dense(dense, sync_free=True, sync_free_capacity=capacity)
        x = x_all[rank * 20 : (rank + 1) * 20].clone().requires_grad_()
        layer(x).sum().backward()  # every rank finishes the call: nothing raised inside it
        try:
            check_routing()
            out[capacity] = None
        except RoutingError as e:
            out[capacity] = str(e)
        out[f"rows {capacity}"] = layer.last_comm_stats.dispatch_rows
    return out


def test_dropped_copies_are_reported_by_check_routing_on_the_rank_that_dropped_them():
    """Blocks of one row for the other rank: both ranks finish forward and backward, then `check_routing()`
    raises on each, naming it and the setting; a layer at capacity 1.0 reports nothing."""
    results = run_ranks(_dropping_worker, 2, random.randrange(2**31), timeout_s=120)
    for rank, out in enumerate(results):
        assert out[0.05] and f"rank {rank}:" in out[0.05] and "sync_free_capacity" in out[0.05], out
        assert out[1.0] is None and out["rows 0.05"] == 20 + 1 + 1 and out["rows 1.0"] == 2 * 20, out  # (+ header)


def _one_dropper_worker(rank: int, world_size: int, seed: int) -> str | None:
    """Experts 2r and 2r + 1 on rank r (6 experts, top-2, the gate reading the input's first 6 features): rank 0's
    tokens all choose rank 1's experts, the others' their own, so only rank 0 has copies past its block (1 row)."""
    torch.manual_seed(seed)
    dense = DenseMoE(8, 12, 6, 2, dtype=torch.float64)
    with torch.no_grad():
        dense.router.gate.weight.copy_(torch.eye(6, 8, dtype=torch.float64) * 10)
    layer = OccultMoE.from_dense(dense, sync_free=True, sync_free_capacity=0.1)
    x = torch.randn(20, 8, dtype=torch.float64) * 0.1
    chosen = [2, 3] if rank == 0 else [2 * rank, 2 * rank + 1]
    x[:, chosen] += 1.0
    layer(x.requires_grad_()).sum().backward()  # every rank finishes the call: nothing raised inside it
    try:
        check_routing()
    except RoutingError as e:
        return str(e)
    return None


def test_a_rank_that_drops_copies_is_named_by_every_rank_after_the_same_call():
    """Only rank 0 drops (its block to rank 1 holds 2 of 20 tokens): its header rows tell ranks 1 and 2, so every
    rank's `check_routing()` raises after that call, naming rank 0 alone, and none waits in a later collective."""
    results = run_ranks(_one_dropper_worker, 3, random.randrange(2**31), timeout_s=120)
    for rank, text in enumerate(results):
        assert text and "rank 0:" in text and "rank 1:" not in text and "rank 2:" not in text, (rank, text)
        assert "sync_free_capacity" in text, (rank, text)
