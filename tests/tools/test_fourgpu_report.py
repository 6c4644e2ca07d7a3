"""`benchmarks/fourgpu_report.py`: the four-GPU tables and plot from the e2e JSON."""

from __future__ import annotations

from _bench_helpers import ROOT, python  # tests/tools/_bench_helpers.py

SCRIPT = ROOT / "benchmarks" / "fourgpu_report.py"


def test_tables_and_plot_from_the_published_runs(tmp_path):
    md, png = tmp_path / "t.md", tmp_path / "p.png"
    res = python(SCRIPT, str(ROOT / "docs" / "results" / "fourgpu"), "--md", str(md), "--plot", str(png))
    assert res.returncode == 0, res.stderr[-2000:]
    text = md.read_text()
    for shape in ("olmoe", "qwen3"):
        for link in ("nvlink", "slow"):
            assert f"### {shape}, {link}" in text
    assert "| replicated/compile | 43.7 | 1.00 |" in text  # the floor is its own reference
    assert "dedup+placement / dedup, prefill" in text and png.stat().st_size > 10_000


def test_no_runs_is_an_error(tmp_path, monkeypatch, capsys):
    """fourgpu_report.py's `main` in this process (the command's exit status: the test above)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import fourgpu_report

    assert fourgpu_report.main([str(tmp_path)]) == 2 and "no e2e_*_4xH200.json" in capsys.readouterr().err
