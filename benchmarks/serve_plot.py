"""Latency against throughput from `benchmarks/serve.py` JSON (issue 37, item 3).

    python benchmarks/serve_plot.py docs/results/twogpu/serve_olmoe_nvlink_2xH200.json [more.json ...] \\
        --plot docs/results/twogpu/serve_2xH200.png --md tables.md

One panel per file: for every variant, its decode step p50 (ms per token, the y axis) against decode
tokens/s per GPU (x), one point per batch size, labelled with B; the step over the floor's
(`replicated+compile+graph`, else `replicated+graph`, else `replicated`) at the same B goes into the
Markdown table beside transformers' compiled generate over occult's step.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import emit  # noqa: E402  (benchmarks/_report.py)

FLOORS = ("replicated+compile+graph", "replicated+graph", "replicated")
NATIVE = "native-generate+compile"


def points(variant: dict[str, Any]) -> list[tuple[int, float, float]]:
    """(B, step ms p50, decode tokens/s per GPU) of every batch size that was timed."""
    out = []
    for b, r in sorted(variant.items(), key=lambda kv: int(kv[0])):
        if isinstance(r, dict) and r.get("ms_p50") and r.get("decode_tokens_per_s_per_gpu"):
            out.append((int(b), float(r["ms_p50"]), float(r["decode_tokens_per_s_per_gpu"])))
    return out


def floor_of(variants: dict[str, Any]) -> str | None:
    return next((f for f in FLOORS if f in variants and points(variants[f])), None)


def table(name: str, variants: dict[str, Any]) -> list[str]:
    floor = floor_of(variants)
    base = {b: ms for b, ms, _ in points(variants[floor])} if floor else {}
    native = {b: ms for b, ms, _ in points(variants[NATIVE])} if NATIVE in variants else {}
    lines = [
        f"### {name}",
        "",
        f"| variant | B | step ms p50 | step ms p99 | decode tok/s/GPU | x floor ({floor or '-'}) | {NATIVE} / this |",
        "|---|---|---|---|---|---|---|",
    ]
    for v, runs in variants.items():
        for b, ms, tps in points(runs):
            x = f"{ms / base[b]:.2f}" if b in base else "-"
            n = f"{native[b] / ms:.2f}" if b in native else "-"
            p99 = runs[str(b)].get("ms_p99")  # None where only a mean step is known (results before per-step marks)
            lines.append(f"| {v} | {b} | {ms:.2f} | {f'{p99:.2f}' if p99 else '-'} | {tps:,.0f} | {x} | {n} |")
    return lines + [""]


def plot(docs: dict[str, dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(docs), figsize=(5.5 * len(docs), 4.2), squeeze=False)
    names = list(dict.fromkeys(v for variants in docs.values() for v in variants))
    color = {v: f"C{i % 10}" for i, v in enumerate(names)}  # one colour per variant in every panel
    for ax, (name, variants) in zip(axes[0], docs.items()):
        for v, runs in variants.items():
            pts = points(runs)
            if not pts:
                continue
            ax.plot([p[2] for p in pts], [p[1] for p in pts], marker="o", lw=1, label=v, color=color[v])
            for b, ms, tps in pts:
                ax.annotate(str(b), (tps, ms), fontsize=6, xytext=(2, 2), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("decode tokens/s per GPU")
        ax.set_ylabel("ms per decode step (p50)")
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def read_result(path: str) -> dict[str, Any]:
    """A `serve.py --out` file parsed; ValueError naming the file when it is not one."""
    try:
        doc = json.loads(Path(path).read_text())
        if not isinstance(doc.get("variants"), dict):
            raise KeyError("variants")
    except (OSError, ValueError, KeyError, AttributeError) as exc:
        raise ValueError(f"{path}: not a serve.py result ({exc})") from None
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", nargs="+", help="serve.py --out files")
    p.add_argument("--plot", default=None, help="PNG: latency against throughput, one panel per file")
    p.add_argument("--md", default=None, help="write the tables here (default: stdout)")
    args = p.parse_args(argv)
    docs = {}
    for f in args.json:
        try:
            docs[Path(f).stem] = read_result(f)["variants"]
        except ValueError as exc:
            print(f"serve_plot.py: {exc}", file=sys.stderr)
            return 2
    text = "\n".join(line for name, variants in docs.items() for line in table(name, variants))
    emit(text, args.md, lambda path: plot(docs, path), args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
