"""Running a benchmark script in a subprocess, as the CPU smoke tests of benchmarks/ do
(test_decode_bench.py, test_e2e_bench.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def bench_env() -> dict[str, str]:
    """This process's environment, one thread per process, Hugging Face offline, the checkout first on PYTHONPATH."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def torchrun(script: Path, nproc: int, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """`script` under torchrun on `nproc` local ranks (output captured, never raises on failure)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(script),
        *args,
    ]
    return subprocess.run(cmd, cwd=ROOT, env=bench_env(), capture_output=True, text=True, timeout=timeout, check=False)


def python(script: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`script` in one plain Python process (output captured, never raises on failure)."""
    return subprocess.run(
        [sys.executable, str(script), *args],
        cwd=ROOT,
        env=bench_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
