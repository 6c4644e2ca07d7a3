"""Rows per token on each link (inter-node, intra-node) for standard / dedup / dedup2, MEASURED by
`CommStats` on CPU gloo ranks that simulate M nodes x G GPUs. Counts, not timings.

    python benchmarks/two_level_rows.py --nodes 2 --gpus-per-node 2 --out docs/results/two_level_rows.json

Tokens come from a two-level planted trace (`planted_nodes_trace`): the experts are solved on one
half (contiguous, flat greedy, hierarchical greedy) and the other half is routed, its expert ids
forced (a router returning the trace's ids), through `OccultMoE` forward + backward on every
rank, each rank its share of the tokens. Reported per token and direction (forward sends each
row once out and once back; totals over ranks / 2 / tokens), next to E[C_T] and E[N_T] of the
routed half (`occult.placement.report`); for dedup2 the inter-node rows must equal
E[N_T] - P(token's own node among its nodes), which the script checks.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
import torch.nn as nn

from occult.distributed import run_ranks
from occult.moe.dense import DenseMoE
from occult.moe.layer import OccultMoE
from occult.placement import Placement
from occult.placement.report import layer_stats
from occult.placement.solvers import place
from occult.placement.synthetic import planted_nodes_trace
from occult.placement.trace import Trace
from occult.tools.run_record import run_record

DISPATCHERS = ("standard", "dedup", "dedup2")


class GivenIds(nn.Module):
    """Uniform gate weights at fixed expert ids (the trace's)."""

    def __init__(self, ids_TK: torch.Tensor) -> None:
        super().__init__()
        self.ids_TK = ids_TK

    def forward(self, x_TH):
        k = self.ids_TK.shape[1]
        return x_TH.new_full(self.ids_TK.shape, 1.0 / k), self.ids_TK


def worker(rank: int, world: int, cfg: dict) -> list[dict]:
    torch.manual_seed(0)
    ids = torch.as_tensor(np.asarray(cfg["ids"]), dtype=torch.int64)
    share = ids.shape[0] // world
    mine = ids[rank * share : (rank + 1) * share]
    dense = DenseMoE(cfg["hidden"], cfg["ffn"], cfg["experts"], ids.shape[1], dtype=torch.float32)
    out = []
    for name, devices in cfg["placements"].items():
        placement = Placement(np.asarray(devices)[None], world, cfg["nodes"])
        for dispatcher in DISPATCHERS:
            layer = OccultMoE.from_dense(dense, placement=placement, dispatcher=dispatcher)
            layer.router = GivenIds(mine)
            x = torch.randn(share, cfg["hidden"], requires_grad=True)
            layer(x).sum().backward()
            s = layer.last_comm_stats
            out.append(
                dict(
                    placement=name,
                    dispatcher=dispatcher,
                    inter=s.forward_internode_rows,
                    intra=s.forward_intranode_rows,
                    rows=s.forward_rows,
                    back_inter=s.backward_internode_rows,
                )
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--gpus-per-node", type=int, default=2)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096, help="routed tokens in all (as many again to place on)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    M, G = a.nodes, a.gpus_per_node
    D = M * G
    pt = planted_nodes_trace(2 * a.tokens, a.experts, a.top_k, num_nodes=M, groups_per_node=G, seed=a.seed)
    ids = pt.trace.layer(0)
    fit_ids, test_ids = ids[: a.tokens], ids[a.tokens :]
    fit = Trace([fit_ids], a.experts, a.top_k)
    placements = {
        "contiguous": np.arange(a.experts) // (a.experts // D),
        "flat greedy": place(fit, D, "greedy", seed=a.seed).placement.expert_device(0),
        "hierarchical greedy": place(fit, D, "greedy", num_nodes=M, seed=a.seed).placement.expert_device(0),
    }
    cfg = dict(
        ids=test_ids.tolist(),
        experts=a.experts,
        hidden=32,
        ffn=16,
        nodes=M,
        placements={k: v.tolist() for k, v in placements.items()},
    )
    t0 = time.perf_counter()
    per_rank = run_ranks(worker, D, cfg, timeout_s=600)
    T = (a.tokens // D) * D
    rows = []
    print(
        f"{M} nodes x {G} GPUs, {a.experts} experts, top-{a.top_k}, {T} routed tokens "
        f"(planted two-level trace); rows per token per direction, measured by CommStats"
    )
    print(
        f"{'placement':22s} {'E[C_T]':>7s} {'E[N_T]':>7s} "
        + " ".join(f"{d + ' inter/intra':>20s}" for d in DISPATCHERS)
    )
    for name, dev in placements.items():
        st = layer_stats(test_ids[:T], a.experts, Placement(dev[None], D, M))
        owner = np.repeat(np.arange(D), T // D)  # each token's own rank
        nodes_T = [set(int(dev[e]) // G for e in row) for row in test_ids[:T]]
        remote_nodes = sum(len(n - {owner[t] // G}) for t, n in enumerate(nodes_T)) / T
        row = dict(placement=name, mean_ct=st.mean_ct, mean_nt=st.mean_nt, remote_nodes_per_token=remote_nodes)
        cells = []
        for d in DISPATCHERS:
            res = [r for rank in per_rank for r in rank if r["placement"] == name and r["dispatcher"] == d]
            inter = sum(r["inter"] for r in res) / 2 / T
            intra = sum(r["intra"] for r in res) / 2 / T
            assert all(r["back_inter"] == r["inter"] for r in res)
            row[d] = dict(inter=inter, intra=intra, rows=sum(r["rows"] for r in res) / 2 / T)
            cells.append(f"{inter:9.3f} / {intra:7.3f}")
        if abs(row["dedup2"]["inter"] - remote_nodes) > 1e-12:
            raise SystemExit(f"dedup2 inter-node rows {row['dedup2']['inter']} != remote nodes {remote_nodes}")
        rows.append(row)
        print(f"{name:22s} {st.mean_ct:7.3f} {st.mean_nt:7.3f} " + " ".join(f"{c:>20s}" for c in cells))
    print(f"({time.perf_counter() - t0:.1f} s; dedup2 inter-node rows == sum over tokens of remote nodes: checked)")
    if a.out:
        from occult._atomic import write_text_atomic

        doc = dict(nodes=M, gpus_per_node=G, experts=a.experts, top_k=a.top_k, tokens=T, seed=a.seed, rows=rows)
        doc["env"] = run_record(M * G, on_gpu=False)  # CPU gloo ranks: counts, not timings
        write_text_atomic(a.out, json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
