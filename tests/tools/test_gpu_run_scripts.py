"""scripts/one_gpu_runs.sh and scripts/multi_gpu_runs.sh: every part's commands (DRY_RUN=1), and clear errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, part: str, out: Path, **env: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])  # python3 = this Python
    return subprocess.run(["bash", str(ROOT / "scripts" / script), part, str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PATH": path, **env})


@pytest.mark.parametrize("script, parts", [
    ("one_gpu_runs.sh", ["kernels", "suite", "peer", "train", "native", "native_decode", "quality"]),
    ("multi_gpu_runs.sh", ["suite", "e2e", "e2e-slow", "peer", "train", "train-slow", "serve", "probe", "scale"]),
])
def test_dry_run_lists_every_part(tmp_path, script, parts):
    res = _run(script, "all", tmp_path, DRY_RUN="1")
    assert res.returncode == 0, res.stderr
    names = [line.split(":")[0][3:] for line in res.stdout.splitlines() if line.startswith("== ")]
    for part in parts:
        one = _run(script, part, tmp_path, DRY_RUN="1")
        assert one.returncode == 0 and one.stdout.count("\n== ") + one.stdout.startswith("== ") >= 1, (part, one.stderr)
        assert all(line.split(":")[0][3:] in names for line in one.stdout.splitlines() if line.startswith("== "))
    assert any("--corpus-dir .gpudata" in line for line in res.stdout.splitlines())  # the carried corpus
    bad = _run(script, "nope", tmp_path, DRY_RUN="1")
    assert bad.returncode == 2 and "unknown part 'nope'" in bad.stderr
