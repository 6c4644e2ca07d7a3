"""scripts/trace_exchanges.py: each exchange kernel of one profiled step, and the part no compute kernel covers."""

from __future__ import annotations

import gzip
import json
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import trace_exchanges  # noqa: E402


def kernel(name: str, ts: float, dur: float, stream: int = 7) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def one_step(t0: float, a: float, b: float) -> list[dict]:
    """A step at t0 (us): compute [0, 100), an all-to-all [100 - a, 200 - a) (a us under the compute), compute
    [300, 300 + b), an all-reduce [300, 400) (b us under it), then a push kernel [500, 510) with nothing under it."""
    return [
        kernel("nvjet_gemm", t0, 100.0),
        kernel("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", t0 + 100.0 - a, 100.0, stream=9),
        kernel("_swiglu_kernel", t0 + 300.0, b),
        kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(x)", t0 + 300.0, 100.0, stream=11),
        kernel("_push_kernel", t0 + 500.0, 10.0),
    ]


def test_each_exchange_of_the_chosen_step_and_its_exposed_part(tmp_path: Path, capsys) -> None:
    a, b = random.uniform(0.0, 100.0), random.uniform(0.0, 100.0)
    events = one_step(0.0, 0.0, 0.0) + one_step(10_000.0, a, b) + one_step(20_000.0, 0.0, 0.0)
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 10_050.0, "dur": 500.0})  # host: ignored
    random.shuffle(events)  # the trace's order is not time order
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    rows = trace_exchanges.exchange_rows(trace_exchanges.step_kernels(trace_exchanges.load_events(path), 3, 1))
    assert [trace_exchanges.kind(r["name"]) for r in rows] == ["SendRecv", "AllReduce_Sum_bf16_RING_LL", "_push_kernel"]
    assert [r["stream"] for r in rows] == [9, 11, 7]
    got = [v for r in rows for v in (r["start_ms"], r["ms"], r["exposed_ms"])]
    want = [(100.0 - a) / 1e3, 0.1, (100.0 - a) / 1e3, 0.3, 0.1, (100.0 - b) / 1e3, 0.5, 0.01, 0.01]
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert trace_exchanges.main([str(path), "--steps", "3", "--top", "2"]) == 0  # the middle step: the same one
    out = capsys.readouterr().out
    assert "all exchanges" in out and f"{(100.0 - a) / 1e3 + (100.0 - b) / 1e3 + 0.01:8.2f}" in out


def test_the_host_transports_copies_are_exchanges_and_other_copies_compute(tmp_path: Path) -> None:
    a = random.uniform(0.0, 50.0)
    step = [
        kernel("nvjet_gemm", 0.0, 100.0),
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 100.0 - a, "dur": 60.0},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 160.0, "dur": 40.0},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": 170.0, "dur": 10.0},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": step}))
    rows = trace_exchanges.exchange_rows(trace_exchanges.step_kernels(trace_exchanges.load_events(path), 1, 0))
    assert [trace_exchanges.kind(r["name"]) for r in rows] == ["Memcpy DtoH", "Memcpy HtoD"]
    assert [r["exposed_ms"] for r in rows] == pytest.approx([(60.0 - a) / 1e3, 0.03], rel=1e-9)


def test_a_steps_compute_idle_time_by_what_runs_under_it():
    t0, gap = random.uniform(0.0, 1e6), random.uniform(1.0, 50.0)
    copy = {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": t0 + 80.0, "dur": 70.0}
    step = [
        kernel("nvjet_gemm", t0, 100.0),
        copy,  # [80, 150): under compute until 100, then alone until the all-reduce starts
        kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(x)", t0 + 140.0, 60.0, stream=11),  # [140, 200)
        kernel("_swiglu_kernel", t0 + 200.0 + gap, 20.0),  # after `gap` us of nothing
    ]
    idle = trace_exchanges.idle_breakdown(step)
    want = {
        "step_ms": (220.0 + gap) / 1e3,
        "compute_ms": 0.12,
        "idle_ms": (100.0 + gap) / 1e3,
        "copies_alone_ms": 0.04,
        "exchange_kernels_alone_ms": 0.05,
        "both_ms": 0.01,
        "nothing_ms": gap / 1e3,
    }
    assert idle == pytest.approx(want, rel=1e-6, abs=1e-9)
    assert "exchange copies alone 0.04" in trace_exchanges.idle_line(idle)


def test_a_trace_that_does_not_split_into_the_steps_is_refused(tmp_path: Path, capsys) -> None:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": one_step(0.0, 0.0, 0.0) + one_step(1000.0, 0.0, 0.0)}))
    with pytest.raises(SystemExit) as exc:
        trace_exchanges.main([str(path), "--steps", "3"])
    assert exc.value.code == 2 and "do not split into 3 steps" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        trace_exchanges.main([str(path), "--steps", "2", "--step", "2"])
    assert "--step must be in [0, 2)" in capsys.readouterr().err


def test_stalls_list_each_stretch_without_compute_what_runs_under_it_and_what_starts_at_its_end(tmp_path, capsys):
    stall = random.uniform(2_000.0, 5_000.0)  # us
    step = [
        kernel("nvjet_gemm", 0.0, 100.0),
        kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(x)", 50.0, stall + 200.0, stream=11),  # from under the gemm
        kernel("void at::native::(anonymous namespace)::CatArrayBatchedCopy<float, 4>(x)", 100.0 + stall, 5.0, 3),
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 110.0 + stall, "dur": 20.0},
        kernel("_gather_pair_rows_kernel", 200.0 + stall, 50.0),  # 70 us after the copy: a stretch under the limit
    ]
    rows = trace_exchanges.stalls(step, min_ms=1.0)
    assert len(rows) == 1
    assert rows[0]["start_ms"] == pytest.approx(0.1) and rows[0]["ms"] == pytest.approx(stall / 1e3)
    assert rows[0]["under"] == ["AllReduce_Sum_bf16_RING_LL"]
    assert rows[0]["then"] == [(3, "at::native::CatArrayBatchedCopy"), (None, "Memcpy DtoH")]  # within 0.05 ms
    assert trace_exchanges.stalls(step, min_ms=stall / 1e3 + 0.01) == []
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": step}))
    assert trace_exchanges.main([str(path), "--steps", "1", "--stalls", "1"]) == 0
    assert f"{stall / 1e3:6.2f} ms at 0.10 ms  under it: AllReduce_Sum_bf16_RING_LL" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        trace_exchanges.main([str(path), "--steps", "1", "--stalls", "0"])
