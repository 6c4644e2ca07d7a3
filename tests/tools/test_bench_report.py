"""`occult bench`'s report: the layer's forward and backward MFU from its expert FLOPs and times."""

from __future__ import annotations

import random

import pytest

from occult.tools.bench_report import layer_mfu, summarize


def _run(variant: str, gflop: float, fwd_ms: float, fwd_bwd_ms: float) -> dict:
    return {
        "shape": "olmoe",
        "routing": "random",
        "tokens": 8192,
        "variant": variant,
        "mean_ct": 2.0,
        "forward_ms": fwd_ms,
        "fwd_bwd_ms": fwd_bwd_ms,
        "floor_ms": 1.0,
        "expert_ms": 1.0,
        "all_to_all_ms": 0.0,
        "all_to_all_GBps": 0.0,
        "expert_tflops": 1.0,
        "rel_error": 1e-3,
        "host_syncs_fwd_bwd": 0,
        "expert_gflop_fwd": gflop,
    }


def test_forward_and_backward_mfu_are_the_expert_flops_over_each_pass():
    gflop, fwd, bwd, peak = random.uniform(100, 900), random.uniform(1, 3), random.uniform(2, 6), 777.0
    mfu = layer_mfu(_run("dedup", gflop, fwd, fwd + bwd), peak)
    assert mfu == pytest.approx((gflop / fwd / peak, 2 * gflop / bwd / peak))
    assert layer_mfu(_run("dedup", gflop, fwd, fwd), peak) is None  # no backward time measured
    assert layer_mfu({**_run("dedup", gflop, fwd, fwd + bwd), "expert_gflop_fwd": None}, peak) is None  # older file


def test_the_report_shows_mfu_where_a_matmul_rate_was_measured():
    runs = [_run("standard", 412.3, 2.0, 6.0), _run("dedup", 412.3, 1.5, 5.5)]
    text = summarize({"runs": runs, "ceilings": {"matmul_tflops": 800.0}})
    lines = text[text.index("layer MFU") :].splitlines()
    assert lines[1].split()[-3:] == ["25.8%", "/", "25.8%"]  # 412.3 / 2.0 / 800, 2 x 412.3 / 4.0 / 800
    assert lines[2].split()[-3:] == ["34.4%", "/", "25.8%"]
    assert "layer MFU" not in summarize({"runs": runs, "ceilings": {}})  # CPU runs: no rate measured
