"""The MoE-layer cost model: row splits per link level, and its fit to the measured one-node runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from occult.placement.cost import SHAPES, CostConstants, fit, layer_time, measured_from_bench, rows_per_token, validate

REPO = Path(__file__).resolve().parents[2]


def test_rows_split_over_link_levels():
    s = SHAPES["olmoe"]
    for v in ("standard", "dedup"):
        r = rows_per_token(v, s, 16, 2, 5.0, 1.5)
        assert sum(r.values()) == pytest.approx(8.0 if v == "standard" else 5.0)
        assert r["inter"] == pytest.approx(sum(r.values()) / 2)  # half the GPUs are on the other node
    two = rows_per_token("two_level", s, 16, 2, 5.0, 1.5)
    assert two["inter"] == pytest.approx(0.75) and two["local"] + two["intra"] == pytest.approx(5.0)
    one = CostConstants(480, 1.5, 0.01, 2000, 300, 40, 1.0, 1.8)
    # On one node the two-level dispatch is the flat one; more inter-node bandwidth never hurts.
    assert layer_time(s, 8192, 8, 1, "two_level", one, 3.0, 1.0) == layer_time(s, 8192, 8, 1, "dedup", one, 3.0, 1.0)
    slow = layer_time(s, 8192, 32, 4, "dedup", one)["forward_ms"]
    fast = layer_time(s, 8192, 32, 4, "dedup", CostConstants(**{**one.to_dict(), "internode_GBps": 80}))["forward_ms"]
    assert fast < slow


def test_fit_to_the_measured_runs():
    pts = []
    for w in (1, 2, 4):
        pts += measured_from_bench(json.loads((REPO / f"docs/results/bench_{w}xH200.json").read_text()))
    c = fit(pts)
    assert 400 < c.gemm_tflops < 560 and 200 < c.nvlink_GBps < 400
    rows = validate(pts, c)
    assert len(rows) == 26
    # docs/history.md: the first dedup variant of a shape under random routing ran ~0.6 ms slow
    # (an anomaly nobody chased); every other point is within 15%.
    anomalies = {"4x olmoe random dedup", "4x qwen3 random dedup"}
    for r in rows:
        assert abs(r["fwd_bwd_err"]) < 0.15, r
        if r["point"] not in anomalies:
            assert abs(r["forward_err"]) < 0.15, r
