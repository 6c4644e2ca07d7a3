"""Collaboration statistics against brute force and against the analytic E[C_T] of uniform routing."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from occult.placement import Placement, PlacementError
from occult.placement.report import compare_placements, layer_stats, trace_stats
from occult.placement.stats import (
    analytic_mean_ct,
    busiest_device_share,
    coactivation,
    collaboration,
    comm_bytes,
    device_presence,
    devices_per_token,
    element_size,
    expert_load,
    mean_ct,
)
from occult.placement.synthetic import planted_trace, uniform_trace


def _random_placement(E: int, D: int, rng: np.random.Generator) -> np.ndarray:
    return rng.permutation(np.arange(E) // (E // D))


def test_analytic_olmoe_shape():
    # 4 * (1 - C(48,8) / C(64,8)), the brief's 3.66
    assert analytic_mean_ct(64, 8, 4) == pytest.approx(4 * (1 - math.comb(48, 8) / math.comb(64, 8)), abs=1e-12)
    assert round(analytic_mean_ct(64, 8, 4), 2) == 3.66
    assert analytic_mean_ct(64, 8, 1) == 1.0
    assert analytic_mean_ct(64, 1, 8) == pytest.approx(1.0)
    assert analytic_mean_ct(64, 8, 64) == pytest.approx(8.0)  # one expert per device: C_T = k
    with pytest.raises(PlacementError, match="divisible"):
        analytic_mean_ct(64, 8, 3)


@pytest.mark.parametrize("E, k, D", [(8, 3, 2), (8, 3, 4), (12, 4, 3), (9, 2, 3)])
def test_analytic_matches_exhaustive_enumeration(E, k, D):
    """Exact expectation over all C(E, k) equally likely expert sets."""
    dev = np.arange(E) // (E // D)
    cts = [len(set(dev[list(c)])) for c in itertools.combinations(range(E), k)]
    assert analytic_mean_ct(E, k, D) == pytest.approx(np.mean(cts), abs=1e-12)


def test_uniform_trace_contiguous_matches_analytic_366():
    """Acceptance: uniform random routing, 64 experts, top-8, 4 devices, contiguous."""
    trace = uniform_trace(100_000, 64, 8, seed=np.random.SeedSequence().entropy % 2**32)
    measured = mean_ct(trace.layer(0), Placement.contiguous(64, 4).expert_device(0), 4)
    assert abs(measured - analytic_mean_ct(64, 8, 4)) < 0.02
    assert abs(measured - 3.66) < 0.02


@pytest.mark.parametrize("E, k, D", [(32, 4, 8), (128, 8, 8), (16, 2, 2), (64, 6, 16), (60, 5, 3)])
def test_analytic_matches_simulation(E, k, D):
    rng = np.random.default_rng()
    trace = uniform_trace(40_000, E, k, seed=rng)
    # any balanced placement: under uniform routing E[C_T] does not depend on it
    ct = devices_per_token(trace.layer(0), _random_placement(E, D, rng), D)
    se = ct.std() / math.sqrt(len(ct))
    assert abs(ct.mean() - analytic_mean_ct(E, k, D)) < max(5 * se, 1e-9)


def test_coactivation_and_load_against_brute_force():
    rng = np.random.default_rng(0)
    trace = uniform_trace(500, 12, 3, seed=rng)
    ids = trace.layer(0)
    C = coactivation(ids, 12)
    ref = np.zeros((12, 12), dtype=np.int64)
    for row in ids:
        for a in row:
            for b in row:
                ref[a, b] += 1
    np.testing.assert_array_equal(C, ref)
    np.testing.assert_array_equal(expert_load(ids, 12), np.diag(ref))
    w = rng.integers(1, 7, size=len(ids))
    refw = np.zeros((12, 12))
    for row, wt in zip(ids, w):
        refw[np.ix_(row, row)] += wt
    np.testing.assert_allclose(coactivation(ids, 12, w), refw)
    np.testing.assert_array_equal(coactivation(torch.from_numpy(ids.astype(np.int64)), 12), ref)


def test_devices_per_token_and_collaboration_against_brute_force():
    rng = np.random.default_rng(1)
    trace = uniform_trace(400, 16, 5, seed=rng)
    ids = trace.layer(0)
    dev = _random_placement(16, 4, rng)
    ct = devices_per_token(ids, dev, 4)
    np.testing.assert_array_equal(ct, [len(set(dev[row])) for row in ids])
    pres = device_presence(ids, dev, 4)
    np.testing.assert_array_equal(pres.sum(1), ct)
    intra = sum(dev[a] == dev[b] for row in ids for a, b in itertools.combinations(row, 2))
    i, o = collaboration(coactivation(ids, 16), dev)
    assert i == intra and i + o == len(ids) * 5 * 4 / 2
    w = rng.integers(1, 4, size=len(ids))
    assert mean_ct(ids, dev, 4, w) == pytest.approx((ct * w).sum() / w.sum())


def test_layer_stats_fields_and_bytes():
    rng = np.random.default_rng(2)
    T, E, K, D, H = 3000, 32, 4, 4, 1024
    ids = uniform_trace(T, E, K, seed=rng).layer(0)
    p = Placement(_random_placement(E, D, rng), D)
    s = layer_stats(ids, E, p, hidden=H, dtype="bf16")
    ct = devices_per_token(ids, p.expert_device(0), D)
    assert s.mean_ct == pytest.approx(ct.mean())
    assert s.rows_standard == T * K and s.rows_dedup == ct.sum()
    assert s.bytes_standard == 2 * T * K * H * 2 and s.bytes_dedup == 2 * ct.sum() * H * 2
    assert s.bytes_dedup_remote == pytest.approx(s.bytes_dedup * (D - 1) / D)
    assert s.bytes_standard_remote == pytest.approx(s.bytes_standard * (D - 1) / D)
    assert sum(s.ct_hist) == T and len(s.ct_hist) == min(K, D)
    assert np.dot(np.arange(1, len(s.ct_hist) + 1), s.ct_hist) == ct.sum()
    assert sum(s.device_load_D) == T * K and sum(s.device_rows_D) == ct.sum()
    loads = np.bincount(p.expert_device(0), weights=np.bincount(ids.ravel(), minlength=E), minlength=D)
    assert s.load_imbalance == pytest.approx(loads.max() / loads.mean())
    assert 0 < s.intra_ratio < 1 and s.intra + s.inter == T * K * (K - 1) / 2
    assert s.summary()["mean_ct"] == s.mean_ct and "ct_hist" in s.to_dict()
    fp32 = layer_stats(ids, E, p, hidden=H, dtype=torch.float32)
    assert fp32.bytes_dedup == 2 * s.bytes_dedup and fp32.dtype == "float32"


def test_busiest_device_share_against_brute_force():
    """The share of tokens that use the busiest device: the least sync_free_capacity that drops no copy."""
    seed = int(np.random.SeedSequence().entropy % 2**32)  # fresh draws; the seed is in any failure's message
    rng = np.random.default_rng(seed)
    T, E, K, D = int(rng.integers(1, 500)), 16, int(rng.integers(1, 9)), 4
    ids = uniform_trace(T, E, K, seed=rng).layer(0)
    dev = _random_placement(E, D, rng)
    want = max(sum(d in set(dev[row]) for row in ids) for d in range(D)) / T
    assert busiest_device_share(ids, dev, D) == pytest.approx(want), seed
    s = layer_stats(ids, E, dev, D)
    assert s.busiest_device_share == pytest.approx(want) == max(s.device_rows_D) / T
    assert s.summary()["busiest_device_share"] == s.busiest_device_share
    assert busiest_device_share(ids[:0], dev, D) == 0.0  # no tokens: no rows
    contiguous = Placement.contiguous(E, D, 1).expert_device(0)
    assert busiest_device_share(np.arange(E // D)[None], contiguous, D) == 1.0  # one token's experts on one device


def test_element_size():
    assert [element_size(d) for d in ("bf16", "fp16", "float32", "fp8", "torch.bfloat16")] == [2, 2, 4, 1, 2]
    assert element_size(torch.float64) == 8 and element_size(np.float16) == 2
    assert comm_bytes(10, 4, "fp32") == 2 * 10 * 4 * 4
    with pytest.raises(ValueError, match="unknown dtype 'int3'"):
        element_size("int3")


def test_trace_stats_and_compare():
    pt = planted_trace(4000, 32, 4, num_groups=4, num_layers=3, noise=0.1, seed=3)
    planted = pt.placement(4)
    ts = trace_stats(pt.trace, planted, hidden=64)
    assert len(ts.layers) == 3
    assert ts.mean_ct == pytest.approx(np.mean([s.mean_ct for s in ts.layers]))  # equal tokens per layer
    rep = compare_placements(pt.trace, planted, hidden=64)
    assert rep["overall"]["placement"]["mean_ct"] == pytest.approx(ts.mean_ct)
    base = rep["overall"]["baseline"]["mean_ct"]
    assert base > 2 * ts.mean_ct > 0
    assert rep["overall"]["reduction"] == pytest.approx(1 - ts.mean_ct / base)
    assert rep["layers"][1]["placement"]["bytes_dedup"] == ts.layers[1].bytes_dedup
    shares = [layer.busiest_device_share for layer in ts.layers]
    assert rep["overall"]["placement"]["busiest_device_share"] == max(shares)  # one capacity for every layer
    assert rep["layers"][2]["placement"]["busiest_device_share"] == shares[2]
    with pytest.raises(PlacementError, match="the placement has 1 layer.*trace has 3"):
        trace_stats(pt.trace, planted.layer(0))
    with pytest.raises(PlacementError, match="placement is for 64 experts.*trace has 32"):
        trace_stats(pt.trace, Placement.contiguous(64, 4, 3))


def test_stats_of_one_million_tokens_add_up_over_its_halves():
    """1M tokens, top-8, 64 experts, in one call (the vectorised path at scale; its speed is `occult stats`'s, not
    a test's): the counts are the sums of the two halves' and the mean C_T their token-weighted mean."""
    ids = uniform_trace(1_000_000, 64, 8, seed=int(torch.randint(0, 2**31 - 1, ()).item())).layer(0)
    p = Placement.contiguous(64, 4)
    whole, first, second = layer_stats(ids, 64, p), layer_stats(ids[:400_000], 64, p), layer_stats(ids[400_000:], 64, p)
    assert whole.num_tokens == 1_000_000
    assert [a + b for a, b in zip(first.ct_hist, second.ct_hist)] == whole.ct_hist
    assert [a + b for a, b in zip(first.expert_load_E, second.expert_load_E)] == whole.expert_load_E
    assert [a + b for a, b in zip(first.device_rows_D, second.device_rows_D)] == whole.device_rows_D
    assert whole.rows_dedup == first.rows_dedup + second.rows_dedup
    mean = (4 * first.mean_ct + 6 * second.mean_ct) / 10
    assert abs(whole.mean_ct - mean) < 1e-9 * whole.mean_ct
