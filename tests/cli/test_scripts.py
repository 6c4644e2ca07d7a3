"""Scripts and examples run as a user runs them (issue 24): `scripts/capture_check.py` on a machine
without a GPU, and `examples/hf_expert_parallel.py` leaving nothing behind where it runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _python(*args: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


def test_capture_check_help_and_no_gpu(tmp_path):
    script = str(REPO / "scripts" / "capture_check.py")
    proc = _python(script, "--help", cwd=tmp_path)
    assert proc.returncode == 0 and "CUDA graph" in proc.stdout and "Needs a CUDA GPU" in proc.stdout, proc.stderr
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the no-GPU message cannot be shown")
    proc = _python(script, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "needs a CUDA GPU" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_hf_example_writes_to_a_temporary_directory(tmp_path):
    pytest.importorskip("transformers")
    proc = _python(
        str(REPO / "examples" / "hf_expert_parallel.py"),
        "--tiny",
        "olmoe",
        "--tokens",
        "512",
        "--new-tokens",
        "2",
        "--steps",
        "1",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fine-tune step 0" in proc.stdout
    assert list(tmp_path.iterdir()) == []  # nothing written where it ran (it used to leave hf_ep_work/)
    workdir = next(line for line in proc.stdout.splitlines() if "-> " in line and "trace.safetensors" in line)
    assert "occult-hf-ep-" in workdir  # the profile went to the temporary directory ...
    assert not Path(workdir.rsplit("-> ", 1)[1]).parent.exists()  # ... which is removed at the end
