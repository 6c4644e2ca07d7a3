"""`benchmarks/serve_merge.py`: one serving sweep from several jobs' serve.py JSON.

The first merge runs the script as a command (its entry point and exit status); the other cases call its `main`
in this process (no interpreter start per case), as test_decode_bench.py does for decode.py's refusals."""

from __future__ import annotations

import json

from _bench_helpers import ROOT, python  # tests/tools/_bench_helpers.py

SCRIPT = ROOT / "benchmarks" / "serve_merge.py"


def job(tmp_path, name: str, points: dict[str, dict[int, float]], link: str | None = None, model: str = "olmoe"):
    doc = {
        "config": {"model": model},
        "env": {"world_size": 2, "gpu": "NVIDIA H200", "NCCL_P2P_DISABLE": link},
        "variants": {v: {str(b): {"ms_p50": ms} for b, ms in runs.items()} for v, runs in points.items()},
        "table": [{"variant": v, "batch": b, "ms_p50": ms} for v, runs in points.items() for b, ms in runs.items()],
    }
    path = tmp_path / name
    path.mkdir()
    f = path / "serve_olmoe_nvlink_2gpu.json"  # two jobs' files share a name
    f.write_text(json.dumps(doc))
    return f


def _main(monkeypatch, *argv: str) -> int:
    """serve_merge.py's `main(ARGV)` in this process: its exit status."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import serve_merge

    return serve_merge.main(list(argv))


def test_later_points_win_and_every_point_names_its_job(tmp_path, monkeypatch):
    a = job(tmp_path, "a", {"replicated+compile+graph": {1: 1.8, 64: 5.6}, "generate+compile+graph": {1: 2.3}})
    b = job(tmp_path, "b", {"generate+compile+graph": {1: 2.2, 64: 5.8}, "native-generate+compile": {1: 3.0}})
    doc_a = json.loads(a.read_text())
    doc_a["variants"]["generate+compile+graph"]["256"] = {"skipped": "cut"}  # not a point: b cannot lose to it
    a.write_text(json.dumps(doc_a))
    out = tmp_path / "merged.json"
    res = python(SCRIPT, str(a), str(b), "--out", str(out))
    assert res.returncode == 0, res.stderr
    merged = json.loads(out.read_text())
    ep = merged["variants"]["generate+compile+graph"]
    assert ep["1"] == {"ms_p50": 2.2, "source": str(b)} and ep["64"]["source"] == str(b) and "256" not in ep
    assert merged["variants"]["replicated+compile+graph"]["64"] == {"ms_p50": 5.6, "source": str(a)}
    assert merged["sources"][str(a)] == ["replicated+compile+graph B=1", "replicated+compile+graph B=64"]
    assert len(merged["table"]) == 5 and {r["ms_p50"] for r in merged["table"]} == {1.8, 5.6, 2.2, 5.8, 3.0}
    assert not list(tmp_path.glob("merged.json.tmp*"))
    code = _main(monkeypatch, str(a), str(b), "--out", str(out), "--variants", "generate+compile+graph")
    assert code == 0 and list(json.loads(out.read_text())["variants"]) == ["generate+compile+graph"]


def test_another_link_or_model_is_refused(tmp_path, monkeypatch, capsys):
    a = job(tmp_path, "a", {"replicated+compile+graph": {1: 1.8}})
    for i, (link, model) in enumerate([("1", "olmoe"), (None, "qwen3")]):
        b = job(tmp_path, f"b{i}", {"replicated+compile+graph": {1: 1.9}}, link=link, model=model)
        out = tmp_path / f"m{i}.json"
        code = _main(monkeypatch, str(a), str(b), "--out", str(out))
        err = capsys.readouterr().err
        assert code == 2 and "merge only one model, GPU and link" in err and not out.exists()
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    code = _main(monkeypatch, str(a), str(bad), "--out", str(tmp_path / "x.json"))
    assert code == 2 and "not a serve.py result" in capsys.readouterr().err
