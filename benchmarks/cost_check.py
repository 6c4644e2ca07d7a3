"""Does the layer cost model predict a GPU count it was not fitted on? (issue 39, item 2)

    python benchmarks/cost_check.py --fit bench_1gpu.json bench_2gpu.json --check bench_4gpu.json \\
        --out docs/results/fourgpu/cost_check_4xH100.json

Fits `occult.placement.cost` on the `occult bench` runs of --fit (one machine, fewer GPUs), then
predicts every run of --check: rows per token (standard: k; dedup: E[C_T] of uniform routing, next
to the measured E[C_T] of the run itself) and the layer's forward and forward+backward times from its
measured E[C_T]. The two-level `dedup2` rows are predicted as `two_level` with the simulated
"nodes" linked by NVLink (the fitted NVLink bandwidth stands in for the inter-node one; E[N_T] of
uniform routing over the nodes). Prints a Markdown table; --out writes the constants and rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from occult._atomic import write_text_atomic  # noqa: E402
from occult.placement.cost import SHAPES, fit, layer_time, measured_from_bench  # noqa: E402
from occult.placement.stats import analytic_mean_ct  # noqa: E402
from occult.tools.run_record import run_record  # noqa: E402


def load(paths: list[str]) -> list[dict[str, Any]]:
    """The bench documents, each with its runs."""
    return [json.loads(Path(p).read_text()) for p in paths]


def predict_run(run: dict[str, Any], runs: list[dict[str, Any]], c: Any, nodes: int) -> dict[str, Any]:
    """Predicted rows and times of one measured bench run, with relative errors. A dedup2 run's
    E[C_T] column counts both stages' rows; its model takes E[C_T] from the flat dedup run of the
    same shape and routing, and its predicted rows are both stages': E[N_T] + E[C_T] (uniform)."""
    shape = SHAPES[run["shape"]]
    D = int(run["world"])
    two_level = run["variant"] == "dedup2"
    variant = "two_level" if two_level else ("standard" if run["variant"] == "standard" else "dedup")
    M = nodes if two_level else 1
    mean_ct = float(run["mean_ct"])
    uniform_ct = float(shape.top_k) if variant == "standard" else analytic_mean_ct(shape.experts, shape.top_k, D)
    mean_nt = analytic_mean_ct(shape.experts, shape.top_k, M)
    if two_level:
        flat = [
            r
            for r in runs
            if r["variant"] == "dedup"
            and r["shape"] == run["shape"]
            and r["routing"] == run["routing"]
            and r["world"] == run["world"]
        ]
        mean_ct = float(flat[0]["mean_ct"]) if flat else uniform_ct
        uniform_ct = uniform_ct + mean_nt  # both stages: one row per destination node, then per GPU
    consts = c.__class__(**{**c.to_dict(), "internode_GBps": c.nvlink_GBps})  # simulated nodes: NVLink
    p = layer_time(shape, int(run["tokens"]), D, M, variant, consts, mean_ct, mean_nt)
    return {
        "point": f"{D}x {run['shape']} {run['routing']} {run['variant']}",
        "rows_per_token": run["mean_ct"],
        "rows_uniform_pred": uniform_ct,
        "forward_ms": run["forward_ms"],
        "forward_pred_ms": p["forward_ms"],
        "forward_err": p["forward_ms"] / run["forward_ms"] - 1,
        "fwd_bwd_ms": run["fwd_bwd_ms"],
        "fwd_bwd_pred_ms": p["fwd_bwd_ms"],
        "fwd_bwd_err": p["fwd_bwd_ms"] / run["fwd_bwd_ms"] - 1,
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| run | rows/token measured (uniform model) | forward ms measured / predicted (err) | "
        "fwd+bwd ms measured / predicted (err) |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['point']} | {r['rows_per_token']:.3f} ({r['rows_uniform_pred']:.3f}) | "
            f"{r['forward_ms']:.2f} / {r['forward_pred_ms']:.2f} ({r['forward_err']:+.0%}) | "
            f"{r['fwd_bwd_ms']:.2f} / {r['fwd_bwd_pred_ms']:.2f} ({r['fwd_bwd_err']:+.0%}) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fit", nargs="+", required=True, help="occult bench JSON of the runs to fit on")
    p.add_argument("--check", nargs="+", required=True, help="occult bench JSON of the runs to predict")
    p.add_argument("--nodes", type=int, default=2, help="simulated nodes of the dedup2 runs")
    p.add_argument("--out", default=None, help="write constants and rows as JSON")
    args = p.parse_args(argv)
    points = [
        m for doc in load(args.fit) for m in measured_from_bench(doc) if m.a2a_ms > 0 and not m.label.endswith("dedup2")
    ]  # fit() divides by a2a_ms
    c = fit(points)
    rows = [predict_run(r, doc["runs"], c, args.nodes) for doc in load(args.check) for r in doc["runs"]]
    print(table(rows))
    within = sum(abs(r["forward_err"]) <= 0.15 for r in rows)
    print(
        f"\n{within} of {len(rows)} forward predictions within 15%; constants: "
        + ", ".join(f"{k} {v:.3g}" for k, v in c.to_dict().items())
    )
    if args.out:
        write_text_atomic(
            args.out,
            json.dumps(
                {
                    "constants": c.to_dict(),
                    "fit": args.fit,
                    "check": args.check,
                    "rows": rows,
                    "env": run_record(1, on_gpu=False),  # computed: the code's commit, the date
                },
                indent=1,
            ),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
