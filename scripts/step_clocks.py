"""The GPU's clock and power during each timed step of an e2e.py run, every variant (is a slow step, or a slower
side, the power cap?).

Runs `benchmarks/e2e.py ARGS...` with every step e2e.py times (its `time_steps`: warm-up and timed steps of each
variant and phase, in e2e.py's order) also timed by CUDA events, while a thread reads NVML every 2 ms: SM clock,
power, clock-throttle reasons (0x4: the software power cap), temperature. Writes one row per step to OUT.md (the
timed run, its step (w: warm-up), GPU ms, host ms of the call, SM MHz min / median, W median / max, throttle
reasons, °C), then each run's energy per timed step (NVML's energy counter), and prints them; the runs are
numbered in the order e2e.py's log names its variants. Needs `pynvml` (nvidia-ml-py) and one GPU:

    python -m torch.distributed.run --standalone --nproc-per-node 1 scripts/step_clocks.py OUT.md -- \
        --model olmoe --variants native/compile,replicated/compile/stepgraph --phases train --warmup 3 --iters 10
"""

from __future__ import annotations

import runpy
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_S = 0.002


def sampler(handle, samples: list, stop: threading.Event) -> None:
    """(host time, SM MHz, W, throttle reasons, °C) every `SAMPLE_S` until `stop`."""
    import pynvml

    while not stop.is_set():
        samples.append(
            (
                time.perf_counter(),
                pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                pynvml.nvmlDeviceGetPowerUsage(handle) / 1000,
                pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle),
                pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU),
            )
        )
        time.sleep(SAMPLE_S)


def rows(runs: list, samples: list) -> list[str]:
    """One Markdown row per timed `run` with the samples taken while its GPU work ran."""
    out = []
    for t0, t1, start, end, label in runs:
        ms = start.elapsed_time(end)
        seen = [s for s in samples if t0 <= s[0] <= t0 + ms / 1e3]
        if not seen:
            continue
        clock, watts = [s[1] for s in seen], [s[2] for s in seen]
        reasons = ", ".join(hex(r) for r in sorted({s[3] for s in seen}))
        out.append(
            f"| {label} | {ms:.2f} | {1e3 * (t1 - t0):.2f} | {min(clock)} / {statistics.median(clock):.0f} | "
            f"{statistics.median(watts):.0f} / {max(watts):.0f} | {reasons} | {max(s[4] for s in seen)} |"
        )
    return out


def joules_per_step(counters_mJ: list[int], warmup: int) -> float:
    """The mean energy of a run's timed steps (J): NVML's energy counter read before each step (after e2e.py's
    synchronisation) and once after the last, the warm-ups' readings skipped; the idle gaps between steps (the
    next batch drawn, the barrier) count with them."""
    timed = counters_mJ[warmup:]
    return (timed[-1] - timed[0]) / 1e3 / (len(timed) - 1)


def clocked(plain, handle, runs: list, energy: list):
    """e2e.py's `time_steps` with every step also timed by CUDA events (`runs`: host start and end, the events, a
    label "run / step", "w" for a warm-up) and each run's energy per timed step (`energy`: (run, J))."""
    import pynvml
    import torch

    count = [0]

    def clocked_steps(step, inputs, warmup, iters, device):
        count[0] += 1
        run, counters = count[0], []

        def clocked_step(x):
            counters.append(pynvml.nvmlDeviceGetTotalEnergyConsumption(handle))
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            result = step(x)
            end.record()
            done = len(counters)
            label = f"{run} / {'w' if done <= warmup else ''}{done - (0 if done <= warmup else warmup)}"
            runs.append((t0, time.perf_counter(), start, end, label))
            return result

        result = plain(clocked_step, inputs, warmup, iters, device)
        torch.cuda.synchronize()
        counters.append(pynvml.nvmlDeviceGetTotalEnergyConsumption(handle))
        energy.append((run, joules_per_step(counters, warmup)))
        return result

    return clocked_steps


def main() -> int:
    if len(sys.argv) < 3 or sys.argv[2] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    import pynvml
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import _timing  # (e2e.py binds its `time_steps` when it imports it: replaced first)

    out, argv = Path(sys.argv[1]), sys.argv[3:]
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    samples: list = []
    runs: list = []
    energy: list = []
    stop = threading.Event()
    threading.Thread(target=sampler, args=(handle, samples, stop), daemon=True).start()
    _timing.time_steps = clocked(_timing.time_steps, handle, runs, energy)
    sys.argv = [str(ROOT / "benchmarks" / "e2e.py"), *argv]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        stop.set()
        torch.cuda.synchronize()
        table = "\n".join(
            [
                "| run / step | GPU ms | host ms | SM MHz min / median | W median / max | throttle reasons | °C |",
                "|---|---|---|---|---|---|---|",
                *rows(runs, samples),
                "",
                "| run | J per timed step (NVML energy counter) |",
                "|---|---|",
                *(f"| {run} | {joules:.2f} |" for run, joules in energy),
            ]
        )
        out.write_text(table + "\n")
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
