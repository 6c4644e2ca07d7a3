"""The main job (`occult demo`) and `occult bench` run end to end on CPU ranks and check themselves."""

from __future__ import annotations

import json
import subprocess
import sys


def _occult(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "occult", *args], capture_output=True, text=True, timeout=timeout)


def test_demo_runs_and_variants_agree():
    proc = _occult("demo", "--world-size", "2", "--tokens", "96", "--steps", "1",
                   "--hidden", "32", "--ffn", "16", "--experts", "8", "--top-k", "4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "All variants match the dense reference" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.split() and line.split()[0] in ("standard", "dedup", "dedup+placement")}
    assert set(rows) == {"standard", "dedup", "dedup+placement"}
    sent = {name: int(r[2]) for name, r in rows.items()}
    assert sent["standard"] == 2 * 2 * 96 * 4  # dispatch + combine, T*k rows on each of 2 ranks
    assert sent["dedup+placement"] <= sent["dedup"] < sent["standard"]


def test_bench_smoke_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    proc = _occult("bench", "--world-size", "2", "--tokens", "64", "--iters", "1", "--warmup", "1",
                   "--input-sets", "1", "--overlap-chunks", "1,2", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    runs = {(r["routing"], r["variant"]): r for r in result["runs"]}
    assert len(runs) == 12  # 2 routings x 3 variants x (unpipelined, 2 chunks)
    for r in runs.values():
        assert r["rel_error"] < 1e-4
    for (routing, variant), r in runs.items():  # pipelining sends exactly the same rows
        if variant.endswith("/c2"):
            assert r["mean_ct"] == runs[(routing, variant[:-3])]["mean_ct"]
            assert r["forward_bytes_per_rank"] == runs[(routing, variant[:-3])]["forward_bytes_per_rank"]
    assert runs[("random", "standard")]["mean_ct"] == 4.0  # tiny shape: top-4
    assert runs[("random", "dedup")]["mean_ct"] < 4.0


def test_bench_two_level_on_simulated_nodes(tmp_path):
    out = tmp_path / "bench.json"
    proc = _occult("bench", "--world-size", "4", "--nodes", "2", "--variants", "dedup,dedup2", "--routing", "random",
                   "--tokens", "32", "--iters", "1", "--warmup", "1", "--input-sets", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = {r["variant"]: r for r in json.loads(out.read_text())["runs"]}
    assert runs["dedup2"]["rel_error"] < 1e-4 and runs["dedup"]["rel_error"] < 1e-4


def test_bench_rejects_bad_shape():
    proc = _occult("bench", "--shapes", "nope")
    assert proc.returncode != 0 and "unknown shape" in (proc.stdout + proc.stderr)
    proc = _occult("bench", "--world-size", "2", "--nodes", "3")
    assert proc.returncode != 0 and "--nodes 3" in (proc.stdout + proc.stderr)
    proc = _occult("bench", "--overlap-chunks", "0")
    assert proc.returncode != 0 and "--overlap-chunks" in (proc.stdout + proc.stderr)
