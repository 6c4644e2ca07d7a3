"""Every Python block in README.md is a file under examples/, and it runs: torchrun, 2 gloo ranks, tiny sizes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_every_readme_python_block_is_an_example_file() -> None:
    blocks = readme_python_blocks()
    examples = {p.name: p.read_text() for p in (ROOT / "examples").glob("*.py")}
    assert blocks, "README.md has no python block: update this test"
    for block in blocks:
        assert block in examples.values(), f"a README python block is not an examples/ file:\n{block[:300]}"


def test_using_the_layer_runs_under_torchrun_on_two_cpu_ranks(tmp_path: Path) -> None:
    """The README's commands, as written: a placement from the bundled trace, then torchrun (gloo ranks)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    placement = tmp_path / "placement.json"
    trace = ROOT / "occult" / "data" / "example_trace.safetensors"
    place = [sys.executable, "-m", "occult", "place", "--trace", str(trace), "--devices", "2", "--method", "greedy"]
    run = subprocess.run([*place, "--out", str(placement)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]  # a free port
    sizes = ["--hidden", "32", "--ffn", "16", "--tokens", "16", "--placement", str(placement)]
    run = subprocess.run(
        [*torchrun, str(ROOT / "examples" / "using_the_layer.py"), *sizes],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    # the ranks print concurrently into one pipe: their lines may interleave, so match anywhere
    found = dict(re.findall(r"rank (\d) of 2: y \(16, 32\), (\d+) rows dispatched", run.stdout))
    assert sorted(found) == ["0", "1"], run.stdout
    for rows in found.values():
        assert 16 <= int(rows) <= 16 * 2  # once per device holding any of its experts (standard dispatch: 16 * 8)
