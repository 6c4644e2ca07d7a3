"""Which exchanges of a profiled step run with nothing under them: each all-to-all or all-reduce kernel of one
step, in time order, with the part of it no other kernel covers.

Reads a profiler timeline (`scripts/profile_model.py --traces`, `--profile-steps`' `step_trace_rank{r}.json.gz`,
or any Chrome trace torch.profiler exports, gzipped or not). The trace holds `--steps` steps of the same kernels
(a recorded step replays them; eager steps launch the same ones), so its kernels, in start order, are cut into
that many equal runs and `--step` picks one (default: the middle one). For every exchange kernel or copy
(`occult.training.step_profile.is_exchange`: NCCL's, the device transport's push and barrier, the host transport's
copies to and from pinned memory) of that step it
prints when it starts (ms from the step's first kernel), how long it runs, how much of it no compute kernel
covers ("exposed"), its stream and name; then totals per kernel kind, the exchanges exposed longest, and the
step's compute idle time by what runs under it (exchange copies, exchange kernels, both, nothing), and with
`--stalls MS` each stretch of at least MS with no compute kernel: what runs under it and the device work that
starts at its end (what the compute waited for: docs/overlap.md, "The host transport, round 3"). Exposed
exchange time is what an overlap schedule has left to hide (docs/overlap.md, session 26's slow-link profile).
Each kernel's exposed part is its own: where two exchanges run at once (an all-reduce beside an all-to-all) both
count it, so the total can exceed `profile_model.py`'s union figure.

    python scripts/trace_exchanges.py prof/trace_dedup_syncfree-compile-stepgraph-twobatch_train_rank0.json.gz \\
        --steps 5 --top 8 --stalls 0.5
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trace_gaps import load_events  # noqa: E402  (scripts/trace_gaps.py: a trace's complete events)

DEVICE = ("kernel", "gpu_memcpy")  # a step's device work: kernels, and copies (the host transport's exchanges)

from occult.training.step_profile import is_exchange, merged  # noqa: E402


def step_kernels(events: list[dict], steps: int, step: int) -> list[dict]:
    """The kernels and copies of step `step` (0-based) of `steps` in the trace, in start order."""
    kernels = sorted((e for e in events if e.get("cat") in DEVICE), key=lambda e: e["ts"])
    if not kernels:
        raise ValueError("the trace holds no kernel or copy events: profile with CUDA activities on")
    if len(kernels) % steps:
        raise ValueError(
            f"{len(kernels)} kernels do not split into {steps} steps of the same kernels: give --steps as the "
            "number of steps profiled"
        )
    per = len(kernels) // steps
    return kernels[step * per : (step + 1) * per]


def exposed_us(start: float, end: float, cover: list[tuple[float, float]]) -> float:
    """How much of [start, end) no interval of `cover` (sorted, disjoint) overlaps, in the same unit."""
    covered = sum(max(0.0, min(end, c_end) - max(start, c_start)) for c_start, c_end in cover)
    return (end - start) - covered


def exchange_rows(kernels: list[dict]) -> list[dict]:
    """Each exchange kernel of one step: start (ms from the step's first kernel), ms, exposed ms, stream, name."""
    cover = merged([(e["ts"], e["ts"] + e["dur"]) for e in kernels if not is_exchange(e["name"])])
    first = kernels[0]["ts"]
    return [
        {
            "start_ms": (e["ts"] - first) / 1e3,
            "ms": e["dur"] / 1e3,
            "exposed_ms": exposed_us(e["ts"], e["ts"] + e["dur"], cover) / 1e3,
            "stream": e.get("args", {}).get("stream"),
            "name": e["name"],
        }
        for e in kernels
        if is_exchange(e["name"])
    ]


def _meet(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Where two sorted, disjoint interval lists both cover."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        i, j = (i + 1, j) if a[i][1] < b[j][1] else (i, j + 1)
    return out


def _minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of sorted, disjoint intervals `a` that sorted, disjoint `b` does not cover."""
    out = []
    for start, end in a:
        at = start
        for b_start, b_end in b:
            if b_end <= at or b_start >= end:
                continue
            if b_start > at:
                out.append((at, b_start))
            at = max(at, b_end)
        if at < end:
            out.append((at, end))
    return out


def idle_breakdown(kernels: list[dict]) -> dict[str, float]:
    """Of one step's span (its first kernel's start to its last one's end), the ms no compute kernel runs, and what
    runs then: exchange copies alone (the host transport's), exchange kernels alone (NCCL's, the device
    transport's), both, or nothing (a wait on the host or on a peer)."""
    spans = {"compute": [], "copy": [], "kernel": []}
    for e in kernels:
        group = "compute" if not is_exchange(e["name"]) else "copy" if e.get("cat") == "gpu_memcpy" else "kernel"
        spans[group].append((e["ts"], e["ts"] + e["dur"]))
    compute, copies, exchange_kernels = (merged(spans[k]) for k in ("compute", "copy", "kernel"))
    step = [(min(e["ts"] for e in kernels), max(e["ts"] + e["dur"] for e in kernels))]
    idle = _minus(step, compute)
    ms = lambda intervals: sum(end - start for start, end in intervals) / 1e3  # noqa: E731
    return {
        "step_ms": ms(step),
        "compute_ms": ms(compute),
        "idle_ms": ms(idle),
        "copies_alone_ms": ms(_minus(_meet(idle, copies), exchange_kernels)),
        "exchange_kernels_alone_ms": ms(_minus(_meet(idle, exchange_kernels), copies)),
        "both_ms": ms(_meet(_meet(idle, copies), exchange_kernels)),
        "nothing_ms": ms(_minus(idle, merged(spans["copy"] + spans["kernel"]))),
    }


def idle_line(idle: dict[str, float]) -> str:
    return (
        f"compute idle {idle['idle_ms']:.2f} ms of the step's {idle['step_ms']:.2f} (compute busy "
        f"{idle['compute_ms']:.2f}): exchange copies alone {idle['copies_alone_ms']:.2f}, exchange kernels alone "
        f"{idle['exchange_kernels_alone_ms']:.2f}, both {idle['both_ms']:.2f}, nothing {idle['nothing_ms']:.2f}"
    )


def stalls(kernels: list[dict], min_ms: float) -> list[dict]:
    """Each stretch of one step of at least `min_ms` with no compute kernel: start (ms from the step's first kernel),
    ms, the exchanges running in it (kinds, each once) and the device work starting within 0.05 ms of its end (the
    first of it the compute)."""
    compute = merged([(e["ts"], e["ts"] + e["dur"]) for e in kernels if not is_exchange(e["name"])])
    first = kernels[0]["ts"]
    rows = []
    for start, end in _minus([(first, max(e["ts"] + e["dur"] for e in kernels))], compute):
        if end - start < min_ms * 1e3:
            continue
        under = [e for e in kernels if is_exchange(e["name"]) and e["ts"] < end and e["ts"] + e["dur"] > start]
        resume = sorted((e for e in kernels if end - 50.0 <= e["ts"] <= end + 50.0), key=lambda e: e["ts"])
        rows.append(
            {
                "start_ms": (start - first) / 1e3,
                "ms": (end - start) / 1e3,
                "under": list(dict.fromkeys(kind(e["name"]) for e in under)),
                "then": [(e.get("args", {}).get("stream"), kind(e["name"])) for e in resume],
            }
        )
    return rows


def stalls_report(rows: list[dict], min_ms: float) -> str:
    lines = [f"stretches of >= {min_ms:g} ms with no compute kernel ({len(rows)}):"]
    for r in rows:
        then = "; ".join(f"{name} (stream {stream})" for stream, name in r["then"][:4]) or "nothing"
        lines.append(
            f"  {r['ms']:6.2f} ms at {r['start_ms']:.2f} ms  under it: {', '.join(r['under']) or 'nothing'}  "
            f"then: {then}"
        )
    return "\n".join(lines)


def kind(name: str) -> str:
    """A kernel's short kind: NCCL's collective (`SendRecv`, `AllReduce_Sum_bf16_RING_LL`), occult's kernel, a copy's
    direction or a C++ kernel's qualified name."""
    if name.startswith("ncclDevKernel_"):
        return name[len("ncclDevKernel_") :].split("(")[0]
    name = name.replace("(anonymous namespace)::", "").removeprefix("void ")  # (a C++ kernel: its name, no template)
    return name.split("<")[0].split("(")[0].strip()


def report(rows: list[dict], top: int) -> str:
    lines = [f"{'start ms':>9} {'ms':>7} {'exposed':>8}  {'stream':>6}  kernel"]
    lines += [
        f"{r['start_ms']:9.2f} {r['ms']:7.2f} {r['exposed_ms']:8.2f}  {r['stream']!s:>6}  {kind(r['name'])}"
        for r in rows
    ]
    kinds: dict[str, list[float]] = {}
    for r in rows:
        total = kinds.setdefault(kind(r["name"]), [0, 0.0, 0.0])
        total[0] += 1
        total[1] += r["ms"]
        total[2] += r["exposed_ms"]
    lines += ["", f"{'kind':<40} {'kernels':>7} {'ms':>8} {'exposed':>8}"]
    lines += [f"{k:<40} {n:>7} {ms:8.2f} {ex:8.2f}" for k, (n, ms, ex) in sorted(kinds.items())]
    lines.append(
        f"{'all exchanges':<40} {len(rows):>7} {sum(r['ms'] for r in rows):8.2f} "
        f"{sum(r['exposed_ms'] for r in rows):8.2f}"
    )
    worst = sorted(rows, key=lambda r: -r["exposed_ms"])[:top]
    lines += ["", f"exposed longest ({len(worst)}):"]
    lines += [
        f"  {r['exposed_ms']:6.2f} ms of {r['ms']:.2f} at {r['start_ms']:.2f} ms  {kind(r['name'])}" for r in worst
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", type=Path, help="a Chrome trace (.json or .json.gz) of whole steps")
    p.add_argument("--steps", type=int, default=5, help="steps the trace holds (profile_model.py's --steps, 5)")
    p.add_argument("--step", type=int, default=None, help="which one, 0-based (default: the middle one)")
    p.add_argument("--top", type=int, default=10, help="exchanges exposed longest to list")
    p.add_argument(
        "--stalls", type=float, default=None, metavar="MS", help="also list each stretch of >= MS with no compute"
    )
    a = p.parse_args(argv)
    if a.steps < 1 or a.top < 0:
        p.error("--steps must be >= 1 and --top >= 0")
    if a.stalls is not None and not a.stalls > 0:
        p.error(f"--stalls must be > 0 ms, got {a.stalls}")
    step = a.steps // 2 if a.step is None else a.step
    if not 0 <= step < a.steps:
        p.error(f"--step must be in [0, {a.steps}), got {step}")
    if not a.trace.is_file():
        p.error(f"no trace file {a.trace}")
    try:
        kernels = step_kernels(load_events(a.trace), a.steps, step)
    except ValueError as e:
        p.error(str(e))
    print(report(exchange_rows(kernels), a.top))
    if a.stalls is not None:
        print("\n" + stalls_report(stalls(kernels, a.stalls), a.stalls))
    print("\n" + idle_line(idle_breakdown(kernels)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
