"""benchmarks/bench_kernels.py --energy: each expert product's energy per call becomes pJ per FLOP and mean power in
the table, from the FLOPs `part_flops` gives it (the NVML reading itself needs a GPU: docs/kernels.md)."""

from __future__ import annotations

import random
import sys

import torch
from _bench_helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_kernels  # noqa: E402


def test_every_energy_row_has_its_flops_and_the_table_divides_by_them():
    P, H, F = random.randint(64, 4096), random.choice([64, 128]), random.choice([32, 96])
    prob = {"P": P, "x": torch.empty(1, H), "w2": torch.empty(1, H, F)}
    flops = bench_kernels.part_flops(prob)
    assert all(part in flops for _, _, part in bench_kernels.ENERGY_ROWS)
    label, key, part = random.choice(bench_kernels.ENERGY_ROWS)
    joules, ms = random.uniform(0.01, 1.0), random.uniform(0.1, 2.0)
    report = {"shapes": {"s": {"joules": {key: joules}, "energy_ms": {key: ms}, "part_flops": flops}}}
    lines: list[str] = []
    bench_kernels.energy_table(report, lines.append)
    (row,) = [line for line in lines if line.strip().startswith(label)]
    cells = row[len(label) + 2 :].split()
    assert float(cells[0]) == round(joules, 4) and cells[1] == "J"
    assert abs(float(cells[2]) - 1e12 * joules / flops[part]) <= 0.01 and cells[3] == "pJ/FLOP"
    assert abs(float(cells[4]) - joules / (ms * 1e-3)) <= 1 and cells[5] == "W"
    others = [line for line in lines if line.startswith("  ") and not line.strip().startswith(label)]
    assert others and all("nan J" in line for line in others)  # (not measured: said, not made up)
