"""Merge `benchmarks/serve.py` JSON of one model and link from several jobs into one file (issue 37).

    python benchmarks/serve_merge.py OUT1/serve_olmoe_nvlink_2gpu.json OUT2/serve_olmoe_nvlink_2gpu.json \
        --out docs/results/twogpu/serve_olmoe_nvlink_2xH200.json

A serving sweep rarely fits one device call (each (variant, batch) costs ~40-70 s of checking,
compiling and timing on 2 x H200), so its points come from several jobs. Every input must be the same
model, GPU count, GPU name and link (`NCCL_P2P_DISABLE`); otherwise the merge refuses (exit 2). Per
(variant, batch) the last file that has the point wins; each merged point records its `source` file,
and `sources` lists which points came from where, so ratios that cross jobs stay visible
(`--variants` keeps only those named). The other
fields (config, env, peaks) are the last file's (the newest job's). Written atomically (temporary name, then rename).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from _timing import write_json  # benchmarks/_timing.py (atomic: temporary name, then rename)
from serve_plot import read_result  # benchmarks/serve_plot.py

SAME = (("config", "model"), ("env", "world_size"), ("env", "gpu"), ("env", "NCCL_P2P_DISABLE"))


def identity(doc: dict[str, Any]) -> tuple:
    """What every merged file must share: model, GPU count, GPU name, link."""
    return tuple(doc.get(section, {}).get(key) for section, key in SAME)


def merge(docs: dict[str, dict[str, Any]], keep: list[str] | None = None) -> dict[str, Any]:
    """One serve.py result from `docs` (name -> parsed JSON, in order): later points win; only the
    variants in `keep` where given."""
    names = list(docs)
    first = docs[names[0]]
    for name in names[1:]:
        if identity(docs[name]) != identity(first):
            raise ValueError(
                f"{name} is {identity(docs[name])}, {names[0]} is {identity(first)} "
                f"({', '.join('.'.join(k) for k in SAME)}): merge only one model, GPU and link"
            )
    variants: dict[str, dict[str, Any]] = {}
    sources: dict[str, list[str]] = {}
    for name in names:
        for variant, runs in docs[name]["variants"].items():
            for batch, point in runs.items():
                if keep is not None and variant not in keep:
                    continue
                if not isinstance(point, dict) or point.get("ms_p50") is None:
                    continue  # skipped or failed there: another file may have it
                variants.setdefault(variant, {})[batch] = dict(point, source=name)
    for variant, runs in variants.items():
        for batch, point in sorted(runs.items(), key=lambda kv: int(kv[0])):
            sources.setdefault(point["source"], []).append(f"{variant} B={batch}")
    table = [
        row
        for name in names
        for row in docs[name].get("table", [])
        if variants.get(row.get("variant"), {}).get(str(row.get("batch")), {}).get("source") == name
    ]
    return dict(docs[names[-1]], variants=variants, table=table, sources=sources)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", nargs="+", help="serve.py --out files of one model and link, oldest first")
    p.add_argument("--out", required=True, help="the merged JSON")
    p.add_argument("--variants", default=None, help="comma list: keep only these variants (default: all)")
    args = p.parse_args(argv)
    if len(set(args.json)) != len(args.json):
        print("serve_merge.py: a file is given twice", file=sys.stderr)
        return 2
    try:
        docs = {f: read_result(f) for f in args.json}  # the path as given: two jobs' files may share a name
        merged = merge(docs, [v.strip() for v in args.variants.split(",")] if args.variants else None)
    except ValueError as exc:
        print(f"serve_merge.py: {exc}", file=sys.stderr)
        return 2
    write_json(args.out, merged)
    counts = {name: len(points) for name, points in merged["sources"].items()}
    print(f"serve_merge.py: wrote {args.out}: points per source {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
