"""Time `occult place --method hypergraph` on a 16-layer x 64-expert x 200k-token top-8 trace, 4 devices.

Writes the trace(s) once to a cache directory, then runs the real command line in a fresh
process and reports its wall time (trace loading, all solvers, statistics and the report
included) and the E[C_T] it reached:

    python scripts/time_place.py [--kind planted|uniform|both] [--dir /tmp/occult-timing]

`planted`: hidden groups of 16 experts, 15% noise, skewed popularity (skew 0.5) -- routing
with structure to find. `uniform`: nothing to find, the refinement's worst case (many
tiny improving swaps).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPE = dict(num_tokens=200_000, num_experts=64, top_k=8, num_layers=16)


def make(kind: str, path: Path) -> None:
    from occult.placement.synthetic import planted_trace, uniform_trace

    if kind == "planted":
        pt = planted_trace(**SHAPE, num_groups=4, noise=0.15, skew=0.5, seed=1)
        trace = pt.trace
        trace.metadata["planted_groups"] = json.dumps(pt.groups_LE.tolist())
    else:
        trace = uniform_trace(**SHAPE, seed=1)
    trace.save(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=("planted", "uniform", "both"), default="both")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/occult-timing"))
    ap.add_argument("--method", default="hypergraph")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    args.dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for kind in ("planted", "uniform") if args.kind == "both" else (args.kind,):
        path = args.dir / f"{kind}_16x64x200k.safetensors"
        if not path.exists():
            make(kind, path)
        cmd = [
            sys.executable,
            "-m",
            "occult",
            "place",
            "--trace",
            str(path),
            "--devices",
            "4",
            "--method",
            args.method,
            "--json",
            "--quiet",
            "--out",
            str(args.dir / f"{kind}_placement.json"),
        ]
        t0 = time.perf_counter()
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if out.returncode:
            sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr}")
        rep = json.loads(out.stdout)
        o = rep["overall"]
        line = (
            f"{kind:8s} wall {wall:5.1f} s (solver {rep['seconds']:.1f} s)  E[C_T] contiguous "
            f"{o['baseline']['mean_ct']:.4f} -> {args.method} {o['placement']['mean_ct']:.4f} "
            f"({100 * o['reduction']:.1f}% lower)"
        )
        if kind == "planted":
            from occult.placement import Placement
            from occult.placement.stats import mean_ct
            from occult.placement.trace import read_trace

            trace = read_trace(path)
            groups = json.loads(trace.metadata["planted_groups"])
            planted = Placement(groups, 4)
            opt = sum(
                mean_ct(trace.layer(i), planted.expert_device(i), 4) * trace.num_tokens[i]
                for i in range(trace.num_layers)
            ) / sum(trace.num_tokens)
            line += f"; planted optimum {opt:.4f} ({100 * (o['placement']['mean_ct'] / opt - 1):+.2f}%)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
