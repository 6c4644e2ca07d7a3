"""`benchmarks/cost_check.py`: the cost model fitted on fewer GPUs predicts the runs of more."""

from __future__ import annotations

import json

from _bench_helpers import ROOT, python  # tests/tools/_bench_helpers.py

RESULTS = ROOT / "docs" / "results" / "fourgpu"


def test_fit_on_one_and_two_gpus_predicts_four(tmp_path):
    out = tmp_path / "check.json"
    res = python(
        ROOT / "benchmarks" / "cost_check.py",
        "--fit",
        str(RESULTS / "bench_1gpu_4xH200machine.json"),
        str(RESULTS / "bench_2gpu_4xH200machine.json"),
        "--check",
        str(RESULTS / "bench_4gpu_4xH200machine.json"),
        "--out",
        str(out),
    )
    assert res.returncode == 0, res.stderr[-2000:]
    doc = json.loads(out.read_text())
    rows = {r["point"]: r for r in doc["rows"]}
    assert len(rows) == 16 and doc["constants"]["gemm_tflops"] > 0
    for point, r in rows.items():
        assert r["forward_pred_ms"] > 0 and abs(r["forward_err"] - (r["forward_pred_ms"] / r["forward_ms"] - 1)) < 1e-12
        if point.endswith(" standard"):
            assert r["rows_uniform_pred"] == 8.0
    # two-level: both stages' rows, E[N_T] + E[C_T] of uniform routing, next to what the run sent
    two = rows["4x olmoe random dedup2"]
    assert abs(two["rows_uniform_pred"] - two["rows_per_token"]) < 0.01
    assert "within 15%" in res.stdout
