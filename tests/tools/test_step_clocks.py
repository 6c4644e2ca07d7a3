"""scripts/step_clocks.py: each timed step's row takes the NVML samples read while its GPU work ran, no others."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import step_clocks  # noqa: E402


class Elapsed:
    """Stands in for a CUDA event pair: `start.elapsed_time(end)` in ms."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def elapsed_time(self, end: object) -> float:
        return self.ms


def test_a_step_row_holds_the_samples_of_its_gpu_time_only():
    rng = random.Random()
    t0, ms = rng.uniform(10, 20), rng.uniform(100, 200)
    inside = [(t0 + ms / 1e3 * f, clock, watts, 0x4, 60) for f, clock, watts in ((0.1, 1500, 690), (0.9, 1800, 700))]
    before = (t0 - 0.001, 1980, 100, 0x0, 50)
    after = (t0 + ms / 1e3 + 0.001, 1200, 800, 0x8, 80)  # after the GPU finished: not this step's
    runs = [(t0, t0 + 0.002, Elapsed(ms), None, 7), (t0 + 10, t0 + 10.001, Elapsed(ms), None, 8)]
    rows = step_clocks.rows(runs, [before, *inside, after])
    assert len(rows) == 1  # the second step has no sample: no row
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[0] == "7" and float(cells[1]) == round(ms, 2) and float(cells[2]) == 2.0
    assert cells[3] == "1500 / 1650" and cells[4] == "695 / 700" and cells[5] == "0x4" and cells[6] == "60"


def test_without_its_arguments_it_prints_how_to_run_it():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "step_clocks.py")], capture_output=True, text=True)
    assert proc.returncode == 2 and "step_clocks.py OUT.md --" in proc.stderr


def test_a_runs_energy_is_its_timed_steps_from_the_counter_between_them():
    """Energy per timed step from the counter interpolated at the first timed step's start and the last one's GPU
    end (the warm-ups and what comes after left out), and the mean power over that time."""
    rng = random.Random()
    watts, t0 = rng.uniform(300, 700), rng.uniform(10, 20)
    samples = [(t0 + 0.02 * i, round(1e6 + watts * 1e3 * 0.02 * i)) for i in range(200)]  # (mJ, a steady draw)
    ms = rng.uniform(100, 150)
    starts = [t0 + 0.5 + 0.2 * i for i in range(5)]  # two warm-ups, three timed steps
    labels = ["1 / w1", "1 / w2", "1 / 1", "1 / 2", "1 / 3"]
    runs = [(t, t + 0.001, Elapsed(ms), None, label) for t, label in zip(starts, labels)]
    (row,) = step_clocks.run_energy(runs, samples)
    cells = [c.strip() for c in row.strip("|").split("|")]
    seconds = starts[-1] + ms / 1e3 - starts[2]
    assert cells[0] == "1" and abs(float(cells[1]) - watts * seconds / 3) < 0.02 and abs(float(cells[2]) - watts) < 1
    assert step_clocks.joules_over(samples, t0 - 5, t0 - 4) == 0.0  # before the samples: the first reading


def test_a_back_to_back_windows_energy_is_per_call():
    """A back-to-back run is one window of N calls ("b2b K / xN"): its energy per call is the counter over the
    window divided by N, its power the window's mean; the step runs beside it keep their own rows."""
    rng = random.Random()
    watts, t0, calls = rng.uniform(300, 700), rng.uniform(10, 20), rng.randint(5, 12)
    samples = [(t0 + 0.02 * i, round(1e6 + watts * 1e3 * 0.02 * i)) for i in range(400)]
    ms = rng.uniform(1000, 2000)
    window = (t0 + 1, t0 + 3, Elapsed(ms), None, f"b2b 1 / x{calls}")
    runs = [(t0 + 0.5, t0 + 0.501, Elapsed(100.0), None, "1 / 1"), window]
    step_row, window_row = step_clocks.run_energy(runs, samples)
    assert step_row.startswith("| 1 |")
    cells = [c.strip() for c in window_row.strip("|").split("|")]
    assert cells[0] == "b2b 1"
    assert abs(float(cells[1]) - watts * ms / 1e3 / calls) < 0.02 and abs(float(cells[2]) - watts) < 1
