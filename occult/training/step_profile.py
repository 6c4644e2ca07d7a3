"""Where a training step's time goes: a hook that profiles a window of steps (`--profile-steps A:B`).

`StepProfile` runs `torch.profiler` over steps A..B of the loop (counted from 1, after any warm-up
the user leaves before A) on every rank and writes `step_profile_rank{r}.json` into the run
directory: wall ms per step (host clock, the GPU drained at both ends of the window), GPU busy ms
per step (the union of the device's kernel and copy intervals), the idle share (wall - busy: the
host-bound part), kernel launches per step, the host ms of an MoE layer call forward and backward
(`moe_host_ms_per_call`: `occult.moe.host_time`'s ranges, the median call, less its waits for the GPU),
the host ms of a whole step (`step_host_ms`: the loop's step range, the median step, less its waits: what
the host spends issuing a step, e.g. ~0.2 ms for a replayed `--captured-step`),
and the host operations and kernels that cost most;
beside it the window's timeline, `step_trace_rank{r}.json.gz` (Chrome trace format, gzipped: Perfetto
or chrome://tracing open it), which shows what host call each idle gap follows.
A low GPU busy share means the step waits on the host (Python, launches, a host-device sync),
not on the GPU. The profiler's own overhead lengthens the wall time a little; compare the
window's tokens/s with an unprofiled run.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from occult.moe.host_time import BACKWARD, FORWARD
from occult.training.hooks import StepHook
from occult.training.loop import STEP_RANGE

TOP = 25  # host operations and kernels kept in the summary
# the exchanges' device work: NCCL's kernels, the device transport's, the host transport's copies through pinned memory
EXCHANGE = ("nccl", "_push_kernel", "_pack_push_kernel", "barrier", "(device -> pinned)", "(pinned -> device)")


def parse_window(spec: str) -> tuple[int, int]:
    """'A:B' (1 <= A <= B) -> (A, B); a clear error otherwise."""
    try:
        first, last = (int(v) for v in spec.split(":"))
    except ValueError:
        raise ValueError(f"profile steps must look like 'A:B' (e.g. '21:25'), got {spec!r}") from None
    if not 1 <= first <= last:
        raise ValueError(f"profile steps {spec!r}: need 1 <= A <= B")
    return first, last


def is_exchange(kernel_name: str) -> bool:
    """Whether a kernel or copy moves data between ranks (NCCL's collectives, the device transport's push and
    barrier kernels, the host transport's copies to and from pinned memory), as opposed to compute."""
    low = kernel_name.lower()
    return any(k in low for k in EXCHANGE)


def union_ms(intervals_us: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals given in microseconds, in ms."""
    return sum(e - s for s, e in merged(intervals_us)) / 1e3


def merged(intervals_us: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [start, end) intervals as sorted, disjoint intervals."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals_us):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def overlap_ms(a_us: list[tuple[float, float]], b_us: list[tuple[float, float]]) -> float:
    """How long both sets of [start, end) intervals (microseconds) cover at once, in ms: e.g. the exchanges'
    kernels against every other kernel, the part of the all-to-alls that runs under compute."""
    a, b = merged(a_us), merged(b_us)
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total / 1e3


def device_work(events: Any) -> list[Any]:
    """The profiler events that are work on a device (kernels, copies, sets): not the host's events, and not
    the device's copies of host ranges (`record_function`, `occult::moe_forward`, `Optimizer.step`), which
    span the gaps between kernels and would count them as busy."""
    return [
        e
        for e in events
        if e.device_type != torch.autograd.DeviceType.CPU and not getattr(e, "is_user_annotation", False)
    ]


def summarise(prof: Any, steps: int, wall_s: float, on_gpu: bool = True) -> dict[str, Any]:
    """The profile of `steps` steps that took `wall_s` seconds: busy, idle, top host ops and kernels
    (`on_gpu` False: a CPU run, no device figures)."""
    device_events = device_work(prof.events())
    busy = union_ms([(e.time_range.start, e.time_range.end) for e in device_events]) / steps
    wall = wall_s * 1e3 / steps
    kernels: dict[str, list[float]] = {}
    for e in device_events:
        entry = kernels.setdefault(e.name, [0.0, 0.0])
        entry[0] += e.time_range.elapsed_us() / 1e3 / steps
        entry[1] += 1 / steps
    averages = prof.key_averages()
    host = [a for a in averages if a.self_cpu_time_total > 0]
    host.sort(key=lambda a: -a.self_cpu_time_total)
    return {
        "moe_host_ms_per_call": moe_host_ms(prof.events(), steps),
        "step_host_ms": step_host_ms(prof.events()),
        "steps": steps,
        "wall_ms_per_step": wall,
        "gpu_busy_ms_per_step": busy if on_gpu else None,
        "gpu_busy_share": busy / wall if on_gpu and wall > 0 else None,
        "idle_ms_per_step": wall - busy if on_gpu else None,
        "device_ops_per_step": len(device_events) / steps,
        "host_ops_top": [
            {
                "name": a.key[:160],
                "self_cpu_ms_per_step": a.self_cpu_time_total / 1e3 / steps,
                "calls_per_step": a.count / steps,
            }
            for a in host[:TOP]
        ],
        "kernels_top": [
            {"name": n[:160], "ms_per_step": v[0], "calls_per_step": v[1]}
            for n, v in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:TOP]
        ],
    }


# host calls that wait for the GPU: time inside them is the GPU's, not the layer's host work
HOST_WAITS = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize")


def moe_host_ms(events: Any, steps: int) -> dict[str, float | None]:
    """Host ms of an MoE layer call, forward and backward (`occult.moe.host_time`'s ranges, the median call),
    less the time its host spent waiting for the GPU inside it; forward calls per step. None where the
    window had none. (A profiler lists each range twice on GPUs, once on the host and once on the
    device; only the host's count.)"""
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    waits = [(e.thread, e.time_range.start, e.time_range.end) for e in host if e.name in HOST_WAITS]

    def ranges(name: str) -> list[tuple[int, float, float]]:
        return [(e.thread, e.time_range.start, e.time_range.end) for e in host if e.name == name]

    forward = ranges(FORWARD)
    return {
        "forward": median_busy_ms(forward, waits),
        "backward": median_busy_ms(ranges(BACKWARD), waits),
        "forward_calls_per_step": len(forward) / steps,
    }


def step_host_ms(events: Any) -> float | None:
    """Host ms of a training step (the loop's `STEP_RANGE`, the median step), less its waits for the GPU."""
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    waits = [(e.thread, e.time_range.start, e.time_range.end) for e in host if e.name in HOST_WAITS]
    return median_busy_ms(
        [(e.thread, e.time_range.start, e.time_range.end) for e in host if e.name == STEP_RANGE], waits
    )


def median_busy_ms(ranges: list[tuple[int, float, float]], waits: list[tuple[int, float, float]]) -> float | None:
    """The median over `ranges` (thread, start us, end us) of each one's length less its overlap with the
    `waits` of its own thread, in ms; None without ranges."""
    if not ranges:
        return None
    busy = []
    for thread, start, end in ranges:
        own = [(s, e) for t, s, e in waits if t == thread]
        busy.append((end - start) / 1e3 - overlap_ms([(start, end)], own))
    return statistics.median(busy)


def write_trace(prof: Any, path: Path) -> None:
    """The profiler's timeline, gzipped, at `path` (written under a temporary name, then renamed)."""
    plain = path.with_name(path.name + ".json.tmp")
    packed = path.with_name(path.name + ".tmp")
    prof.export_chrome_trace(str(plain))
    with open(plain, "rb") as src, gzip.open(packed, "wb") as dst:
        shutil.copyfileobj(src, dst)
    plain.unlink()
    os.replace(packed, path)


class StepProfile(StepHook):
    """Profile the steps of `window` ('A:B', 1-based) and write the summary to `out_dir` (module docstring)."""

    def __init__(
        self, window: str, out_dir: str | Path, rank: int = 0, device: torch.device | None = None, log: Any = None
    ) -> None:
        self.first, self.last = parse_window(window)
        self.rank, self.device, self.log = rank, device, log
        self.path = Path(out_dir) / f"step_profile_rank{rank}.json"
        self.trace_path = Path(out_dir) / f"step_trace_rank{rank}.json.gz"
        self._prof: Any = None
        self._on_gpu = device is not None and device.type == "cuda"
        self._t0 = 0.0

    def _drain(self) -> None:
        if self._on_gpu:
            torch.cuda.synchronize(self.device)

    def _begin(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU]
        if self._on_gpu:
            acts.append(ProfilerActivity.CUDA)
        self._drain()
        self._prof = profile(activities=acts)
        self._prof.__enter__()
        self._t0 = time.perf_counter()

    def start(self) -> None:
        if self.first == 1:
            self._begin()

    def after_step(self, step: int, optimizer: torch.optim.Optimizer | None) -> None:
        if step == self.first - 1:
            self._begin()
        elif step == self.last and self._prof is not None:
            self._drain()
            wall = time.perf_counter() - self._t0
            prof, self._prof = self._prof, None
            prof.__exit__(None, None, None)
            doc = {
                "rank": self.rank,
                "window": [self.first, self.last],
                **summarise(prof, self.last - self.first + 1, wall, self._on_gpu),
            }
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_trace(prof, self.trace_path)
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps(doc, indent=1) + "\n")
            os.replace(tmp, self.path)
            if self.log is not None:
                busy = (
                    f"GPU busy {doc['gpu_busy_ms_per_step']:.1f} ms, {doc['device_ops_per_step']:.0f} device ops/step"
                    if self._on_gpu
                    else "no GPU"
                )
                self.log(
                    f"profile of steps {self.first}-{self.last}: wall {doc['wall_ms_per_step']:.1f} ms/step, {busy} "
                    f"-> {self.path}"
                )

    def close(self) -> None:
        if self._prof is not None:  # the run ended inside the window: nothing written
            self._prof.__exit__(None, None, None)
            self._prof = None


__all__ = ["StepProfile", "parse_window", "union_ms", "summarise"]
