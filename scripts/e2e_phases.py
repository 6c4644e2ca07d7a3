"""How an e2e.py report's phases are named on the pages that read it (current_numbers.py, targets_report.py)."""

from __future__ import annotations


def phase_label(doc: dict, phase: str) -> str:
    """`phase`, or for a train phase of accumulated micro-batches (`--accumulate K`, K > 1) "train xK": another
    workload (K micro-batches a step), so its figures never stand in for the one-batch step's."""
    count = int(doc.get("config", {}).get("accumulate", 1) or 1)
    return f"{phase} x{count}" if phase == "train" and count > 1 else phase
