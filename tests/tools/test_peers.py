"""benchmarks/peers: the driver's arguments, the report, and each installed peer on 2 gloo CPU ranks (one driver
run over them all).

A peer that is not installed (Megatron-Core, DeepSpeed, TorchTitan; transformers older than 5.23) is
skipped: CI installs only the project's [test] extra, so there these peer tests skip and only the
driver and report tests run.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

PEERS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "peers"


def _load(name: str, filename: str):
    """A script of benchmarks/peers as a module under a name no other test uses."""
    spec = importlib.util.spec_from_file_location(name, PEERS_DIR / filename)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # run.py puts benchmarks/peers on sys.path for its own imports
    return module


peers_run = _load("occult_peers_run", "run.py")


def _resolve(*argv: str):
    return peers_run.resolve(peers_run.parse_args(["--backend", "gloo", *argv]))


def test_driver_arguments():
    worlds, conf = _resolve("--world-size", "4,2", "--timeout-s", "120,80", "--peers", "occult-dedup,megatron")
    assert worlds == [4, 2] and conf["timeouts"] == {4: 120.0, 2: 80.0}
    assert conf["peers"] == ["occult-dedup", "megatron"] and conf["shapes"] == ["tiny"] and conf["tokens"] == 64
    assert conf["tolerance"] == 1e-4
    worlds, conf = _resolve()
    assert worlds == [2] and conf["peers"] == list(peers_run.peer_bench.PEERS)
    for bad, msg in [
        (["--peers", "nope"], "unknown peer"),
        (["--shapes", "nope"], "unknown shape"),
        (["--world-size", "3"], "not divisible"),
        (["--world-size", "two"], "must be integers"),
        (["--world-size", "4,2", "--timeout-s", "1,2,3"], "one per world size"),
    ]:
        with pytest.raises(SystemExit, match=msg):
            _resolve(*bad)


def test_report_table_and_plot(tmp_path):
    report = _load("occult_peers_report", "report.py")

    def rec(peer, fwd, step, **kw):
        return dict(
            peer=peer, world=2, shape="olmoe", status="ok", forward_ms=fwd, fwd_bwd_ms=step, rel_error=3e-3, **kw
        )

    result = {
        "config": {"device": "GPU", "tokens": 8192},
        "runs": [
            rec("occult-dedup", 2.0, 5.0, info={"rows_per_token": 2.0}),
            rec("megatron", 3.0, 10.0, dx_rel_diff=1e-3),
            {"peer": "deepspeed", "world": 2, "shape": "olmoe", "status": "failed", "error": "build: ImportError: x"},
        ],
    }
    text = report.table(result)
    assert "| Megatron-Core MoELayer | 8 (top-k) | 3.00 | 10.00 | 1.50x / 2.00x |" in text
    assert "not run: failed: build: ImportError" in text
    out = tmp_path / "peers.png"
    report.plot(result, str(out))
    assert out.stat().st_size > 1000


def _available(peer: str) -> bool:
    if peer == "hf-olmoe":
        try:
            return importlib.util.find_spec("transformers.distributed.expert_parallel") is not None and hasattr(
                importlib.import_module("transformers.distributed.expert_parallel"), "AllToAllEP"
            )
        except ImportError:
            return False
    module = {"megatron": "megatron.core", "deepspeed": "deepspeed", "torchtitan": "torchtitan.models.common.moe"}[peer]
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or one of its imports
        return False


# TorchTitan's GroupedExperts casts to bfloat16 for its grouped GEMMs even on float32 ranks:
# bfloat16 tolerances (a wrong weight layout or routing gives errors of order 1).
TOLERANCE = {"torchtitan": 2e-2}
PEERS = ["hf-olmoe", "megatron", "deepspeed", "torchtitan"]


@pytest.fixture(scope="module")
def peer_runs(tmp_path_factory) -> dict:
    """One driver run (one spawn of 2 ranks) over occult-dedup and every installed peer: each peer's record and
    the driver's output. The driver's own gate is the loosest tolerance; each test holds its peer to its own."""
    peers = [peer for peer in PEERS if _available(peer)]
    if not peers:
        return {"runs": {}, "output": ""}
    out = tmp_path_factory.mktemp("peers") / "peers.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(PEERS_DIR / "run.py"),
            "--backend",
            "gloo",
            "--world-size",
            "2",
            "--tokens",
            "32",
            "--peers",
            ",".join(["occult-dedup", *peers]),
            "--warmup",
            "1",
            "--iters",
            "1",
            "--timeout-s",
            "240",
            "--tolerance",
            str(max(TOLERANCE.get(peer, 1e-4) for peer in peers)),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"runs": {r["peer"]: r for r in json.loads(out.read_text())["runs"]}, "output": proc.stdout[-3000:]}


@pytest.mark.parametrize("peer", PEERS)
def test_peer_matches_reference_on_cpu(peer, peer_runs):
    if not _available(peer):
        pytest.skip(
            f"{peer} is not installed or not importable (peers are not in the [test] extra; "
            "see benchmarks/requirements-peers.txt)"
        )
    tol = TOLERANCE.get(peer, 1e-4)
    runs = peer_runs["runs"]
    assert peer in runs, peer_runs["output"]
    assert runs[peer]["status"] == "ok", runs[peer].get("traceback", runs[peer])
    assert runs[peer]["rel_error"] < tol
    assert runs[peer]["fwd_bwd_ms"] > 0
    if not runs[peer].get("renormalized"):  # same gate function as occult: same input gradient
        assert runs[peer]["dx_vs"] == runs["occult-dedup"]["name"] and runs[peer]["dx_rel_diff"] < tol
    if peer == "torchtitan":  # its all-to-all path, not the local fallback it takes without an EP mesh
        assert runs[peer]["info"]["dispatcher"] == "AllToAllTokenDispatcher" and runs[peer]["info"]["ep_size"] == 2
