"""scripts/targets_report.py: the issues' targets checked against benchmark JSON (synthetic reports)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import targets_report  # noqa: E402

sys.path.pop(0)


def e2e(model: str, world: int, slow: bool, ms: dict[str, tuple[float, float]], failed: tuple = ()) -> dict:
    """An e2e.py report: variant -> (prefill ms, train ms)."""
    return {"config": {"model": model}, "env": {"world_size": world, "NCCL_P2P_DISABLE": "1" if slow else None},
            "variants": {v: {"check": {"passed": v not in failed},
                             "phases": {"prefill": {"ms_median": p}, "train": {"ms_median": t}}}
                         for v, (p, t) in ms.items()}}


def rows_of(table: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]


def test_verdicts_for_each_kind_of_report(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "nvlink.json").write_text(json.dumps(e2e("olmoe", 4, False, {
        "replicated": (100.0, 290.0), "standard": (106.0, 291.0), "dedup": (101.0, 300.0)})))
    (tmp_path / "a" / "slow.json").write_text(json.dumps(e2e("olmoe", 4, True, {
        "replicated": (100.0, 290.0), "standard": (335.0, 737.0), "dedup": (199.0, 459.0),
        "dedup+placement": (110.0, 320.0)}, failed=("dedup+placement",))))  # a failed check never counts
    (tmp_path / "peer.json").write_text(json.dumps(e2e("qwen3", 2, False, {
        "replicated": (50.0, 150.0), "standard": (60.0, 170.0), "dedup": (55.0, 160.0), "torchtitan": (70.0, 240.0)})))
    (tmp_path / "bench.json").write_text(json.dumps({"ceilings": {}, "runs": [
        {"variant": "dedup", "forward_ms": 3.3, "floor_ms": 3.0, "shape": "olmoe", "routing": "random", "world": 4},
        {"variant": "standard", "forward_ms": 9.0, "floor_ms": 3.0, "shape": "olmoe", "routing": "random", "world": 4}]}))
    (tmp_path / "peers.json").write_text(json.dumps({"runs": [
        {"peer": "occult-dedup", "status": "ok", "fwd_bwd_ms": 5.0, "world": 4, "shape": "olmoe", "tokens": 8192},
        {"peer": "megatron", "status": "ok", "fwd_bwd_ms": 8.0, "world": 4, "shape": "olmoe", "tokens": 8192},
        {"peer": "deepspeed", "status": "failed", "fwd_bwd_ms": None, "world": 4, "shape": "olmoe", "tokens": 8192}]}))
    for v, tps in (("floor", 9000.0), ("standard", 6000.0), ("dedup", 7500.0)):
        (tmp_path / f"train_4gpu_slow_{v}.json").write_text(json.dumps(
            {"step": 40, "train_tokens_per_s_per_rank": tps, "link": "slow", "variant": v, "gpus": 4}))
    (tmp_path / "kernels.json").write_text(json.dumps({"info": {"device": "NVIDIA H200"}, "shapes": {
        "olmoe": {"summary": {"gemms_bwd_tflops": 600.0, "dense_bwd_tflops": 750.0}},
        "qwen3moe": {"summary": {"gemms_bwd_tflops": 450.0, "dense_bwd_tflops": 700.0}}}}))
    (tmp_path / "junk.json").write_text("{not json")
    got = {(r[0], r[3].split(" ")[0]): (r[1], r[2]) for r in rows_of(targets_report.report([str(tmp_path)]))}
    assert got[("14: best dedup prefill within 1.02x of the floor", "nvlink.json")] == ("1.010x (dedup)", "met")
    assert got[("14: best dedup train within 1.02x of the floor", "nvlink.json")][1] == "MISSED"
    assert got[("14: dedup >= standard (train)", "nvlink.json")] == ("300.0 vs 291.0 ms", "MISSED")
    assert got[("14: dedup >= standard (prefill)", "nvlink.json")][1] == "met"
    assert got[("14: best dedup prefill within 1.15x of the floor", "slow.json")] == ("1.990x (dedup)", "MISSED")
    assert got[("14: dedup train >= 2.3x faster than standard", "slow.json")] == ("1.61x (dedup)", "MISSED")
    train = got[("15: training step >= 1.3x the whole-model peer (TorchTitan, qwen3)", "peer.json")]
    assert train == ("1.50x (dedup 160.0 vs 240.0 ms)", "met")
    assert got[("14: layer forward within 1.2x of its floor (olmoe, random routing)", "bench.json")] == ("1.10x", "met")
    assert got[("14: layer fwd+bwd >= 2.0x the fastest peer (olmoe, 8192 tokens)", "peers.json")] == ("1.60x (vs megatron)", "MISSED")
    assert got[("15: occult train tokens/s per GPU (OccultLM; floor = EP size 1)", "train_*.json")] == (
        "floor 9,000; standard 6,000; dedup 7,500; dedup/standard 1.25x; dedup/floor 0.83x", "-")
    assert got[("14: backward grouped GEMMs >= 75% of dense cuBLAS (olmoe)", "kernels.json")] == ("80% (600 / 750 TF/s)", "met")
    assert got[("14: backward grouped GEMMs >= 75% of dense cuBLAS (qwen3moe)", "kernels.json")][1] == "MISSED"
    assert not any(v[1] == "not measured" for v in got.values())


def test_one_gpu_is_not_a_verdict_and_missing_runs_are_listed(tmp_path):
    (tmp_path / "one.json").write_text(json.dumps(e2e("olmoe", 1, False, {"replicated": (76.0, 264.0), "dedup": (76.5, 262.0)})))
    (tmp_path / "peer1.json").write_text(json.dumps(e2e("qwen3", 1, False, {"replicated": (40.0, 170.0), "torchtitan": (46.0, 200.0)})))
    rows = rows_of(targets_report.report([str(tmp_path)]))
    assert [r[2] for r in rows if r[3].startswith("one.json")] == ["n/a (1 GPU)"] * 2
    peer = [r for r in rows if r[3].startswith("peer1.json") and r[0].startswith("15:")]
    assert [(r[1], r[2]) for r in peer] == [("1.18x (replicated 170.0 vs 200.0 ms)", "n/a (1 GPU)")]
    missing = {r[0] for r in rows if r[2] == "not measured"}
    assert "14: best dedup ..." in missing and "15: training step ..." in missing


def test_cli_writes_markdown_and_rejects_a_missing_path(tmp_path):
    (tmp_path / "one.json").write_text(json.dumps(e2e("olmoe", 2, False, {"replicated": (76.0, 264.0), "dedup": (76.5, 262.0)})))
    md = tmp_path / "t.md"
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "targets_report.py"), str(tmp_path), "--md", str(md)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and md.read_text().strip() == res.stdout.strip()
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "targets_report.py"), str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "no such file or directory" in res.stderr
