"""`occult train` checkpoints across GPU counts over NCCL (issue 38): a run stopped on 2 GPUs (EP 2)
resumes on 1 GPU, one stopped on 1 GPU resumes on 2, and both give the uninterrupted 1-GPU run's
per-step losses (tests/lm/test_parallel.py's tolerance: fp32, adam eps 1e-6, rtol 1e-5).

Spawns its own processes through the CLI (torchrun for 2 ranks), so it runs in a plain pytest process
(tests/gpu/run.sh's second stage) and needs 2 GPUs. `python tests/gpu/test_resume_across_gpu_counts.py
--device cpu` runs the same check on CPU gloo ranks (a check of the test's logic, not of NCCL).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
RTOL = 1e-5  # tests/lm/_train_helpers.py
STEPS, STOP = 8, 4
TINY = [
    "--hidden",
    "32",
    "--layers",
    "2",
    "--heads",
    "2",
    "--experts",
    "8",
    "--top-k",
    "2",
    "--expert-ffn",
    "16",
    "--batch-size",
    "4",
    "--seq-len",
    "32",
    "--steps",
    str(STEPS),
    "--eval-every",
    str(STOP),
    "--eval-tokens",
    "256",
    "--save-every",
    str(STOP),
    "--precision",
    "fp32",
    "--adam-eps",
    "1e-6",
    "--no-progress",
]


def occult(ranks: int, device: str, *args: str | Path) -> None:
    """`occult train ...` in one process or under torchrun on `ranks` ranks; raises with its output on failure."""
    launch = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
        if ranks > 1
        else [sys.executable]
    )
    dev = ["--device", "cpu"] if device == "cpu" else []
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "OMP_NUM_THREADS": "1",
    }
    res = subprocess.run(
        [*launch, "-m", "occult", "train", *TINY, *dev, *map(str, args)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if res.returncode:
        raise AssertionError(
            f"occult train on {ranks} rank(s) failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
        )


def losses(run: Path) -> list[float]:
    """Every step's loss, from the final weights file's metadata."""
    from safetensors import safe_open

    with safe_open(str(run / "model.safetensors"), framework="pt") as f:
        return json.loads(f.metadata()["train_losses"])


def prepared_corpus(root: Path, device: str) -> Path:
    """tests/data/shakespeare_tiny prepared (vocabulary 300)."""
    out = root / "data"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "occult",
            "data",
            "prepare",
            "--out",
            str(out),
            "--corpus-dir",
            str(REPO / "tests" / "data" / "shakespeare_tiny"),
            "--vocab-size",
            "300",
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    return out


def resume_runs(root: Path, device: str) -> dict[str, list[float]]:
    """The uninterrupted 1-rank run, 2 -> 1 and 1 -> 2 ranks: each run's per-step losses."""
    data = prepared_corpus(root, device)
    common = ["--corpus-dir", data]
    occult(1, device, *common, "--out", root / "straight")
    occult(2, device, *common, "--out", root / "two_one", "--stop-after", STOP)
    occult(1, device, *common, "--out", root / "two_one", "--resume")
    occult(1, device, *common, "--out", root / "one_two", "--stop-after", STOP)
    occult(2, device, *common, "--out", root / "one_two", "--resume")
    return {name: losses(root / name) for name in ("straight", "two_one", "one_two")}


def check(runs: dict[str, list[float]]) -> None:
    want = runs["straight"]
    assert len(want) == STEPS
    for name in ("two_one", "one_two"):
        assert len(runs[name]) == STEPS, name
        print(f"{name}: max relative loss difference {max(abs(a - b) / abs(b) for a, b in zip(runs[name], want)):.1e}")
        np.testing.assert_allclose(runs[name], want, rtol=RTOL, err_msg=name)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_resume_across_gpu_counts(tmp_path):
    pytest.importorskip("tokenizers")
    check(resume_runs(tmp_path, "cuda"))


if __name__ == "__main__":
    import argparse
    import tempfile

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        got = resume_runs(Path(tmp), a.device)
    for name, values in got.items():
        print(name, " ".join(f"{v:.6f}" for v in values))
    check(got)
    print(f"resume across rank counts on {a.device}: same losses as the uninterrupted run (rtol {RTOL:g})")
