"""Where a profiled step leaves the GPU idle: the gaps between its device work and the host ops inside them.

Reads a profiler timeline (`step_trace_rank{r}.json.gz` from `--profile-steps`, or any Chrome trace
torch.profiler exports, gzipped or not), merges every kernel, copy and memset interval, and reports the
gaps longer than `--min-us` between them: how many, their total, the largest few with the kernels on either
side, and the host operations that started inside the gaps, by total time. Gaps with host ops inside mean the
GPU waited for the host to launch (a host-bound step); gaps without any mean the host waited (a sync, or
another rank).

    python scripts/trace_gaps.py run/step_trace_rank0.json.gz --top 10
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import Counter
from pathlib import Path

DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")
HOST = ("cpu_op", "user_annotation")  # torch ops, and named host regions (FSDP's, `occult::agree`)


def load_events(path: Path) -> list[dict]:
    """The complete ("X") events of a Chrome trace file."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def device_spans(events: list[dict]) -> list[tuple[float, float, str, str]]:
    """Device work merged into disjoint spans: (start us, end us, first kernel's name, last kernel's name)."""
    spans: list[list] = []
    for e in sorted((e for e in events if e.get("cat") in DEVICE), key=lambda e: e["ts"]):
        start, end = e["ts"], e["ts"] + e["dur"]
        if spans and start <= spans[-1][1]:
            if end > spans[-1][1]:
                spans[-1][1], spans[-1][3] = end, e["name"]
        else:
            spans.append([start, end, e["name"], e["name"]])
    return [tuple(s) for s in spans]


def gaps(events: list[dict], min_us: float) -> list[dict]:
    """The idle gaps longer than `min_us` between device spans, each with the host ops that began inside it."""
    spans = device_spans(events)
    host = sorted((e for e in events if e.get("cat") in HOST), key=lambda e: e["ts"])
    out = []
    for (_, end, _, before), (start, _, after, _) in zip(spans, spans[1:]):
        if start - end > min_us:
            ops = [e for e in host if end <= e["ts"] < start]
            out.append({"us": start - end, "before": before, "after": after, "host_ops": ops})
    return out


def report(path: Path, min_us: float, top: int) -> str:
    found = gaps(load_events(path), min_us)
    lines = [f"{path}: {len(found)} gaps > {min_us:.0f} us, {sum(g['us'] for g in found) / 1e3:.1f} ms in all"]
    for g in sorted(found, key=lambda g: -g["us"])[:top]:
        lines.append(f"  {g['us'] / 1e3:7.2f} ms after {g['before'][:60]!r}, before {g['after'][:60]!r}")
    time_by_op: Counter = Counter()
    calls: Counter = Counter()
    for g in found:
        for e in g["host_ops"]:
            time_by_op[e["name"][:80]] += e["dur"]
            calls[e["name"][:80]] += 1
    lines.append("host ops begun inside the gaps (ms, calls):")
    lines += [f"  {us / 1e3:8.2f} {calls[name]:6d}  {name}" for name, us in time_by_op.most_common(top)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", type=Path, help="a Chrome trace (.json or .json.gz), e.g. OUT/step_trace_rank0.json.gz")
    p.add_argument("--min-us", type=float, default=300.0, help="shortest gap reported, microseconds (default 300)")
    p.add_argument("--top", type=int, default=12, help="gaps and host ops listed (default 12)")
    args = p.parse_args(argv)
    if not args.trace.is_file():
        print(f"trace_gaps.py: error: {args.trace} is not a file", file=sys.stderr)
        return 2
    try:
        print(report(args.trace, args.min_us, args.top))
    except (OSError, ValueError, KeyError) as e:
        print(f"trace_gaps.py: error: {args.trace} is not a Chrome trace ({e})", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
