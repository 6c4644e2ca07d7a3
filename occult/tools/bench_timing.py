"""`occult bench`'s clocks: GPU time (CUDA events, the slowest rank's median), the measured
ceilings (all-to-all bandwidth, matmul throughput), host time to issue a call, host syncs in one."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def make_timer(device: torch.device) -> Callable[[Callable[[], Any], int, int], float]:
    """Median milliseconds of fn over `iters` runs after `warmup` runs (CUDA events on GPU)."""

    def run(fn: Callable[[], Any], warmup: int, iters: int) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                dist.barrier()
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                times.append(1e3 * (time.perf_counter() - t0))
        # Every rank reports the slowest rank's median: a collective step ends when the last rank does.
        med = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
        return float(med.item())

    return run


def ceilings(device: torch.device, world: int, timer) -> dict[str, float]:
    """Measured peaks: all_to_all_single GB/s leaving each rank (256 MB), bf16 matmul TFLOP/s."""
    out: dict[str, float] = {}
    if device.type == "cuda":
        n = 8192
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        ms = timer(lambda: a @ b, 3, 10)
        out["matmul_tflops"] = 2 * n**3 / ms / 1e9
        del a, b
        numel = 128 * 1024 * 1024  # 256 MB of bf16
    else:
        numel = 1024 * 1024
    if world > 1:
        buf = torch.randn(numel, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
        out_buf = torch.empty_like(buf)
        ms = timer(lambda: dist.all_to_all_single(out_buf, buf), 3, 10)
        nbytes = buf.numel() * buf.element_size() * (world - 1) / world  # bytes leaving each rank
        out["all_to_all_GBps"] = nbytes / ms / 1e6
        out["all_to_all_MB"] = buf.numel() * buf.element_size() / 1e6
    return out


def count_host_syncs(fn: Callable[[], Any], device: torch.device) -> int | None:
    """Device-to-host synchronisations in one call of fn (CUDA's sync debug mode); None on CPU,
    where there is no device to wait for. Call it on a warm fn: a first call's kernel compilation
    and autotuning synchronise too."""
    if device.type != "cuda":
        return None
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def host_ms(fn: Callable[[], Any], device: torch.device, iters: int) -> float | None:
    """Median host time of one call of fn started on an idle GPU, every rank starting together (a
    barrier first: a rank's wait for a late peer is not counted): how long the host takes to launch
    it, with any wait for the GPU inside it; None on CPU."""
    if device.type != "cuda":
        return None
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return float(statistics.median(times))
