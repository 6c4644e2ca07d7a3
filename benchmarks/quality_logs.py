"""The quality study's rows from its logs, for seeds whose JSON did not come back (a GPU machine released).

`quality_ranks.py` logs every evaluated row ("evaluate: N=2 score: val loss 3.4336, E[C_T] 1.977") and
every fine-tune ("finetune: pruned N=2 (score) + fine-tuning: val loss 3.3989, E[C_T] 1.980 (32 s)").
This script reads one log per seed and prints the study's table: relative perplexity against each
row's reference (no fine-tuning: the base model's best validation loss; fine-tuned: the standard
fine-tune of the same length), mean ± std [min, max] over the seeds, and E[C_T]. Losses are logged to
4 decimals, so a relative perplexity here is good to about 0.01%.

  python benchmarks/quality_logs.py docs/results/quality_gpu_1xH200/three_at_once_seed*.log
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

from quality_ranks import spread  # benchmarks/: mean, std, min, max of a row over the seeds

BASE = re.compile(r"train: \d+ steps in [\d.]+ s, best val loss ([\d.]+)")
EVAL = re.compile(r"evaluate: N=(\d+) (\w+): val loss ([\d.]+), E\[C_T\] ([\d.]+)")
TUNE = re.compile(r"finetune: (.+?): val loss ([\d.]+), E\[C_T\] ([\d.]+)")


def parse_log(text: str) -> dict[str, dict]:
    """{row name: {"loss", "ct", "reference"}} of one seed's log (a row logged twice keeps its first value)."""
    rows: dict[str, dict] = {}
    reference = None
    for line in text.splitlines():
        if m := BASE.search(line):
            rows.setdefault("standard routing", {"loss": float(m[1]), "ct": None, "reference": None})
        elif m := EVAL.search(line):
            rows.setdefault(
                f"pruned N={m[1]} ({m[2]})", {"loss": float(m[3]), "ct": float(m[4]), "reference": "standard routing"}
            )
        elif m := TUNE.search(line):
            name = m[1]
            if name.startswith("standard fine-tuning"):
                reference = name  # a reference row: itself; the recipe rows after it compare against it
            ref = name if name == reference else reference if "[" in name else "standard fine-tuning"
            rows.setdefault(name, {"loss": float(m[2]), "ct": float(m[3]), "reference": ref})
    return rows


def table(seeds: list[dict[str, dict]]) -> str:
    """Markdown: one line per row every seed has, relative perplexity and E[C_T] over the seeds."""
    names = [n for n in seeds[0] if all(n in s for s in seeds)]
    out = ["| row | Δ ppl vs reference: mean ± std [min, max] | E[C_T] mean |", "|---|---|---|"]
    for name in names:
        rels, cts = [], []
        for s in seeds:
            r = s[name]
            ref = s.get(r["reference"]) if r["reference"] else None
            rels.append(math.exp(r["loss"] - ref["loss"]) - 1 if ref else 0.0)
            if r["ct"] is not None:
                cts.append(r["ct"])
        rel = spread(rels)
        cell = (
            f"{rel['mean'] * 100:+.2f}% ± {rel['std'] * 100:.2f} [{rel['min'] * 100:+.2f}%, {rel['max'] * 100:+.2f}%]"
        )
        out.append(f"| {name} | {cell} | {spread(cts)['mean']:.3f} |" if cts else f"| {name} | {cell} | — |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("logs", nargs="+", type=Path, help="one quality_ranks.py log per seed")
    args = p.parse_args(argv)
    seeds = [parse_log(path.read_text()) for path in args.logs]
    if not all(seeds):
        empty = [str(path) for path, s in zip(args.logs, seeds) if not s]
        raise SystemExit(f"no study rows in {', '.join(empty)}: give the logs quality_ranks.py wrote")
    print(f"{len(seeds)} seeds: {', '.join(str(path) for path in args.logs)}\n")
    print(table(seeds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
