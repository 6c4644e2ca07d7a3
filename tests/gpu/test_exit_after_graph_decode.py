"""Issue 37's hang at exit: 2 ranks, `compile_layers` + graph-captured `hf.generate`, then the
process group destroyed. Every rank must leave within 30 s of its last decode step.

The cause (2 and 4 x H200, `scripts/exit_probe.py` in each configuration): the decode graph that `hf.generate` keeps on
the model for its next call holds captured NCCL collectives, and a plain `dist.destroy_process_group()`
with that graph alive waits in NCCL's shutdown forever; freeing the graph first lets the run end at
once. `occult.teardown` now releases every registered graph inside `destroy_process_group` (and in
`finish_distributed`). Runs `scripts/exit_probe.py` under torchrun (single-process stage).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
@pytest.mark.parametrize("transport", ["auto", "counts"])
@pytest.mark.parametrize("teardown", ["finish", "destroy"])
def test_ranks_exit_after_compiled_graph_decode(teardown, transport):
    """`auto` is the device transport on NVLink (its decode graph holds no NCCL collective); `counts`
    decodes sync-free over NCCL, the captured collectives of the original hang (as on a slow link)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(ROOT / "scripts" / "exit_probe.py"),
        "--layers",
        "2",
        "--teardown",
        teardown,
        "--transport",
        transport,
    ]
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
    }
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for rank in (0, 1):
        times = {
            what: float(t) for t, what in re.findall(rf"\[rank {rank}\s+([\d.]+) s\] (generated B=8|left)", done.stdout)
        }
        assert set(times) == {"generated B=8", "left"}, done.stdout
        assert times["left"] - times["generated B=8"] < 30, done.stdout
