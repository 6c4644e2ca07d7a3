"""scripts/trace_ops.py: kernels grouped by the torch ops that launched them, on a synthetic trace."""

from __future__ import annotations

import gzip
import json
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import trace_ops  # noqa: E402


def _op(name, ts, dur, tid=1):
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}


def _launch(ts, corr, tid=1):
    return {
        "ph": "X",
        "cat": "cuda_runtime",
        "name": "cudaLaunchKernel",
        "ts": ts,
        "dur": 2,
        "pid": 0,
        "tid": tid,
        "args": {"correlation": corr},
    }


def _kernel(name, ts, dur, corr):
    return {
        "ph": "X",
        "cat": "kernel",
        "name": name,
        "ts": ts,
        "dur": dur,
        "pid": 1,
        "tid": 7,
        "args": {"correlation": corr},
    }


def _trace(base: float) -> list[dict]:
    """The loss's upcast (forward thread) and its backward (autograd thread), a nested op launching twice, a kernel
    with no recorded launch; times shifted by `base`."""
    b = base
    return [
        _op("aten::to", b + 0, 10),
        _op("aten::_to_copy", b + 1, 8),
        _op("aten::copy_", b + 2, 6),
        _launch(b + 3, 1),
        _op("aten::mm", b + 20, 10),
        _launch(b + 21, 2),
        _launch(b + 25, 3),
        _op("ToCopyBackward0", b + 40, 10, tid=2),
        _op("aten::to", b + 41, 8, tid=2),
        _launch(b + 42, 4, tid=2),
        _kernel("direct_copy_kernel", b + 50, 300, 1),
        _kernel("gemm", b + 400, 50, 2),
        _kernel("gemm", b + 460, 50, 3),
        _kernel("bfloat16_copy_kernel", b + 520, 120, 4),
        _kernel("orphan_copy", b + 700, 5, 99),
    ]


def test_kernels_are_grouped_by_their_launching_ops():
    events = _trace(random.uniform(0, 1e6))
    random.shuffle(events)  # order in the file does not matter
    rows = trace_ops.kernels_by_op(events, depth=4)
    assert rows[0] == ("direct_copy_kernel", ("aten::to", "aten::_to_copy", "aten::copy_"), 1, 300)
    assert ("bfloat16_copy_kernel", ("ToCopyBackward0", "aten::to"), 1, 120) in rows
    assert ("gemm", ("aten::mm",), 2, 100) in rows
    assert ("orphan_copy", (), 1, 5) in rows
    assert [r[3] for r in rows] == sorted((r[3] for r in rows), reverse=True)
    inner = trace_ops.kernels_by_op(events, depth=1, match="COPY")
    assert {r[0] for r in inner} == {"direct_copy_kernel", "bfloat16_copy_kernel", "orphan_copy"}
    assert ("direct_copy_kernel", ("aten::copy_",), 1, 300) in inner


def test_the_command_prints_the_table_and_refuses_what_it_cannot_read(tmp_path, capsys):
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _trace(0.0)}, f)
    trace_ops.main([str(path), "--top", "2"])
    out = capsys.readouterr().out
    assert "4 groups, 5 launches, 0.53 ms of kernels" in out and out.count("\n| 0.") == 2
    assert "aten::to > aten::_to_copy > aten::copy_" in out
    with pytest.raises(SystemExit, match="no trace at"):
        trace_ops.main([str(tmp_path / "missing.json")])
    with pytest.raises(SystemExit, match="matching 'nothing'"):
        trace_ops.main([str(path), "--match", "nothing"])
