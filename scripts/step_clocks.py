"""The GPU's clock and power during each timed step of an e2e.py run, every variant (is a slow step, or a slower
side, the power cap?).

Runs `benchmarks/e2e.py ARGS...` with every step e2e.py times (its `time_steps`: warm-up and timed steps of each
variant and phase, in e2e.py's order) also timed by CUDA events, and each of its back-to-back runs (`back_to_back`)
as one window ("b2b K / xN": the K-th, N calls), while a thread reads NVML every 2 ms: SM clock,
power, clock-throttle reasons (0x4: the software power cap), temperature. Writes one row per step to OUT.md (the
timed run, its step (w: warm-up), GPU ms, host ms of the call, SM MHz min / median, W median / max, throttle
reasons, °C), then each run's energy per timed step and mean power (NVML's energy counter, read by a thread of
its own every 20 ms), and prints them; the runs are
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
ENERGY_S = 0.02


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


def energy_sampler(handle, samples: list, stop: threading.Event) -> None:
    """(host time, NVML's energy counter in mJ) every `ENERGY_S` until `stop`: a thread of its own, since one read
    takes milliseconds (inside a timed step it lengthened the step by 4-6 ms)."""
    import pynvml

    while not stop.is_set():
        samples.append((time.perf_counter(), pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)))
        time.sleep(ENERGY_S)


def joules_over(samples: list, start: float, end: float) -> float:
    """The energy (J) between host times `start` and `end`, the counter interpolated linearly between the samples
    around each (a time outside the samples: the nearest sample's reading)."""

    def reading(t: float) -> float:
        before = [x for x in samples if x[0] <= t]
        after = [x for x in samples if x[0] >= t]
        if not before or not after:
            return (before or after)[-1 if before else 0][1]
        (t0, e0), (t1, e1) = before[-1], after[0]
        return e0 if t1 == t0 else e0 + (e1 - e0) * (t - t0) / (t1 - t0)

    return (reading(end) - reading(start)) / 1e3


def run_energy(runs: list, samples: list) -> list[str]:
    """One Markdown row per run: its timed steps' energy per step and mean power, from the first timed step's start
    to the last one's GPU end (the gaps between steps, batch and barrier, counted with them)."""
    out = []
    for run in dict.fromkeys(label.split(" / ")[0] for *_, label in runs):
        if run.startswith("b2b"):  # one window of N calls back to back (`clocked_back_to_back`)
            (r,) = [r for r in runs if r[4].startswith(f"{run} / ")]
            start, end, calls = r[0], r[0] + r[2].elapsed_time(r[3]) / 1e3, int(r[4].split(" / x")[1])
            joules = joules_over(samples, start, end)
            out.append(f"| {run} | {joules / calls:.2f} | {joules / (end - start):.0f} |")
            continue
        timed = [r for r in runs if r[4].startswith(f"{run} / ") and "w" not in r[4]]
        if not timed:
            continue
        start, end = timed[0][0], timed[-1][0] + timed[-1][2].elapsed_time(timed[-1][3]) / 1e3
        joules = joules_over(samples, start, end)
        out.append(f"| {run} | {joules / len(timed):.2f} | {joules / (end - start):.0f} |")
    return out


def clocked(plain, runs: list):
    """e2e.py's `time_steps` with every step also timed by CUDA events (`runs`: host start and end, the events, a
    label "run / step", "w" for a warm-up)."""
    import torch

    count = [0]

    def clocked_steps(step, inputs, warmup, iters, device):
        count[0] += 1
        run, done = count[0], [0]

        def clocked_step(x):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            result = step(x)
            end.record()
            done[0] += 1
            label = f"{run} / {'w' if done[0] <= warmup else ''}{done[0] - (0 if done[0] <= warmup else warmup)}"
            runs.append((t0, time.perf_counter(), start, end, label))
            return result

        return plain(clocked_step, inputs, warmup, iters, device)

    return clocked_steps


def clocked_back_to_back(plain, runs: list):
    """e2e.py's `back_to_back` with its whole window timed by CUDA events and its calls counted (`runs`: as
    `clocked`'s, one entry labelled "b2b K / xN", the K-th back-to-back run of N calls, the first from an idle GPU
    among them)."""
    import torch

    count = [0]

    def clocked_run(step, inputs, iters, device):
        count[0] += 1
        calls = [0]

        def counted(x):
            calls[0] += 1
            return step(x)

        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        ms = plain(counted, inputs, iters, device)
        end.record()
        runs.append((t0, time.perf_counter(), start, end, f"b2b {count[0]} / x{calls[0]}"))
        return ms

    return clocked_run


def main() -> int:
    if len(sys.argv) < 3 or sys.argv[2] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import _timing  # (e2e.py binds its `time_steps` when it imports it: replaced first)
    from _nvml import nvml_handle  # (benchmarks/_nvml.py: the card by its PCI bus id, not torch's index)

    out, argv = Path(sys.argv[1]), sys.argv[3:]
    handle = nvml_handle(torch.cuda.current_device())
    samples: list = []
    energy: list = []
    runs: list = []
    stop = threading.Event()
    threading.Thread(target=sampler, args=(handle, samples, stop), daemon=True).start()
    threading.Thread(target=energy_sampler, args=(handle, energy, stop), daemon=True).start()
    _timing.time_steps = clocked(_timing.time_steps, runs)
    _timing.back_to_back = clocked_back_to_back(_timing.back_to_back, runs)
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
                "| run | J per timed step (NVML energy counter) | mean W |",
                "|---|---|---|",
                *run_energy(runs, energy),
            ]
        )
        out.write_text(table + "\n")
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
