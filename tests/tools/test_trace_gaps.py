"""scripts/trace_gaps.py: the GPU's idle gaps in a profiler timeline and the host ops begun inside them."""

from __future__ import annotations

import gzip
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import trace_gaps  # noqa: E402


def kernel(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_gaps_merge_overlapping_device_work_and_collect_the_host_ops_inside(tmp_path: Path) -> None:
    idle = random.uniform(400.0, 900.0)  # microseconds
    events = [
        kernel("gemm", 0.0, 100.0),
        kernel("copy", 50.0, 100.0, "gpu_memcpy"),  # overlaps the gemm: one span, 0-150
        kernel("attention", 150.0 + 10.0, 40.0),  # a 10 us gap: below the threshold
        kernel("dispatch", 200.0 + idle, 20.0),  # the idle gap: 200 .. 200 + idle
        {"ph": "X", "cat": "user_annotation", "name": "occult::agree", "ts": 205.0, "dur": 4.0},
        {"ph": "X", "cat": "cpu_op", "name": "launch_dispatch", "ts": 210.0, "dur": idle - 20.0},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 212.0, "dur": 3.0},  # not a host op
        {"ph": "X", "cat": "cpu_op", "name": "before_the_gap", "ts": 10.0, "dur": 5.0},
        {"ph": "i", "cat": "cpu_op", "name": "instant", "ts": 220.0},  # not a complete event: ignored
    ]
    path = tmp_path / "step_trace_rank0.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    found = trace_gaps.gaps(trace_gaps.load_events(path), min_us=300.0)
    assert len(found) == 1
    assert abs(found[0]["us"] - idle) < 1e-6 * idle
    assert (found[0]["before"], found[0]["after"]) == ("attention", "dispatch")
    assert [e["name"] for e in found[0]["host_ops"]] == ["occult::agree", "launch_dispatch"]
    text = trace_gaps.report(path, 300.0, 5)
    assert "1 gaps > 300 us" in text and "launch_dispatch" in text and "before_the_gap" not in text


def test_a_file_that_is_not_a_trace_is_one_line_and_status_2(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "notes.json"
    bad.write_text("{}")
    assert trace_gaps.main([str(bad)]) == 2
    assert "is not a Chrome trace" in capsys.readouterr().err
    assert trace_gaps.main([str(tmp_path / "missing.json.gz")]) == 2
    assert "is not a file" in capsys.readouterr().err
