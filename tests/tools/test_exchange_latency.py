"""scripts/exchange_latency.py: its arguments, and a clear exit where the device transport cannot run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import exchange_latency  # noqa: E402

sys.path.pop(0)


def test_arguments():
    args = exchange_latency.parse_args(["--rows", "1,64", "--exchanges", "4"])
    assert args.rows == [1, 64] and args.exchanges == 4 and args.hidden == 2048
    assert args.transports == ["device", "nccl"]
    assert exchange_latency.parse_args(["--transports", "nccl"]).transports == ["nccl"]
    for bad in (["--rows", "1,x"], ["--rows", "0"], ["--exchanges", "3"], ["--iters", "0"], ["--transports", "ib"]):
        with pytest.raises(SystemExit) as info:
            exchange_latency.parse_args(bad)
        assert info.value.code == 2, bad


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only refusal")
def test_without_gpus_it_says_what_it_needs():
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "exchange_latency.py"), "--rows", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and "needs CUDA GPUs of one host" in res.stderr


def _check_on_gloo(rank: int, world_size: int, rows: int, corrupt: bool) -> bool:
    sys.path.insert(0, str(ROOT / "tests" / "moe"))
    from test_device_exchange import GlooTransport  # the CPU stand-in: same region-per-source layout

    transport = GlooTransport(torch.distributed.group.WORLD)
    src_NW, counts_D = exchange_latency.send_rows(world_size, rank, rows, 8, torch.device("cpu"))
    if corrupt and rank == 1:
        src_NW[0] += 1  # rank 0 receives a wrong byte from rank 1
    transport.reserve(world_size * rows * src_NW.shape[1])
    return exchange_latency.check_device(transport, src_NW, counts_D, rows)


@pytest.mark.parametrize("corrupt", [False, True])
def test_the_check_reads_each_source_s_rows(corrupt):
    """The check the script runs before timing: passes on a correct exchange, fails on every rank otherwise."""
    from occult.distributed import run_ranks

    rows = 3
    assert run_ranks(_check_on_gloo, 2, rows, corrupt, timeout_s=120) == [not corrupt] * 2
