"""Issue 38's training measurements as a Markdown table and a plot (for docs/training.md):

    python scripts/train_report.py OUT [--md OUT/train_report.md] [--plot OUT/train_report.png]

OUT holds scripts/two_gpu_training.sh's train_{link}_*.json (one per link; renamed with the card, e.g.
train_nvlink_2xH100.json, is fine). The table: per link and variant, tokens/s per GPU and for the whole
job, MFU, steady step time, the largest relative loss difference from the reference run, then the
issue's ratios against their targets. The plot: per-step training losses (left) and tokens/s per GPU (right).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

TARGETS = {  # ratio key -> (what it is, {link: target}) as the issue's targets table names them
    "dedup_over_floor_per_gpu": ("EP dedup tokens/s per GPU / data-parallel floor", {"nvlink": 0.95, "slow": 0.85}),
    "dedup_over_standard": ("EP dedup / EP standard tokens/s", {"slow": 1.4}),
    "two_gpu_dedup_over_one_gpu_job": ("2-GPU (EP dedup) / 1-GPU tokens/s, whole job", {"nvlink": 1.85}),
    "dedup_fsdp_over_standard_fsdp": ("EP dedup / EP standard tokens/s, both FSDP2", {}),
    "two_gpu_floor_over_one_gpu_job": ("2-GPU floor / 1-GPU tokens/s, whole job", {}),
}


def load(out: Path) -> list[dict[str, Any]]:
    docs = [json.loads(p.read_text()) for p in sorted(out.glob("train_*.json"))]
    return [d for d in docs if "variants" in d]


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def variant_rows(doc: dict[str, Any]) -> list[str]:
    rows = []
    diffs = doc.get("loss_max_rel_diff", {})
    for v, r in doc["variants"].items():
        if v == "1gpu" and doc["link"] != "nvlink":  # the loss reference of every link, shown once
            continue
        step_ms = 1e3 * r["batch_size"] * r["seq_len"] / r["tokens_per_s"]
        rows.append(
            f"| {doc['link']} | {v} | {r['gpus']} | {r['tokens_per_s_per_gpu']:,.0f} | {r['tokens_per_s']:,.0f} | "
            f"{fmt(r.get('mfu') and 100 * r['mfu'], '.1f')} | {step_ms:.0f} | "
            f"{'ref' if v == doc.get('loss_max_rel_diff_vs') else fmt(diffs.get(v), '.1e')} |"
        )
    return rows


def ratio_rows(doc: dict[str, Any]) -> list[str]:
    rows = []
    for key, value in doc["ratios"].items():
        what, targets = TARGETS.get(key, (key, {}))
        target = targets.get(doc["link"])
        verdict = "" if value is None or target is None else ("met" if value >= target else "missed")
        rows.append(f"| {doc['link']} | {what} | {fmt(value, '.3f')} | {fmt(target, '')} | {verdict} |")
    return rows


def markdown(docs: list[dict[str, Any]]) -> str:
    peak = next((d["peak"] for d in docs if d.get("peak")), None)
    head = [
        f"Matmul peak measured in the same job: {peak['tflops']:.3g} TFLOP/s ({peak['dtype']} {peak['matmul_n']}^3, "
        f"{peak['device']})."
        if peak
        else "No matmul peak measured.",
        "",
        "| link | variant | GPUs | tokens/s per GPU | tokens/s (job) | MFU % | step ms | loss max rel. diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    body = [row for d in docs for row in variant_rows(d)]
    ratios = ["", "| link | ratio | value | target | |", "|---|---|---|---|---|"] + [
        row for d in docs for row in ratio_rows(d)
    ]
    skipped = [f"{d['link']}: {', '.join(d['skipped'])}" for d in docs if d.get("skipped")]
    tail = ["", "Skipped (over the time budget): " + "; ".join(skipped)] if skipped else []
    return "\n".join(head + body + ratios + tail) + "\n"


def plot(docs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_l, ax_t) = plt.subplots(1, 2, figsize=(11, 4))
    labels, rates = [], []
    for d in docs:
        for v, r in d["variants"].items():
            if v == "1gpu" and d["link"] != "nvlink":
                continue
            ax_l.plot(range(1, len(r["losses"]) + 1), r["losses"], lw=1, label=f"{d['link']} {v}")
            labels.append(f"{d['link']}\n{v}")
            rates.append(r["tokens_per_s_per_gpu"])
    ax_l.set_xlabel("step")
    ax_l.set_ylabel("training loss")
    ax_l.legend(fontsize=7)
    ax_t.bar(range(len(rates)), rates)
    ax_t.set_xticks(range(len(rates)), labels, fontsize=6, rotation=45)
    ax_t.set_ylabel("tokens/s per GPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="folder with train_{link}_*.json")
    p.add_argument("--md", type=Path, default=None, help="Markdown to write (default OUT/train_report.md)")
    p.add_argument("--plot", type=Path, default=None, help="PNG to write (default OUT/train_report.png)")
    a = p.parse_args()
    docs = load(a.out)
    if not docs:
        raise SystemExit(f"train_report.py: error: no train_*.json with variants in {a.out}")
    text = markdown(docs)
    (a.md or a.out / "train_report.md").write_text(text)
    print(text, end="")
    plot(docs, a.plot or a.out / "train_report.png")
    print(f"wrote {a.md or a.out / 'train_report.md'} and {a.plot or a.out / 'train_report.png'}")


if __name__ == "__main__":
    main()
