"""Issue 37's hang at exit: 2 ranks, `compile_layers` + graph-captured `hf.generate`, then a plain
`dist.destroy_process_group()`. Every rank must leave within 30 s of its last decode step.

The cause was the decode step's CUDA graph (it holds NCCL collectives) still alive, waiting for the
garbage collector, when the process group was destroyed: `hf.generate` now frees it on return
(`StaticDecoder.release`). Runs `scripts/exit_probe.py` under torchrun (single-process stage).
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
def test_ranks_exit_after_compiled_graph_decode():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "scripts" / "exit_probe.py"), "--layers", "2", "--teardown", "destroy"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for rank in (0, 1):
        times = {what: float(t) for t, what in re.findall(rf"\[rank {rank}\s+([\d.]+) s\] (generated B=8|left)", done.stdout)}
        assert set(times) == {"generated B=8", "left"}, done.stdout
        assert times["left"] - times["generated B=8"] < 30, done.stdout
