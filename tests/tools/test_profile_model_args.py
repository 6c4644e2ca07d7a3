"""scripts/profile_model.py's arguments: what it cannot profile is refused with its reason before any work (a GPU
tool: on a CPU machine, after the variants are checked, it says so instead of failing in CUDA's lazy init)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "profile_model.py"), *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    "argv, says",
    [
        (("--model", "olmoe", "--variants", "torchtitan"), "use --model qwen3"),
        (("--model", "qwen3", "--variants", "native,torchtitan+occult+placement"), "solves no placement"),
        (("--model", "qwen3", "--variants", "torchtitan", "--accumulate", "2"), "--accumulate is not passed"),
    ],
)
def test_torchtitan_variants_it_cannot_profile_are_refused(argv, says):
    pytest.importorskip("torchtitan")
    done = run(*argv)
    assert done.returncode == 2, done.stderr
    assert says in done.stderr and "Traceback" not in done.stderr


def test_no_gpu_is_said_not_raised():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    done = run("--model", "qwen3", "--variants", "native")
    assert done.returncode == 2 and "no GPU here" in done.stderr and "Traceback" not in done.stderr
