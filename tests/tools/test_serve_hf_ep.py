"""transformers' own expert parallelism as a peer of benchmarks/serve.py and e2e.py (benchmarks/hf_ep.py):
on 2 gloo CPU ranks with a tiny model, loaded by `from_pretrained(distributed_config=...)` with
dense layers tensor-parallel and experts sharded, serving every rank's prompts as one shared
batch; its prefill and decode logits for this rank's rows must equal the unconverted model's."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
SERVE = ROOT / "benchmarks" / "serve.py"


def _env(tmp_dir: Path) -> dict[str, str]:
    return dict(
        os.environ,
        TMPDIR=str(tmp_dir),
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )


def _load_hf_ep():
    spec = importlib.util.spec_from_file_location("occult_bench_hf_ep", ROOT / "benchmarks" / "hf_ep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_serve_hf_ep_peer_matches_unconverted(tmp_path):
    pytest.importorskip("accelerate", reason="transformers' tensor/expert-parallel loading needs accelerate")
    out, tmp_dir = tmp_path / "serve.json", tmp_path / "tmp"
    tmp_dir.mkdir()
    env = _env(tmp_dir)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(SERVE),
        "--model",
        "tiny-qwen3",
        "--variants",
        "replicated,hf-ep,hf-ep+graph",
        "--batch",
        "3",
        "--prompt-len",
        "6",
        "--new-tokens",
        "3",
        "--repeats",
        "1",
        "--out",
        str(out),
    ]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads(out.read_text())
    peer = report["hf_ep"]
    assert peer["tp_size"] == 2 and peer["ep_size"] == 2 and peer["local_experts"] == 4  # 8 experts over 2 ranks
    r = report["variants"]["hf-ep"]["3"]
    # fp32 on CPU: each rank's 3 rows of the shared 6-row batch equal the unconverted model on that rank's prompts
    assert r["check"]["passed"] and r["check"]["median_rel_err"] < 1e-4 and r["check"]["argmax_agreement"] == 1.0
    assert len(r["ms_all"]) == 3 and r["decode_tokens_per_s_per_gpu"] > 0
    assert "CUDA graphs need a GPU" in report["variants"]["hf-ep+graph"]["3"]["skipped"]
    rows = {(row["batch"], row["variant"]): row for row in report["table"]}
    assert rows[(3, "hf-ep")]["floor"] == "replicated" and rows[(3, "hf-ep")]["x_floor"] > 0
    assert not list(tmp_dir.glob("occult-serve-hf-ep-*")), list(tmp_dir.iterdir())  # the saved weights removed


def test_e2e_hf_ep_prefill_peer(tmp_path):
    pytest.importorskip("accelerate", reason="transformers' tensor/expert-parallel loading needs accelerate")
    out, tmp_dir = tmp_path / "e2e.json", tmp_path / "tmp"
    tmp_dir.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(ROOT / "benchmarks" / "e2e.py"),
        "--model",
        "tiny",
        "--variants",
        "replicated,hf-ep",
        "--batch",
        "2",
        "--seq",
        "16",
        "--check-seq",
        "16",
        "--warmup",
        "1",
        "--iters",
        "2",
        "--out",
        str(out),
    ]
    res = subprocess.run(cmd, cwd=ROOT, env=_env(tmp_dir), capture_output=True, text=True, timeout=240, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    v = json.loads(out.read_text())["variants"]["hf-ep"]
    assert v["exact"] and v["check"]["passed"] and v["check"]["median_rel_err"] < 1e-4, v["check"]
    assert v["hf_ep"]["local_experts"] == 4 and list(v["phases"]) == ["prefill"]  # train: not timed
    assert len(v["phases"]["prefill"]["ms_all"]) == 2 and v["phases"]["prefill"]["tokens_per_s_per_gpu"] > 0
    assert "| hf-ep | train | not timed |" in res.stdout and not list(tmp_dir.glob("occult-serve-hf-ep-*"))


def test_hf_ep_unavailable_says_why(monkeypatch):
    hf_ep = _load_hf_ep()
    real = hf_ep.importlib.util.find_spec
    monkeypatch.setattr(
        hf_ep.importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else real(name, *a)
    )
    assert "accelerate" in hf_ep.unavailable()


def test_hf_ep_distributed_config():
    cfg = _load_hf_ep().distributed_config(2)
    assert cfg.tp_size == 2 and getattr(cfg, "ep_size", 2) == 2 and cfg.enable_expert_parallel
