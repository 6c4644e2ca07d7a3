"""Probe (not in the repo): e2e.py with a memory snapshot after each variant's timed steps, segments summed by stream and pool."""
import collections, json, sys
import torch
sys.path.insert(0, "benchmarks")
import e2e

orig = e2e.time_steps

def wrapped(step, args, vocab, device, shared=False):
    out = orig(step, args, vocab, device, shared)
    agg = collections.defaultdict(lambda: [0, 0, 0, 0])
    for seg in torch.cuda.memory_snapshot():
        key = f"stream {seg['stream']} pool {seg.get('segment_pool_id')}"
        agg[key][0] += seg["total_size"]; agg[key][1] += seg["allocated_size"]; agg[key][2] += 1
        agg[key][3] = max(agg[key][3], seg["total_size"])
    rows = {k: {"reserved_gib": v[0] / 2**30, "allocated_gib": v[1] / 2**30, "segments": v[2], "largest_gib": v[3] / 2**30} for k, v in sorted(agg.items(), key=lambda kv: -kv[1][0])}
    print("SNAP " + json.dumps(rows), flush=True)
    return out

e2e.time_steps = wrapped
sys.exit(e2e.main(sys.argv[1:]))
