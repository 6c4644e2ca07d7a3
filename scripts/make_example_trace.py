"""Regenerate occult/data/example_trace.safetensors, the small planted trace bundled with occult.

4 MoE layers x 16384 tokens, 64 experts, top-8 (OLMoE's routing shape), int16 ids (~1 MB).
Per layer the experts hide in 4 groups of 16; a token picks inside one group except that each
pick leaves the group with probability 0.15, and expert popularity is Zipf-skewed (skew 0.5).
The planted grouping is stored in the metadata (`planted_groups`, JSON [layers][experts]), so
`occult place --trace <it> --devices 4` can be checked against the known optimum.

    python scripts/make_example_trace.py [--out PATH]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from occult.placement.synthetic import planted_trace
from occult.placement.trace import Trace, example_trace_path, write_trace

SEED = 20250513  # the paper's arXiv id, 2505.13345
SHAPE = dict(num_tokens=16384, num_experts=64, top_k=8, num_groups=4, num_layers=4, noise=0.15, skew=0.5)


def make() -> Trace:
    pt = planted_trace(**SHAPE, seed=SEED)
    meta = dict(pt.trace.metadata)
    meta["planted_groups"] = json.dumps(pt.groups_LE.tolist(), separators=(",", ":"))
    meta["description"] = (
        "synthetic planted routing trace (occult scripts/make_example_trace.py): experts in 4 hidden groups "
        "of 16 per layer; tokens pick within one group, each pick leaving it with probability 0.15"
    )
    meta["seed"] = str(SEED)
    return Trace(pt.trace.topk_ids, pt.trace.num_experts, pt.trace.top_k, metadata=meta)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=example_trace_path())
    args = ap.parse_args()
    trace = make()
    write_trace(args.out, trace)
    print(
        f"wrote {args.out} ({args.out.stat().st_size / 1e6:.2f} MB): {trace.num_layers} layers x "
        f"{trace.num_tokens[0]} tokens, {trace.num_experts} experts, top-{trace.top_k}"
    )


if __name__ == "__main__":
    main()
