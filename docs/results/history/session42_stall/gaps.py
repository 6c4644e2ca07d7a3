"""The spans of a profiled step where nothing but NCCL runs on the GPU: python gaps.py TRACE.json.gz."""

import gzip
import json
import sys

KINDS = ("kernel", "gpu_memcpy", "gpu_memset")

trace = json.load(gzip.open(sys.argv[1]))
events = sorted(
    (e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in KINDS), key=lambda e: e["ts"]
)
t0 = events[0]["ts"]
nccl = [e for e in events if "nccl" in e["name"].lower()]
print("nccl kernels", len(nccl), "longest (ms)", sorted(round(e["dur"] / 1000, 2) for e in nccl)[-5:])
other = [e for e in events if "nccl" not in e["name"].lower()]
end = other[0]["ts"]
for e in other:
    if e["ts"] > end + 500:  # (us)
        at, span = (end - t0) / 1000, (e["ts"] - end) / 1000
        print(f"gap at {at:.2f} ms for {span:.2f} ms; then {e['tid']} {e['name'][:60]}")
    end = max(end, e["ts"] + e["dur"])
