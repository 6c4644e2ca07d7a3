"""Placement solvers (exactness of the swap arithmetic, planted recovery, load bound, edge cases)
and the Placement helpers (apply/invert/shard round trips, JSON I/O, clear errors)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from occult.placement import Placement, PlacementError
from occult.placement.solvers import (
    contiguous_layer,
    greedy_layer,
    merge_token_sets,
    place,
    rebalance_counts,
    refine_swaps,
    solve_layer,
)
from occult.placement.solvers.swap import SwapState
from occult.placement.stats import analytic_mean_ct, coactivation, mean_ct
from occult.placement.synthetic import planted_trace, uniform_trace


def _state(ids: np.ndarray, E: int, D: int) -> SwapState:
    sets, w = merge_token_sets(ids, E)
    return SwapState(sets, w, E, D)


# ------------------------------------------------------------------ building blocks
def test_merge_token_sets():
    ids = np.array([[3, 1, 2], [2, 3, 1], [0, 1, 2], [1, 2, 3]])
    sets, w = merge_token_sets(ids, 4)
    got = {tuple(s): c for s, c in zip(sets.tolist(), w.tolist())}
    assert got == {(1, 2, 3): 3, (0, 1, 2): 1}
    big = np.array([[100, 5], [5, 100], [7, 8]])  # more than 64 experts: the row-wise path
    sets, w = merge_token_sets(big, 128)
    assert sorted(zip(map(tuple, sets.tolist()), w.tolist())) == [((5, 100), 2), ((7, 8), 1)]


@pytest.mark.parametrize("E, K, D, G", [(12, 3, 3, 3), (16, 5, 4, 2), (80, 4, 4, 4)])
def test_swap_and_move_deltas_are_exact(E, K, D, G):
    rng = np.random.default_rng()
    ids = planted_trace(600, E, K, num_groups=G, noise=0.3, seed=rng).trace.layer(0)
    st = _state(ids, E, D)
    dev = rng.permutation(contiguous_layer(E, D))
    N = st.counts(dev)
    base = st.cost(dev)
    assert base / st.total_weight == pytest.approx(mean_ct(ids, dev, D))
    delta = st.swap_delta(dev, N)
    pairs = [(a, b) for a in range(E) for b in range(E) if dev[a] != dev[b]]
    for a, b in [pairs[i] for i in rng.choice(len(pairs), size=min(60, len(pairs)), replace=False)]:
        d2 = dev.copy()
        d2[a], d2[b] = d2[b], d2[a]
        truth = st.cost(d2) - base
        assert delta[a, b] == truth
        n2, d3 = N.copy(), dev.copy()
        assert st.apply_swap(d3, n2, a, b) == truth
        np.testing.assert_array_equal(n2, st.counts(d3))
    assert np.isinf(delta[dev[:, None] == dev[None, :]]).all()
    move = st.move_delta(dev, N)
    for a, q in zip(rng.integers(0, E, 20), rng.integers(0, D, 20)):
        d2 = dev.copy()
        d2[a] = q
        assert move[a, q] == st.cost(d2) - base


def test_refine_reaches_a_swap_local_optimum():
    rng = np.random.default_rng()
    E, D = 16, 4
    ids = planted_trace(2000, E, 4, num_groups=4, noise=0.25, seed=rng).trace.layer(0)
    st = _state(ids, E, D)
    start = rng.permutation(contiguous_layer(E, D))
    out = refine_swaps(st, start)
    assert np.array_equal(np.bincount(out, minlength=D), [4] * 4)
    assert st.cost(out) <= st.cost(start)
    best = st.cost(out)
    for a in range(E):
        for b in range(a + 1, E):
            if out[a] != out[b]:
                d2 = out.copy()
                d2[a], d2[b] = d2[b], d2[a]
                assert st.cost(d2) >= best


def test_rebalance_counts():
    rng = np.random.default_rng(3)
    ids = uniform_trace(500, 12, 3, seed=rng).layer(0)
    st = _state(ids, 12, 3)
    skewed = np.array([0] * 7 + [1] * 4 + [2])
    out = rebalance_counts(st, skewed)
    assert np.array_equal(np.bincount(out, minlength=3), [4, 4, 4])
    assert (out == skewed).sum() >= 8  # only the 4 surplus experts moved


def test_greedy_on_a_block_matrix():
    E, D = 12, 3
    groups = np.random.default_rng(4).permutation(np.arange(E) // 4)
    C = np.where(groups[:, None] == groups[None, :], 10.0, 1.0)
    np.fill_diagonal(C, 50)
    out = greedy_layer(C, D)
    # same partition as the blocks (device labels may differ)
    assert all(len(set(out[groups == g])) == 1 for g in range(3))
    assert np.array_equal(np.bincount(out), [4, 4, 4])


def test_for_layers_repeats_one_layer_and_keeps_nodes():
    one = Placement(np.array([[1, 0, 3, 2, 2, 3, 0, 1]]), 4, num_nodes=2)
    three = one.for_layers(3)
    assert three.num_layers == 3 and three.num_nodes == 2 and (three.expert_device_LE == one.expert_device_LE).all()
    assert three.for_layers(3) is three
    with pytest.raises(PlacementError, match="has 3 layer"):
        three.for_layers(2)


def test_contiguous_matches_placement():
    assert np.array_equal(contiguous_layer(64, 4), Placement.contiguous(64, 4).expert_device(0))


# ------------------------------------------------------------------ planted recovery
@pytest.mark.parametrize(
    "noise, skew, traces",
    [(0.1, 0.0, 1), (0.2, 0.0, 1), (0.1, 1.0, 1), (0.2, 1.0, 5), (0.15, 0.5, 1)],
)
def test_hypergraph_recovers_planted_grouping(noise, skew, traces):
    """Acceptance: E[C_T] within 2% of the planted optimum (the median over `traces` fresh traces);
    greedy reported beside it."""
    hyper_ratios, contiguous_ratios = [], []
    for _ in range(traces):
        pt = planted_trace(12_000, 64, 8, num_groups=4, noise=noise, skew=skew, seed=np.random.default_rng())
        ids = pt.trace.layer(0)
        opt = mean_ct(ids, pt.placement(4).expert_device(0), 4)
        hyper = solve_layer(ids, 64, 4, "hypergraph")
        greedy = solve_layer(ids, 64, 4, "greedy")
        contiguous = solve_layer(ids, 64, 4, "contiguous")
        print(
            f"noise {noise} skew {skew}: planted {opt:.4f} hypergraph {hyper.mean_ct:.4f} ({hyper.method}) "
            f"greedy {greedy.mean_ct:.4f} contiguous {contiguous.mean_ct:.4f}"
        )
        assert hyper.mean_ct <= greedy.mean_ct + 1e-12 and hyper.mean_ct <= contiguous.mean_ct + 1e-12
        assert hyper.mean_ct == pytest.approx(mean_ct(ids, hyper.expert_device_E, 4))
        if noise <= 0.1:  # clean enough that the optimum is the planted grouping itself
            dev = hyper.expert_device_E
            assert all(len(set(dev[pt.groups_LE[0] == g])) == 1 for g in range(4))
        hyper_ratios.append(hyper.mean_ct / opt)
        contiguous_ratios.append(contiguous.mean_ct / opt)
    # hypergraph/planted on fresh traces: exactly 1.000 at the four cleaner settings (120 traces each);
    # at noise 0.2 skew 1.0 (470 traces) 0.989-1.000 on 99% of them, but on ~0.6% (3 of 470) Mt-KaHyPar +
    # swaps end in a worse local optimum (1.02-1.032), so one trace failed 2% that often. That setting
    # takes the median of 5 traces (fails ~10 p^3 ~ 3e-6). It is the one setting where Mt-KaHyPar matters:
    # greedy + swaps alone exceed 1.02 on 38% of its traces (the median of 5 still fails ~28% of runs),
    # greedy alone is 1.04-1.18.
    assert np.median(hyper_ratios) <= 1.02, hyper_ratios
    # contiguous/planted, 1500-9500 fresh traces per setting: noise 0.2 skew 1.0 1.42-1.72 (mean 1.60,
    # sd 0.04, a long low tail: 4 in 9500 below 1.45), noise 0.2 skew 0 1.50-1.65, noise 0.15 1.65-1.89,
    # noise 0.1 1.94-2.26; 1.35 still fails if contiguous stumbled on the grouping (ratio 1).
    assert np.median(contiguous_ratios) > 1.35, contiguous_ratios


def test_hypergraph_with_more_groups_than_devices_and_more_experts():
    pt = planted_trace(10_000, 128, 6, num_groups=16, noise=0.15, skew=0.5, seed=np.random.default_rng())
    ids = pt.trace.layer(0)
    opt = mean_ct(ids, pt.placement(8).expert_device(0), 8)
    hyper = solve_layer(ids, 128, 8, "hypergraph")
    assert hyper.mean_ct <= 1.02 * opt


def test_hypergraph_on_uniform_routing_is_no_worse_than_contiguous():
    ids = uniform_trace(5000, 64, 8, seed=np.random.default_rng()).layer(0)
    res = solve_layer(ids, 64, 4, "hypergraph")
    assert res.mean_ct <= res.candidates["contiguous"]
    assert res.mean_ct <= res.candidates["greedy"]
    assert abs(res.mean_ct - analytic_mean_ct(64, 8, 4)) < 0.1  # nothing to find: a small gain at most


# ------------------------------------------------------------------ load bound
def test_load_bound_is_respected():
    # The bound must bite: skewed popularity makes the planted groups' devices hot. Over 4000 fresh
    # traces the planted grouping's max/mean device load was 1.11-2.30 (median 1.53, 33 below 1.2, 4
    # below 1.15), so a lone draw left `free.load_imbalance > 1.1` failing ~1e-4 of runs: a trace
    # whose groups happen to be balanced (below 1.2, ~1%) is drawn again.
    for _ in range(10):
        pt = planted_trace(12_000, 64, 8, num_groups=4, noise=0.1, skew=1.0, seed=np.random.default_rng())
        ids = pt.trace.layer(0)
        group_load = np.bincount(pt.groups_LE[0], weights=np.bincount(ids.ravel(), minlength=64), minlength=4)
        if group_load.max() / group_load.mean() > 1.2:
            break
    free = solve_layer(ids, 64, 4, "hypergraph")
    assert free.load_imbalance > 1.1  # the free solver keeps the hot planted groups together
    for method in ("hypergraph", "greedy", "contiguous"):
        res = solve_layer(ids, 64, 4, method, max_load_ratio=1.1)
        assert res.load_imbalance <= 1.1 + 1e-9, method
        assert res.warning is None
    bounded = solve_layer(ids, 64, 4, "hypergraph", max_load_ratio=1.1)
    # balance costs some co-location, but most of the gain over contiguous remains: bounded/contiguous
    # 0.54-0.75 over 100 fresh traces (mean 0.62), and at most 0.78 on the 1% most imbalanced of 3000
    assert free.mean_ct <= bounded.mean_ct < 0.85 * bounded.candidates["contiguous"]
    load = coactivation(ids, 64).diagonal()
    dev = bounded.expert_device_E
    per_dev = np.bincount(dev, weights=load, minlength=4)
    assert per_dev.max() / per_dev.mean() == pytest.approx(bounded.load_imbalance)


def test_unreachable_load_bound_warns_and_balances():
    rng = np.random.default_rng(6)
    ids = uniform_trace(3000, 16, 2, seed=rng).layer(0).copy()
    ids[:2000, 0] = 5  # expert 5 takes two thirds of the tokens' first picks
    ids[:2000, 1] = np.where(ids[:2000, 1] == 5, 6, ids[:2000, 1])
    with pytest.warns(RuntimeWarning, match="no placement meets max_load_ratio=1.05"):
        res = solve_layer(ids, 16, 4, "hypergraph", max_load_ratio=1.05)
    assert res.warning and np.array_equal(np.bincount(res.expert_device_E), [4] * 4)
    with pytest.raises(ValueError, match="max_load_ratio.*must be >= 1"):
        solve_layer(ids, 16, 4, max_load_ratio=0.5)


# ------------------------------------------------------------------ edge cases
def test_experts_never_activated():
    rng = np.random.default_rng(7)
    ids = uniform_trace(3000, 40, 6, seed=rng).layer(0)  # experts 40..63 never picked
    for method in ("contiguous", "greedy", "hypergraph"):
        for bound in (None, 1.2):
            res = solve_layer(ids, 64, 4, method, max_load_ratio=bound)
            assert np.array_equal(np.bincount(res.expert_device_E, minlength=4), [16] * 4)
            assert res.mean_ct == pytest.approx(mean_ct(ids, res.expert_device_E, 4))
    one = np.tile(np.array([[3, 9]]), (10, 1))  # a single expert pair, everything else idle
    res = solve_layer(one, 64, 4, "hypergraph")
    assert res.mean_ct == 1.0


@pytest.mark.parametrize("E, K, D", [(16, 1, 4), (16, 4, 1), (8, 4, 8), (8, 8, 2)])
def test_degenerate_shapes(E, K, D):
    ids = uniform_trace(500, E, K, seed=8).layer(0)
    for method in ("greedy", "hypergraph"):
        res = solve_layer(ids, E, D, method)
        assert np.array_equal(np.bincount(res.expert_device_E, minlength=D), [E // D] * D)
        assert res.mean_ct == pytest.approx(mean_ct(ids, res.expert_device_E, D))


def test_indivisible_experts_raise_a_clear_error():
    trace = uniform_trace(100, 64, 8, seed=9)
    with pytest.raises(PlacementError, match="64 experts cannot be split evenly over 3 devices.*try 1, 2, 4"):
        place(trace, 3)
    with pytest.raises(PlacementError, match="cannot be split evenly"):
        solve_layer(trace.layer(0), 64, 6, "greedy")
    with pytest.raises(ValueError, match="unknown placement method 'best'"):
        place(trace, 4, "best")


def test_place_multi_layer_is_reproducible():
    pt = planted_trace(3000, 32, 4, num_groups=4, num_layers=3, noise=0.2, seed=10)
    a = place(pt.trace, 4, "hypergraph", seed=5, jobs=1)
    b = place(pt.trace, 4, "hypergraph", seed=5, jobs=1)
    assert a.placement == b.placement and a.placement.num_layers == 3 and a.jobs == 1
    for i, layer in enumerate(a.layers):
        assert layer.mean_ct == pytest.approx(mean_ct(pt.trace.layer(i), a.placement.expert_device(i), 4))


def test_place_in_worker_processes_gives_the_same_placement():
    pt = planted_trace(2000, 32, 4, num_groups=4, num_layers=2, noise=0.2, seed=11)
    serial = place(pt.trace, 4, "hypergraph", jobs=1)
    parallel = place(pt.trace, 4, "hypergraph", jobs=2)
    assert parallel.jobs == 2 and parallel.placement == serial.placement


# ------------------------------------------------------------------ Placement helpers
def test_apply_invert_round_trip_bit_for_bit():
    rng = np.random.default_rng()
    E, D, H, F = 16, 4, 24, 8
    p = Placement(np.stack([rng.permutation(np.arange(E) // (E // D)) for _ in range(2)]), D)
    gate_up = torch.randn(E, 2 * F, H, dtype=torch.bfloat16)
    down = torch.randn(E, H, F, dtype=torch.bfloat16)
    router = torch.randn(E, H, dtype=torch.float32)
    router_t = router.t().contiguous()  # [H, E]: experts along dim 1
    for layer in (0, 1):
        for w, dim in ((gate_up, 0), (down, 0), (router, 0), (router_t, 1)):
            placed = p.apply(w, layer, dim)
            assert torch.equal(p.invert(placed, layer, dim), w)
            order = p.placed_order(layer)
            assert torch.equal(placed.select(dim, 0), w.select(dim, int(order[0])))
        shards = [p.shard(gate_up, d, layer) for d in range(D)]
        assert torch.equal(torch.cat(shards), p.apply(gate_up, layer))
        both = p.apply_all({"gate_up": gate_up, "router": router}, layer)
        back = p.invert_all(both, layer)
        assert torch.equal(back["gate_up"], gate_up) and torch.equal(back["router"], router)


def test_remap_ids_matches_permuted_router():
    """Routing with permuted router rows picks the placed-order ids of the same experts."""
    rng = np.random.default_rng(12)
    E, D, H = 16, 4, 32
    p = Placement(rng.permutation(np.arange(E) // 4), D)
    router = torch.randn(E, H)
    x = torch.randn(50, H)
    ids = (x @ router.t()).topk(3, dim=-1).indices
    placed_ids = (x @ p.apply(router).t()).topk(3, dim=-1).indices
    assert torch.equal(p.remap_ids(ids), placed_ids)
    np.testing.assert_array_equal(p.remap_ids(ids.numpy()), placed_ids.numpy())
    idx = p.placed_index()
    np.testing.assert_array_equal(p.placed_order()[idx], np.arange(E))
    np.testing.assert_array_equal(idx // 4, p.expert_device())


def test_json_round_trip(tmp_path):
    rng = np.random.default_rng(13)
    p = Placement(np.stack([rng.permutation(np.arange(64) // 16) for _ in range(3)]), 4)
    path = tmp_path / "p.json"
    p.save(path, extra={"method": "hypergraph", "mean_ct": [1.0, 2.0, 3.0]})
    q = Placement.load(path)
    assert q == p and hash(q) == hash(p)
    doc = json.loads(path.read_text())
    assert doc["method"] == "hypergraph" and doc["num_devices"] == 4 and len(doc["layers"]) == 3


@pytest.mark.parametrize(
    "doc, match",
    [
        ({"num_devices": 4, "num_experts": 8, "layers": [[0, 0, 1, 1, 2, 2, 3, 9]]}, r"device 9 is out of range"),
        ({"num_devices": 4, "num_experts": 8, "layers": [[0, 0, 0, 1, 2, 2, 3, 3]]}, "device 0 holds 3 experts"),
        ({"num_devices": 4, "num_experts": 8}, r"missing key\(s\) \['layers'\]"),
        ({"num_devices": 3, "num_experts": 6, "layers": [[0, 0, 1, 1, 2]]}, "lists 5 experts, but num_experts is 6"),
        ({"num_devices": 3, "num_experts": 8, "layers": [[0] * 8]}, "cannot be split evenly over 3 devices"),
    ],
)
def test_bad_placement_files(tmp_path, doc, match):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(PlacementError, match=match):
        Placement.load(path)


def test_truncated_placement_file(tmp_path):
    path = tmp_path / "t.json"
    Placement.contiguous(8, 2).save(path)
    path.write_text(path.read_text()[:20])
    with pytest.raises(PlacementError, match="not valid JSON.*truncated or corrupted"):
        Placement.load(path)
