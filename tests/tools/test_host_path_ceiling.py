"""scripts/host_path_ceiling.py: its arguments, and a clear exit without GPUs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import host_path_ceiling  # noqa: E402

sys.path.pop(0)


def test_arguments():
    args = host_path_ceiling.parse_args(["--mib", "8", "--iters", "3"])
    assert (args.mib, args.iters, args.out) == (8, 3, None)
    for bad in (["--mib", "0"], ["--iters", "0"], ["--mib", "x"]):
        with pytest.raises(SystemExit) as info:
            host_path_ceiling.parse_args(bad)
        assert info.value.code == 2, bad


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only refusal")
def test_without_gpus_it_says_what_it_needs(tmp_path):
    out = tmp_path / "x.json"
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "host_path_ceiling.py"), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and "needs CUDA GPUs" in res.stderr and not out.exists()
