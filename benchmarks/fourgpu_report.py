"""Tables and a plot of the four-GPU whole-model runs (issue 39) from their e2e.py JSON.

    python benchmarks/fourgpu_report.py docs/results/fourgpu --card H200 --md /tmp/fourgpu_tables.md \\
        --plot docs/results/fourgpu/e2e_4xH200.png

Per shape and link: every variant's ms per step (prefill, train) and its ratio to the best replicated
variant of the same link (the floor: every GPU holds every expert; in training it still all-reduces
the dense gradients, so each link has its own floor), the rows each token sends per MoE layer
(dispatch rows / tokens / layers), and the issue's target ratios.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import emit  # noqa: E402  (benchmarks/_report.py)

PHASES = ("prefill", "train")
FLOORS = ("replicated", "replicated/compile")
BEST_DEDUP = ("dedup", "dedup/compile", "dedup+placement")


def load_runs(root: Path, card: str) -> dict[tuple[str, str], dict[str, Any]]:
    """{(shape, link): variants} merged from e2e_{shape}_{link}[_floor]_4x{card}.json."""
    runs: dict[tuple[str, str], dict[str, Any]] = {}
    for shape in ("olmoe", "qwen3"):
        for link in ("nvlink", "slow"):
            variants: dict[str, Any] = {}
            for name in (f"e2e_{shape}_{link}_4x{card}.json", f"e2e_{shape}_{link}_floor_4x{card}.json"):
                path = root / name
                if path.exists():
                    doc = json.loads(path.read_text())
                    variants.update(doc["variants"])
                    variants["_layers"] = doc.get("model_cost", {}).get("moe_layers") or _moe_layers(doc)
                    variants["_tokens"] = doc["config"]["tokens_per_gpu"] if "tokens_per_gpu" in doc["config"] else None
                    variants["_placement"] = doc.get("placement", variants.get("_placement"))
            if variants:
                runs[(shape, link)] = variants
    return runs


def _moe_layers(doc: dict[str, Any]) -> int:
    return {"olmoe": 16, "qwen3": 8}.get(doc["config"].get("model"), 1)


def ms(variants: dict[str, Any], name: str, phase: str) -> float | None:
    r = variants.get(name)
    return r["phases"][phase]["ms_median"] if r and phase in r.get("phases", {}) else None


def best(variants: dict[str, Any], names: tuple[str, ...], phase: str) -> tuple[str, float] | None:
    found = [(n, t) for n in names if (t := ms(variants, n, phase)) is not None]
    return min(found, key=lambda x: x[1]) if found else None


def rows_per_token(variants: dict[str, Any], name: str) -> float | None:
    comm = variants.get(name, {}).get("phases", {}).get("prefill", {}).get("comm", {})
    tokens, layers = variants.get("_tokens"), variants.get("_layers")
    if not comm or not tokens or not layers:
        return None
    return comm["dispatch_rows"] / tokens / layers


def variant_table(variants: dict[str, Any]) -> list[str]:
    lines = ["| variant | prefill ms | x floor | train ms | x floor | rows/token/layer |", "|---|---|---|---|---|---|"]
    floors = {ph: best(variants, FLOORS, ph) for ph in PHASES}
    for name in (n for n in variants if not n.startswith("_")):
        cells = []
        for ph in PHASES:
            t = ms(variants, name, ph)
            f = floors[ph][1] if floors[ph] else None
            cells += [f"{t:.1f}" if t else "-", f"{t / f:.2f}" if t and f else "-"]
        rows = rows_per_token(variants, name)
        lines.append(f"| {name} | {' | '.join(cells)} | {f'{rows:.2f}' if rows is not None else '-'} |")
    return lines


def target_rows(variants: dict[str, Any], link: str) -> list[tuple[str, float | None, str]]:
    """(metric, value, target) of the issue's targets table for one shape and link."""
    out = []
    for ph, nv, slow in (("prefill", "<= 1.08", "<= 1.45"), ("train", "<= 1.04", "<= 1.15")):
        f, d = best(variants, FLOORS, ph), best(variants, BEST_DEDUP, ph)
        out.append(
            (
                f"best dedup / floor, {ph} ({d[0] if d else '-'})",
                d[1] / f[1] if d and f else None,
                nv if link == "nvlink" else slow,
            )
        )
    for ph in PHASES:
        p, d, s = (ms(variants, n, ph) for n in ("dedup+placement", "dedup", "standard"))
        if link == "slow":
            out.append((f"dedup+placement / dedup, {ph}", p / d if p and d else None, "<= 0.85"))
            out.append((f"dedup / standard, {ph}", d / s if d and s else None, "<= 0.45"))
        t, to = ms(variants, "torchtitan", ph), ms(variants, "torchtitan+occult", ph)
        bd = best(variants, BEST_DEDUP, ph)
        if t and bd:
            out.append((f"torchtitan / best dedup, {ph}", t / bd[1], "(issue 36: >= 3x / 1.8x NVLink)"))
        if t and to:
            out.append((f"torchtitan / torchtitan+occult, {ph}", t / to, "(issue 36: >= 1.2x NVLink, 2x slow)"))
    return out


def render(runs: dict[tuple[str, str], dict[str, Any]]) -> str:
    parts = []
    for (shape, link), variants in runs.items():
        pl = variants.get("_placement") or {}
        parts += [f"### {shape}, {link}", ""]
        if pl:
            parts += [
                f"E[C_T] of the model's own routing (calibration batch, in sample): contiguous "
                f"{pl['mean_ct_contiguous']:.3f}, placed {pl['mean_ct_placed']:.3f}.",
                "",
            ]
        parts += variant_table(variants) + ["", "| target | value | target |", "|---|---|---|"]
        for metric, value, target in target_rows(variants, link):
            parts.append(f"| {metric} | {f'{value:.3f}' if value is not None else '-'} | {target} |")
        parts.append("")
    return "\n".join(parts)


def plot(runs: dict[tuple[str, str], dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(PHASES), len(runs), figsize=(4.2 * len(runs), 7), squeeze=False)
    for j, ((shape, link), variants) in enumerate(runs.items()):
        for i, ph in enumerate(PHASES):
            names = [n for n in variants if not n.startswith("_") and ms(variants, n, ph)]
            f = best(variants, FLOORS, ph)
            ax = axes[i][j]
            ax.barh(names, [ms(variants, n, ph) / f[1] for n in names], color="tab:blue")
            ax.axvline(1.0, color="k", lw=0.8)
            ax.set_title(f"{shape} {link}: {ph}", fontsize=9)
            ax.tick_params(labelsize=7)
            ax.set_xlabel("ms / floor", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root", help="folder of the e2e_*_4x<card>.json files")
    p.add_argument("--card", default="H200", help="card in the file names")
    p.add_argument("--md", default=None, help="write the tables here (default: stdout)")
    p.add_argument("--plot", default=None, help="PNG of every variant's time over its link's floor")
    args = p.parse_args(argv)
    runs = load_runs(Path(args.root), args.card)
    if not runs:
        print(f"fourgpu_report.py: no e2e_*_4x{args.card}.json in {args.root}", file=sys.stderr)
        return 2
    text = render(runs)
    emit(text, args.md, lambda path: plot(runs, path), args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
