"""Probe (kept with its results, not a tool): benchmarks/e2e.py with, after each variant's timed steps, the caching
allocator's segments summed by stream and memory pool (`torch.cuda.memory_snapshot()`), printed as one SNAP line.

Run from the repo root: torchrun --nproc-per-node 1 probe_mem.py <e2e.py arguments>."""

import collections
import json
import sys

import torch

sys.path.insert(0, "benchmarks")
import e2e  # noqa: E402

time_steps = e2e.time_steps


def _summed_segments() -> dict[str, dict[str, float]]:
    """GiB reserved and allocated, segment count and largest segment, per (stream, pool), largest first."""
    sums = collections.defaultdict(lambda: [0, 0, 0, 0])
    for seg in torch.cuda.memory_snapshot():
        entry = sums[f"stream {seg['stream']} pool {seg.get('segment_pool_id')}"]
        entry[0] += seg["total_size"]
        entry[1] += seg["allocated_size"]
        entry[2] += 1
        entry[3] = max(entry[3], seg["total_size"])
    ordered = sorted(sums.items(), key=lambda kv: -kv[1][0])
    gib = 2**30
    return {
        key: {"reserved_gib": v[0] / gib, "allocated_gib": v[1] / gib, "segments": v[2], "largest_gib": v[3] / gib}
        for key, v in ordered
    }


def timed_then_summed(step, args, vocab, device, shared=False):
    out = time_steps(step, args, vocab, device, shared)
    print("SNAP " + json.dumps(_summed_segments()), flush=True)
    return out


e2e.time_steps = timed_then_summed
sys.exit(e2e.main(sys.argv[1:]))
