"""Fit the MoE-layer cost model (occult.placement.cost) to measured one-node runs, validate it, and
predict 8-256 GPUs on 1-32 nodes (8 GPUs per node) for the OLMoE, Qwen3-MoE and DeepSeek-V3 shapes.

    python benchmarks/scale.py --out docs/results/scale.json --plot docs/results/scale.png --markdown scale_tables.md

Measured: docs/results/bench_{1,2,4}xH200.json (`occult bench`, one H200 node). Predicted: all the
rest. The inter-node bandwidth is an assumption (--internode, GB/s per GPU; default 25 and 50).
Planted/placed: a planted trace (groups of k experts, 20% of picks outside the group), placed
hierarchically (occult place --nodes M --devices D) on half the tokens, E[C_T]/E[N_T] on the other half.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from occult.placement.cost import SHAPES, fit, layer_time, measured_from_bench, validate
from occult.placement.solvers import place
from occult.placement.stats import analytic_mean_ct, mean_ct
from occult.placement.synthetic import planted_trace
from occult.placement.trace import Trace
from occult.tools.run_record import run_record

REPO = Path(__file__).resolve().parents[1]
GPUS_PER_NODE = 8
SCALE = [(8, 1), (16, 2), (32, 4), (64, 8), (128, 16), (256, 32)]
PRED_SHAPES = ("olmoe", "qwen3", "deepseek_v3")
VARIANTS = ("standard", "dedup", "two_level")


def measured_points() -> list:
    pts = []
    for w in (1, 2, 4):
        pts += measured_from_bench(json.loads((REPO / f"docs/results/bench_{w}xH200.json").read_text()))
    return pts


def planted_case(shape, D: int, M: int, tokens: int, seed: int) -> dict:
    """E[C_T], E[N_T] of a planted trace placed hierarchically (solved and scored on disjoint halves)."""
    pt = planted_trace(
        2 * tokens, shape.experts, shape.top_k, num_groups=shape.experts // shape.top_k, noise=0.2, seed=seed
    )
    ids = pt.trace.layer(0)
    fit_ids, test_ids = ids[:tokens], ids[tokens:]
    t0 = time.perf_counter()
    res = place(Trace([fit_ids], shape.experts, shape.top_k), D, "hypergraph", num_nodes=M, seed=seed)
    p = res.placement
    flat = place(Trace([fit_ids], shape.experts, shape.top_k), D, "hypergraph", seed=seed).placement
    contig_dev = np.arange(shape.experts) // (shape.experts // D)
    G = D // M
    return {
        "mean_ct": mean_ct(test_ids, p.expert_device(0), D),
        "mean_nt": mean_ct(test_ids, p.expert_node(0), M),
        "flat_mean_ct": mean_ct(test_ids, flat.expert_device(0), D),
        "flat_mean_nt": mean_ct(test_ids, flat.expert_device(0) // G, M),
        "contiguous_mean_ct": mean_ct(test_ids, contig_dev, D),
        "contiguous_mean_nt": mean_ct(test_ids, contig_dev // G, M),
        "solve_s": time.perf_counter() - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--internode", default="25,50", help="inter-node GB/s per GPU, comma list (assumption)")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per GPU (the measured runs used 8192)")
    ap.add_argument(
        "--trace-tokens", type=int, default=20000, help="planted tokens to solve on (and as many to score on)"
    )
    ap.add_argument("--out", help="JSON with constants, validation and predictions")
    ap.add_argument("--plot", help="PNG: predicted forward ms against GPUs")
    ap.add_argument("--markdown", help="write the tables (markdown) here")
    args = ap.parse_args()
    bws = [float(x) for x in args.internode.split(",")]
    pts = measured_points()
    consts = fit(pts, bws[0])
    val = validate(pts, consts)
    # Leave one world size out: fit on the others, predict it.
    lowo = []
    for w in (1, 2, 4):
        c_w = fit([m for m in pts if m.world != w], bws[0])
        lowo += validate([m for m in pts if m.world == w], c_w)
    preds = []
    for name in PRED_SHAPES:
        shape = SHAPES[name]
        for D, M in SCALE:
            if shape.experts % D:
                continue
            cases = {
                "uniform": {
                    "mean_ct": analytic_mean_ct(shape.experts, shape.top_k, D),
                    "mean_nt": analytic_mean_ct(shape.experts, shape.top_k, M),
                }
            }
            cases["planted+placed"] = planted_case(shape, D, M, args.trace_tokens, seed=D)
            for routing, st in cases.items():
                row = {"shape": name, "gpus": D, "nodes": M, "routing": routing, **st}
                for bw in bws:
                    c = consts.__class__(**{**consts.to_dict(), "internode_GBps": bw})
                    for v in VARIANTS:
                        t = layer_time(shape, args.tokens, D, M, v, c, st["mean_ct"], st["mean_nt"])
                        row[f"{v}@{bw:g}"] = t
                preds.append(row)
                print(name, D, M, routing, f"C={st['mean_ct']:.2f} N={st['mean_nt']:.2f}", flush=True)
    doc = {
        "constants": consts.to_dict(),
        "validation": val,
        "leave_one_world_out": lowo,
        "predictions": preds,
        "tokens_per_gpu": args.tokens,
        "gpus_per_node": GPUS_PER_NODE,
        "internode_GBps": bws,
        "env": run_record(1, on_gpu=False),  # computed from the cost model and bench files: the code's commit, date
    }
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1, default=float) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(tables(doc))
    if args.plot:
        plot(doc, args.plot)
    print(tables(doc))


def tables(doc: dict) -> str:
    c = doc["constants"]
    out = ["Fitted constants: " + ", ".join(f"{k} {v:.4g}" for k, v in c.items() if k != "internode_GBps") + "\n"]
    out.append(
        "| measured point (H200) | fwd ms | model | err | fwd+bwd ms | model | err | leave-one-world-out err fwd / "
        "fwd+bwd |"
    )
    out.append("|---|---|---|---|---|---|---|---|")
    lo = {r["point"]: r for r in doc["leave_one_world_out"]}
    for r in doc["validation"]:
        q = lo[r["point"]]
        out.append(
            f"| {r['point']} (E[C_T] {r['mean_ct']:.2f}) | {r['forward_ms']:.2f} | {r['forward_pred_ms']:.2f} | "
            f"{100 * r['forward_err']:+.1f}% | {r['fwd_bwd_ms']:.2f} | {r['fwd_bwd_pred_ms']:.2f} | "
            f"{100 * r['fwd_bwd_err']:+.1f}% | {100 * q['forward_err']:+.1f}% / {100 * q['fwd_bwd_err']:+.1f}% |"
        )
    b0, b1 = doc["internode_GBps"][0], doc["internode_GBps"][-1]
    out.append("")
    out.append(
        "| shape | GPUs | nodes | routing | E[C_T] | E[N_T] | fwd ms standard | dedup | two-level* | "
        "fwd+bwd ms standard | dedup | two-level* |"
    )
    out.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in doc["predictions"]:

        def cell(v: str, key: str) -> str:
            lo_, hi_ = r[f"{v}@{b1:g}"][key], r[f"{v}@{b0:g}"][key]
            return f"{lo_:.2f}" if abs(hi_ - lo_) < 0.005 else f"{lo_:.2f}-{hi_:.2f}"

        out.append(
            f"| {r['shape']} | {r['gpus']} | {r['nodes']} | {r['routing']} | {r['mean_ct']:.2f} | {r['mean_nt']:.2f} | "
            + " | ".join(cell(v, "forward_ms") for v in VARIANTS)
            + " | "
            + " | ".join(cell(v, "fwd_bwd_ms") for v in VARIANTS)
            + " |"
        )
    return "\n".join(out) + "\n"


def plot(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b0, b1 = doc["internode_GBps"][0], doc["internode_GBps"][-1]
    fig, axes = plt.subplots(1, len(PRED_SHAPES), figsize=(5 * len(PRED_SHAPES), 4), sharey=False)
    colors = {"standard": "tab:red", "dedup": "tab:blue", "two_level": "tab:green"}
    for ax, name in zip(axes, PRED_SHAPES):
        for routing, style in (("uniform", "-"), ("planted+placed", "--")):
            rows = [r for r in doc["predictions"] if r["shape"] == name and r["routing"] == routing]
            x = [r["gpus"] for r in rows]
            for v in VARIANTS:
                hi = [r[f"{v}@{b0:g}"]["forward_ms"] for r in rows]
                lo = [r[f"{v}@{b1:g}"]["forward_ms"] for r in rows]
                label = f"{v.replace('_', '-')}{'*' if v == 'two_level' else ''}, {routing}"
                ax.plot(x, lo, style, color=colors[v], label=label)
                ax.fill_between(x, lo, hi, color=colors[v], alpha=0.12)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs (8 per node)")
        ax.set_title(f"{name}: predicted forward, {min(b0, b1):g}-{max(b0, b1):g} GB/s inter-node")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("ms per MoE layer (8192 tokens/GPU)")
    axes[0].legend(fontsize=7)
    fig.text(
        0.5,
        0.005,
        "PREDICTED by the cost model fitted on 1-4 x H200 (one node); "
        "* two-level dispatch is a design, not implemented",
        ha="center",
        fontsize=8,
    )
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
