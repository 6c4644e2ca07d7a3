"""`benchmarks/serve_plot.py`: latency against throughput from serve.py JSON."""

from __future__ import annotations

import json

from _bench_helpers import ROOT, python  # tests/tools/_bench_helpers.py

SCRIPT = ROOT / "benchmarks" / "serve_plot.py"


def serve_doc(steps: dict[str, dict[int, float]]) -> dict:
    return {
        "variants": {
            v: {str(b): {"ms_p50": ms, "decode_tokens_per_s_per_gpu": b / ms * 1e3} for b, ms in runs.items()}
            for v, runs in steps.items()
        }
    }


def test_table_ratios_and_plot(tmp_path):
    f = tmp_path / "serve_olmoe_nvlink_2xH200.json"
    f.write_text(
        json.dumps(
            serve_doc(
                {
                    "native-generate+compile": {1: 4.0, 64: 80.0},
                    "replicated+compile+graph": {1: 2.0, 64: 10.0},
                    "generate+compile+graph": {1: 3.0, 64: 11.0},
                }
            )
        )
    )
    doc = json.loads(f.read_text())
    doc["variants"]["generate+compile+graph"]["1"]["ms_p99"] = 3.25  # per-step p99 where measured
    f.write_text(json.dumps(doc))
    md, png = tmp_path / "t.md", tmp_path / "p.png"
    res = python(SCRIPT, str(f), "--md", str(md), "--plot", str(png))
    assert res.returncode == 0, res.stderr
    text = md.read_text()
    assert "| generate+compile+graph | 1 | 3.00 | 3.25 | 333 | 1.50 | 1.33 |" in text  # p99, x floor, native / this
    assert "| generate+compile+graph | 64 | 11.00 | - | 5,818 | 1.10 | 7.27 |" in text
    assert png.stat().st_size > 5_000


def test_a_file_that_is_not_a_result_is_exit_2(tmp_path, monkeypatch, capsys):
    """serve_plot.py's `main` in this process (the command's exit status: the test above)."""
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import serve_plot

    assert serve_plot.main([str(bad)]) == 2 and "not a serve.py result" in capsys.readouterr().err
