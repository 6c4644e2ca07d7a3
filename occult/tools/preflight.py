"""Sizes the tools cannot allocate, refused before any rank starts.

`occult demo` and `occult bench` estimate from their flags a lower bound of the bytes a job
needs (weights, token batches, dispatch buffers), on the host (CPU ranks, and the parent's
calibration) and per GPU, and `check_fits` compares it with what the machine has: host memory
available now (the cgroup's limit where it is lower), each GPU's total memory. A job that
surely cannot fit is refused with one line naming the flags to lower (`ValueError`, which the
command line prints as `occult: error: ...`, exit 2). A lower bound cannot refuse a job that
fits; an allocation that still fails in a rank is named the same way (`out_of_memory`, `rank_failure`).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any

OUT_OF_MEMORY_SIGNS = (
    "OutOfMemoryError",
    "CUDA out of memory",
    "can't allocate memory",
    "MemoryError",
    "DefaultCPUAllocator",
    "Cannot allocate memory",
)


@dataclass
class MemoryNeed:
    """Bytes a job needs at least: on the host in all, and on each GPU; the size flags behind them."""

    host_bytes: int = 0
    gpu_bytes_per_rank: int = 0
    flags: dict[str, Any] = field(default_factory=dict)  # the size flags and their values, e.g. {"--tokens": 1024}
    given: tuple[str, ...] = ()  # those the user set: the ones to lower


def fmt_bytes(n: float) -> str:
    """`12.3 GB`: a byte count for a message."""
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def _cgroup_headroom() -> int | None:
    """What the cgroup (v2, else v1) still lets this process allocate, or None without a limit."""
    for limit_path, used_path in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            with open(limit_path, encoding="ascii") as f:
                limit = f.read().strip()
            with open(used_path, encoding="ascii") as f:
                used = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:
            return max(0, int(limit) - used)
        return None
    return None


def available_host_bytes() -> int | None:
    """Host memory this process can still use (MemAvailable, bounded by the cgroup), or None if unknown."""
    known = [b for b in (_meminfo_available(), _cgroup_headroom()) if b is not None]
    return min(known) if known else None


def gpu_total_bytes(ranks: int) -> int | None:
    """The smallest total memory of the GPUs ranks 0..ranks-1 use, or None where CUDA cannot say."""
    try:
        import torch

        return min(torch.cuda.get_device_properties(i).total_memory for i in range(ranks))
    except Exception:  # no CUDA, a driver problem: the ranks will say
        return None


def _too_big(tool: str, need: MemoryNeed, what: str, needed: int, have: int) -> ValueError:
    shown = ", ".join(f"{flag} {value}" for flag, value in need.flags.items())
    lower = " or ".join(need.given or tuple(need.flags))
    return ValueError(
        f"{tool} with {shown} needs at least {fmt_bytes(needed)} of {what}, and {fmt_bytes(have)} is available: "
        f"lower {lower}"
    )


def check_fits(tool: str, need: MemoryNeed, on_gpu: bool, ranks: int) -> None:
    """Refuse (ValueError naming the flags) a job whose lower bound exceeds host memory or a GPU's."""
    host = available_host_bytes()
    if host is not None and need.host_bytes > host:
        raise _too_big(tool, need, "host memory", need.host_bytes, host)
    if on_gpu:
        gpu = gpu_total_bytes(ranks)
        if gpu is not None and need.gpu_bytes_per_rank > gpu:
            raise _too_big(tool, need, "memory on each GPU", need.gpu_bytes_per_rank, gpu)


def out_of_memory(tool: str, need: MemoryNeed, failure: str) -> ValueError | None:
    """The one-line error for a rank that failed to allocate, or was killed (SIGKILL: on Linux most
    often the kernel's out-of-memory killer), from the ranks' report `failure`; else None."""
    shown = ", ".join(f"{flag} {value}" for flag, value in need.flags.items())
    lower = " or ".join(need.given or tuple(need.flags))
    if any(sign in failure for sign in OUT_OF_MEMORY_SIGNS):
        return ValueError(f"{tool} ran out of memory in a rank with {shown}: lower {lower}")
    if "(exit code -9)" in failure:
        return ValueError(f"{tool}: a rank was killed (SIGKILL, most often out of memory) with {shown}: lower {lower}")
    return None


def rank_failure(tool: str, need: MemoryNeed, failure: Exception) -> int:
    """A failed run of the ranks: `out_of_memory`'s one-line error raised where it applies, else the
    failure printed to stderr as `{tool}: FAILED: ...`; returns the exit status (1)."""
    too_big = out_of_memory(tool, need, str(failure))
    if too_big is not None:
        raise too_big from None
    print(f"{tool}: FAILED: {failure}", file=sys.stderr)
    return 1
