"""Hierarchical placement (experts -> nodes -> GPUs) on traces with a planted node structure,
nodes in the Placement type and its JSON, E[N_T] in the reports."""

from __future__ import annotations

import json

import numpy as np
import pytest

from occult.placement import Placement, PlacementError
from occult.placement.report import compare_placements, layer_stats
from occult.placement.solvers import place, solve_layer
from occult.placement.stats import analytic_mean_ct, mean_ct
from occult.placement.synthetic import planted_nodes_trace


@pytest.fixture(scope="module")
def two_level():
    """64 experts, top-8, 2 nodes x 4 GPUs: 4 planted groups per node, 30% of picks leave the
    group within the node, 5% leave the node."""
    return planted_nodes_trace(12000, 64, 8, num_nodes=2, groups_per_node=4, num_layers=2, seed=3)


@pytest.fixture(scope="module")
def hier(two_level):
    """`place(..., "hypergraph", num_nodes=2)` on the planted trace: solved once, read by the tests below
    (none changes it)."""
    return place(two_level.trace, 8, "hypergraph", num_nodes=2)


def _nt(ids, p: Placement, layer: int) -> float:
    return mean_ct(ids, p.expert_node(layer), p.num_nodes)


def test_planted_nodes_trace_has_the_structure(two_level):
    ids = two_level.trace.layer(0)
    assert ids.shape == (12000, 8) and all(len(set(r)) == 8 for r in ids[:500].tolist())
    truth = two_level.placement(8, num_nodes=2)
    assert truth.num_nodes == 2 and truth.devices_per_node == 4
    # Node structure: a token's picks mostly stay on its node, far below uniform routing.
    assert _nt(ids, truth, 0) < 1.5 < analytic_mean_ct(64, 8, 2) - 0.3


@pytest.mark.parametrize("method", ["greedy", "hypergraph"])
def test_hierarchical_finds_the_planted_nodes(two_level, hier, method):
    res = hier if method == "hypergraph" else place(two_level.trace, 8, method, num_nodes=2)
    p, truth = res.placement, two_level.placement(8, num_nodes=2)
    assert p.num_nodes == 2
    for layer in range(2):
        ids = two_level.trace.layer(layer)
        node = p.expert_node(layer)
        # The node partition is the planted one (up to naming the nodes).
        true_node = truth.expert_node(layer)
        assert all(len(set(node[true_node == n])) == 1 for n in range(2))
        assert _nt(ids, p, layer) == pytest.approx(_nt(ids, truth, layer))
        assert mean_ct(ids, p.expert_device(layer), 8) <= mean_ct(ids, truth.expert_device(layer), 8) + 1e-9
        assert res.layers[layer].mean_nt == pytest.approx(_nt(ids, p, layer))
        # Device ids are node-major: node n holds devices [4n, 4n + 4), 8 experts each.
        assert np.array_equal(node, p.expert_device(layer) // 4)
        assert np.all(np.bincount(p.expert_device(layer), minlength=8) == 8)


def test_hierarchical_beats_flat_on_nodes(two_level, hier):
    hier = hier.placement  # the solve's placement
    flat = place(two_level.trace, 8, "hypergraph").placement
    flat_nodes = Placement(flat.expert_device_LE, 8, num_nodes=2)  # the flat ids read node-major
    for layer in range(2):
        ids = two_level.trace.layer(layer)
        assert _nt(ids, hier, layer) <= _nt(ids, flat_nodes, layer) + 1e-9
        # The flat solver lowers E[C_T] only: its devices land on nodes by accident.
        assert _nt(ids, hier, layer) < _nt(ids, flat_nodes, layer) - 0.1
    # And E[C_T] is as low as the flat solver's (the GPU level still minimises it).
    assert (
        mean_ct(two_level.trace.layer(0), hier.expert_device(0), 8)
        <= mean_ct(two_level.trace.layer(0), flat.expert_device(0), 8) + 0.05
    )


def test_gpu_level_swaps_stay_inside_nodes(two_level, hier):
    ids = two_level.trace.layer(0)
    nodes = solve_layer(ids, 64, 2, "hypergraph")
    res = hier
    assert res.layers[0].mean_nt == pytest.approx(nodes.mean_ct)
    assert "nodes:" in next(iter(res.layers[0].candidates))


def test_load_bound_and_edge_cases(two_level):
    res = place(two_level.trace, 8, "hypergraph", num_nodes=2, max_load_ratio=1.05)
    assert all(r.load_imbalance <= 1.05 + 1e-9 for r in res.layers)
    # One node is the flat solve; one GPU per node is the node solve.
    one = place(two_level.trace, 8, "greedy", num_nodes=1).placement
    assert one == place(two_level.trace, 8, "greedy").placement
    per_gpu = place(two_level.trace, 2, "greedy", num_nodes=2).placement
    assert per_gpu.num_nodes == 2 and per_gpu.devices_per_node == 1
    with pytest.raises(PlacementError, match="divide"):
        place(two_level.trace, 8, "greedy", num_nodes=3)


def test_json_round_trip_and_old_readers(tmp_path):
    p = Placement.contiguous(16, 4, num_layers=2, num_nodes=2)
    path = tmp_path / "p.json"
    p.save(path)
    doc = json.loads(path.read_text())
    assert doc["num_nodes"] == 2 and Placement.load(path) == p
    # A reader that knows only the three original keys gets the same expert -> device map.
    old = Placement.from_json_dict({k: doc[k] for k in ("num_devices", "num_experts", "layers")})
    assert old.num_nodes == 1 and np.array_equal(old.expert_device_LE, p.expert_device_LE)
    # Flat placements write no node key at all.
    Placement.contiguous(16, 4).save(path)
    assert "num_nodes" not in json.loads(path.read_text())
    with pytest.raises(PlacementError, match="num_nodes"):
        Placement.contiguous(16, 4, num_nodes=3)
    with pytest.raises(PlacementError, match="num_nodes"):
        Placement.from_json_dict({**doc, "num_nodes": "2"})


def test_reports_give_nodes_per_token(two_level):
    trace = two_level.trace
    truth = two_level.placement(8, num_nodes=2)
    s = layer_stats(trace.layer(0), 64, truth)
    assert s.num_nodes == 2 and s.mean_nt == pytest.approx(_nt(trace.layer(0), truth, 0))
    assert sum(s.nt_hist) == s.num_tokens and "mean_nt" in s.summary()
    assert s.bytes_node_dedup_internode < s.bytes_dedup_internode
    rep = compare_placements(trace, truth)
    assert rep["num_nodes"] == 2 and rep["layers"][0]["baseline"]["mean_nt"] > rep["layers"][0]["placement"]["mean_nt"]
    assert rep["overall"]["placement"]["mean_nt"] == pytest.approx(
        np.mean([_nt(trace.layer(i), truth, i) for i in range(2)])
    )
    flat = layer_stats(trace.layer(0), 64, Placement(truth.expert_device_LE, 8))
    assert flat.mean_nt is None and "mean_nt" not in flat.summary()
