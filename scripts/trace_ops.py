"""Which torch ops launched a profiled step's kernels, by total GPU time: a kernel family split by its callers.

Reads a profiler timeline (`scripts/profile_model.py --traces`, `--profile-steps`' `step_trace_rank{r}.json.gz`,
or any Chrome trace torch.profiler exports), links every kernel to the runtime call that launched it (their
`correlation` id) and that call to the torch ops open around it on its host thread, and prints the largest groups of
(kernel, innermost `--depth` ops): launches and total ms. It names what a family total hides, e.g. which copies are
the loss's fp32 logits and which a MoE layer's (session 22: the logits' upcast, its backward and the NLL zero-fill
were ~2 ms of "copy/index" on both sides of an e2e.py step). Kernels launched inside a CUDA graph replay or a
compiled region show the replay or the region's op, not the op inside it.

    python scripts/trace_ops.py prof/trace_replicated-compile_train_rank0.json.gz --top 15 --match copy
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trace_gaps import load_events  # noqa: E402  (scripts/trace_gaps.py: a trace's complete events)

HOST = ("cpu_op", "user_annotation")  # torch ops, and named host regions
LAUNCH = ("cuda_runtime", "cuda_driver")  # the calls that launch kernels


def launching_ops(events: list[dict]) -> dict[int, tuple[str, ...]]:
    """correlation id -> the names of the host ops open around its launch on its thread, outermost first."""
    per_thread: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("cat") in HOST or e.get("cat") in LAUNCH:
            per_thread[(e.get("pid"), e.get("tid"))].append(e)
    chains = {}
    for thread in per_thread.values():
        thread.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))  # an op before the ops and launches it encloses
        open_ops: list[dict] = []
        for e in thread:
            while open_ops and open_ops[-1]["ts"] + open_ops[-1].get("dur", 0) < e["ts"]:
                open_ops.pop()
            if e.get("cat") in HOST:
                open_ops.append(e)
            elif (corr := e.get("args", {}).get("correlation")) is not None:
                chains[corr] = tuple(op["name"] for op in open_ops)
    return chains


def kernels_by_op(events: list[dict], depth: int, match: str = "") -> list[tuple[str, tuple[str, ...], int, float]]:
    """(kernel name, innermost `depth` launching ops, launches, total us) for kernels whose name contains `match`
    (case-insensitive), largest total first."""
    chains = launching_ops(events)
    groups: dict[tuple[str, tuple[str, ...]], list[float]] = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") != "kernel" or match.lower() not in e["name"].lower():
            continue
        chain = chains.get(e.get("args", {}).get("correlation"), ())
        group = groups[(e["name"], chain[-depth:] if depth > 0 else ())]
        group[0] += 1
        group[1] += e.get("dur", 0.0)
    rows = [(name, chain, int(n), us) for (name, chain), (n, us) in groups.items()]
    return sorted(rows, key=lambda r: -r[3])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", type=Path, help="a Chrome trace (.json or .json.gz) with host ops and kernels")
    p.add_argument("--top", type=int, default=20, help="groups to print (default 20)")
    p.add_argument("--depth", type=int, default=4, help="innermost launching ops that name a group (default 4)")
    p.add_argument("--match", default="", help="only kernels whose name contains this (case-insensitive)")
    args = p.parse_args(argv)
    if not args.trace.is_file():
        raise SystemExit(f"trace_ops.py: no trace at {args.trace}")
    rows = kernels_by_op(load_events(args.trace), args.depth, args.match)
    if not rows:
        raise SystemExit(
            f"trace_ops.py: no kernel in {args.trace}" + (f" matching {args.match!r}" if args.match else "")
        )
    total = sum(r[3] for r in rows)
    print(f"{len(rows)} groups, {sum(r[2] for r in rows)} launches, {total / 1e3:.2f} ms of kernels")
    print("| ms | launches | kernel | launched inside (outermost first) |\n|---|---|---|---|")
    for name, chain, n, us in rows[: args.top]:
        print(f"| {us / 1e3:.3f} | {n} | `{name[:80]}` | {' > '.join(chain) or '-'} |")


if __name__ == "__main__":
    main()
