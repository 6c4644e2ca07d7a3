#!/usr/bin/env python3
"""Markdown table and bar chart from `benchmarks/peers/run.py` JSON results.

    python3 benchmarks/peers/report.py docs/results/peers_4x2xH200.json \\
        --repeat docs/results/peers_4xH200_repeat.json --plot docs/results/peers.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SCHEME = {  # rows each token sends out in forward (and gets back)
    "occult-dedup": "one per device holding any of its experts",
    "occult-standard": "one per chosen expert",
    "megatron": "one per chosen expert",
    "hf-olmoe": "one per chosen expert",
    "hf-qwen3": "one per chosen expert",
    "deepspeed": "one per chosen expert, in [E, capacity] buffers",
    "torchtitan": "one per chosen expert",
}
LABEL = {
    "occult-dedup": "occult dedup (ours)",
    "occult-standard": "occult standard (ours)",
    "megatron": "Megatron-Core MoELayer",
    "hf-olmoe": "transformers EP, OLMoE block",
    "hf-qwen3": "transformers EP, Qwen3-MoE block",
    "deepspeed": "DeepSpeed-MoE",
    "torchtitan": "TorchTitan MoE (EP all-to-all)",
}


def load(path: str) -> dict:
    return json.loads(Path(path).read_text())


def _key(r: dict) -> tuple:
    return (r["world"], r["shape"], r["peer"])


def table(result: dict, repeat: dict | None = None) -> str:
    rep = {_key(r): r for r in (repeat or {}).get("runs", [])}
    lines = []
    for world in sorted({r["world"] for r in result["runs"]}, reverse=True):
        for shape in sorted({r["shape"] for r in result["runs"] if r["world"] == world}):
            rows = [r for r in result["runs"] if r["world"] == world and r["shape"] == shape]
            ours = next((r for r in rows if r["peer"] == "occult-dedup" and "fwd_bwd_ms" in r), None)
            has_rep = any(_key(r) in rep for r in rows)
            head = ["implementation", "rows out per token", "fwd ms", "fwd+bwd ms"]
            if has_rep:
                head.append("fwd / fwd+bwd ms, repeat run")
            head += ["dedup speedup fwd / fwd+bwd", "rel err vs fp32", "dx vs occult"]
            lines.append(
                f"**{world} x {result['config'].get('device', '?')}, {shape} shape, "
                f"{result['config'].get('tokens', '?')} tokens/GPU**\n"
            )
            lines.append("| " + " | ".join(head) + " |")
            lines.append("|" + "---|" * len(head))
            for r in rows:
                name = LABEL.get(r["peer"], r["peer"])
                if "fwd_bwd_ms" not in r:
                    lines.append(
                        f"| {name} | | not run: {r.get('status')}: {r.get('error', '')[:120]} |"
                        + " |" * (len(head) - 3)
                    )
                    continue
                info = r.get("info", {})
                rows_out = f"{info['rows_per_token']:.2f}" if "rows_per_token" in info else "8 (top-k)"
                cells = [name, rows_out, f"{r['forward_ms']:.2f}", f"{r['fwd_bwd_ms']:.2f}"]
                if has_rep:
                    q = rep.get(_key(r))
                    cells.append(f"{q['forward_ms']:.2f} / {q['fwd_bwd_ms']:.2f}" if q and "fwd_bwd_ms" in q else "-")
                if ours:
                    cells.append(
                        f"{r['forward_ms'] / ours['forward_ms']:.2f}x / {r['fwd_bwd_ms'] / ours['fwd_bwd_ms']:.2f}x"
                    )
                else:
                    cells.append("-")
                cells.append(f"{r['rel_error']:.1e}" + (" (renormalised gate)" if r.get("renormalized") else ""))
                cells.append(f"{r['dx_rel_diff']:.1e}" if "dx_rel_diff" in r else "-")
                lines.append("| " + " | ".join(cells) + " |")
            lines.append("")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({r["world"] for r in result["runs"]}, reverse=True)
    fig, axes = plt.subplots(1, len(worlds), figsize=(6.2 * len(worlds), 4.6), squeeze=False, sharey=True)
    for ax, world in zip(axes[0], worlds):
        rows = [r for r in result["runs"] if r["world"] == world and "fwd_bwd_ms" in r]
        names = [LABEL.get(r["peer"], r["peer"]).replace(", ", "\n") for r in rows]
        x = range(len(rows))
        colors = ["#1f77b4" if r["peer"].startswith("occult") else "#999999" for r in rows]
        ax.bar([i - 0.2 for i in x], [r["forward_ms"] for r in rows], 0.4, color=colors, alpha=0.55, label="forward")
        ax.bar([i + 0.2 for i in x], [r["fwd_bwd_ms"] for r in rows], 0.4, color=colors, label="forward+backward")
        for i, r in enumerate(rows):
            ax.text(i + 0.2, r["fwd_bwd_ms"] + 0.2, f"{r['fwd_bwd_ms']:.1f}", ha="center", fontsize=8)
            ax.text(i - 0.2, r["forward_ms"] + 0.2, f"{r['forward_ms']:.1f}", ha="center", fontsize=8)
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
        ax.set_title(
            f"{world} x {result['config'].get('device', 'GPU')}, OLMoE shape, "
            f"{result['config'].get('tokens', '?')} tokens/GPU",
            fontsize=9,
        )
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("ms per MoE layer (lower is better)")
    axes[0][0].legend(fontsize=8, title="pale: forward, dark: fwd+bwd", title_fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", help="JSON written by benchmarks/peers/run.py --out")
    ap.add_argument("--repeat", default=None, help="a second run of the same configuration, shown beside the first")
    ap.add_argument("--plot", default=None, help="write a bar chart (PNG) here")
    args = ap.parse_args(argv)
    result = load(args.result)
    print(table(result, load(args.repeat) if args.repeat else None))
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
