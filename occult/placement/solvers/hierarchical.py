"""Hierarchical placement: experts to nodes, then each node's experts to its GPUs.

Across nodes the slow link dominates, so the first objective is E[N_T], the expected number of
distinct *nodes* a token's experts sit on; the second, within that, is E[C_T] (distinct GPUs).
Both are connectivity objectives of the same token hypergraph, so the solve is recursive:

1. **nodes**: the flat solver (`solve_layer_flat`, any method) partitions the E experts into M
   node-parts of E/M; for `hypergraph` that is Mt-KaHyPar plus the exact swap refinement of
   E[N_T] on all tokens, with greedy and contiguous as candidates;
2. **GPUs**: each node's experts are partitioned into its D/M GPUs: contiguous, the paper's
   greedy on the node's co-activation block and (hypergraph) Mt-KaHyPar on the tokens' shares
   of the node (hyperedges of varying size), then the swap refinement of E[C_T] on all tokens
   with swaps kept inside a node (`refine_swaps(group_E=node)`), so E[N_T] is never touched.
   E[C_T] is a sum over nodes of each node's own GPU count, so every node keeps its own best
   candidate.

Device ids are node-major: node n holds devices [n*D/M, (n+1)*D/M). `max_load_ratio` bounds
max/mean load at both levels (nodes, then GPUs; the GPU-level repair swaps inside nodes only).
"""

from __future__ import annotations

import time

import numpy as np

from occult.placement.layout import PlacementError, check_divisible
from occult.placement.solvers.flat import LayerResult, solve_layer_flat
from occult.placement.solvers.greedy import greedy_layer
from occult.placement.solvers.hypergraph import kahypar_partition, sample_tokens
from occult.placement.solvers.swap import (
    SwapState,
    device_load,
    device_load_cap,
    load_imbalance,
    merge_token_sets,
    refine_swaps,
    repair_load,
)
from occult.placement.stats import coactivation


def check_nodes(num_devices: int, num_nodes: int) -> int:
    """Return D/M, or raise a clear error when the devices cannot be split evenly over nodes."""
    if num_nodes < 1 or num_devices % num_nodes:
        raise PlacementError(f"--nodes {num_nodes} must be >= 1 and divide --devices {num_devices} (D/M GPUs per node)")
    return num_devices // num_nodes


def _node_edges(
    sets_UK: np.ndarray, w_U: np.ndarray, members: np.ndarray, num_experts: int
) -> tuple[list[list[int]], list[int]]:
    """Each token's share of one node as a hyperedge over local ids (shares of < 2 experts dropped, equal
    ones merged)."""
    local = np.full(num_experts, -1, dtype=np.int64)
    local[members] = np.arange(len(members))
    loc_UK = local[sets_UK]
    merged: dict[tuple[int, ...], int] = {}
    for row, w in zip(loc_UK.tolist(), w_U.tolist()):
        edge = tuple(sorted(x for x in row if x >= 0))
        if len(edge) >= 2:
            merged[edge] = merged.get(edge, 0) + int(w)
    return [list(e) for e in merged], list(merged.values())


def _per_node_cost(state: SwapState, dev_E: np.ndarray, num_nodes: int) -> np.ndarray:
    """[M] sum_u w_u (GPUs of node n among u's experts): E[C_T] * T split by node."""
    N_UD = state.counts(dev_E)
    G = state.D // num_nodes
    used = (N_UD > 0).reshape(state.U, num_nodes, G).sum(2)
    return (state.w[:, None] * used).sum(0)


def solve_layer_hierarchical(
    topk_ids_TK: np.ndarray,
    num_experts: int,
    num_devices: int,
    num_nodes: int,
    method: str,
    max_load_ratio: float | None,
    seed: int,
    threads: int | None,
    kahypar_tokens: int,
    coact_EE: np.ndarray | None,
) -> LayerResult:
    """One layer on `num_devices` devices in `num_nodes` nodes (module docstring): experts to nodes
    by E[N_T], then each node's experts to its GPUs by E[C_T]; `mean_nt` holds E[N_T]."""
    t0 = time.perf_counter()
    G = check_nodes(num_devices, num_nodes)
    per = check_divisible(num_experts, num_devices)
    if num_nodes == 1:
        res = solve_layer_flat(
            topk_ids_TK, num_experts, num_devices, method, max_load_ratio, seed, threads, kahypar_tokens, coact_EE
        )
        res.mean_nt = 1.0
        return res
    ids = np.asarray(topk_ids_TK)
    if coact_EE is None and method != "contiguous":
        coact_EE = coactivation(ids, num_experts)
    nodes = solve_layer_flat(
        ids, num_experts, num_nodes, method, max_load_ratio, seed, threads, kahypar_tokens, coact_EE
    )
    node_E = nodes.expert_device_E.astype(np.intp)
    sets, weights = merge_token_sets(ids, num_experts)
    state = SwapState(sets, weights, num_experts, num_devices)
    cap = device_load_cap(state.load_E, num_devices, max_load_ratio)
    members_M = [np.flatnonzero(node_E == n) for n in range(num_nodes)]  # ascending ids

    def assemble(parts: list[np.ndarray]) -> np.ndarray:
        dev = np.empty(num_experts, dtype=np.intp)
        for n, (mem, part) in enumerate(zip(members_M, parts)):
            dev[mem] = n * G + np.asarray(part, dtype=np.intp)
        return dev

    def repaired(dev: np.ndarray) -> np.ndarray:
        return dev if cap is None else repair_load(state, dev.copy(), state.counts(dev), cap, node_E)[0]

    candidates: dict[str, np.ndarray] = {
        "contiguous": repaired(assemble([np.arange(len(m)) // per for m in members_M]))
    }
    if method != "contiguous" and G > 1 and per > 1:
        greedy = assemble([greedy_layer(coact_EE[np.ix_(m, m)], G) for m in members_M])
        candidates["greedy"] = repaired(greedy)
        if method == "hypergraph":
            candidates["greedy+refine"] = refine_swaps(state, greedy, cap, group_E=node_E)
            rng = np.random.default_rng(seed)
            sub_sets, sub_w = merge_token_sets(sample_tokens(ids, kahypar_tokens, rng), num_experts)
            parts = []
            for n, mem in enumerate(members_M):
                edges, w = _node_edges(sub_sets, sub_w, mem, num_experts)
                part = (
                    kahypar_partition(edges, w, len(mem), G, seed + n, threads) if edges else np.arange(len(mem)) // per
                )
                parts.append(part)
            dev = assemble([_fix_sizes(p, G) for p in parts])
            candidates["kahypar+refine"] = refine_swaps(state, dev, cap, group_E=node_E)
    names = list(candidates)
    cost_CM = np.stack([_per_node_cost(state, candidates[c], num_nodes) for c in names])
    dev, chosen, warning = _best_per_node(state, candidates, cost_CM, members_M, cap, max_load_ratio)
    warning = nodes.warning or warning
    scored = {f"nodes:{k}": v for k, v in nodes.candidates.items()}
    scored.update({f"gpus:{c}": float(cost_CM[i].sum() / state.total_weight) for i, c in enumerate(names)})
    wins = sorted(set(chosen), key=chosen.index)
    return LayerResult(
        dev.astype(np.int64),
        f"{nodes.method} / {','.join(wins)}",
        state.mean_ct(dev),
        scored,
        load_imbalance(dev, state.load_E, num_devices),
        time.perf_counter() - t0,
        warning,
        mean_nt=nodes.mean_ct,
    )


def _best_per_node(
    state: SwapState,
    candidates: dict[str, np.ndarray],
    cost_CM: np.ndarray,
    members_M: list[np.ndarray],
    cap: float | None,
    max_load_ratio: float | None,
) -> tuple[np.ndarray, list[str], str | None]:
    """E[C_T] is a sum over nodes, so each node keeps its best feasible candidate (else its most
    balanced one, with a warning): (expert -> device, the candidate each node kept, warning)."""
    names = list(candidates)
    G = state.D // len(members_M)
    dev = np.empty(state.E, dtype=np.intp)
    chosen, warning = [], None
    for n, mem in enumerate(members_M):
        peak = [device_load(candidates[c], state.load_E, state.D)[n * G : (n + 1) * G].max() for c in names]
        ok = [i for i in range(len(names)) if cap is None or peak[i] <= cap]
        best = min(ok, key=lambda i: cost_CM[i, n]) if ok else int(np.argmin(peak))
        if not ok and warning is None:
            warning = f"no GPU split of node {n} meets max_load_ratio={max_load_ratio}; the most balanced one is kept"
        dev[mem] = candidates[names[best]][mem]
        chosen.append(names[best])
    return dev, chosen, warning


def _fix_sizes(part: np.ndarray, G: int) -> np.ndarray:
    """Give every GPU of a node exactly len(part)/G experts, moving surplus experts (highest ids
    first) to the emptiest GPUs; the swap refinement then repairs the cost."""
    part = np.asarray(part, dtype=np.intp).copy()
    per = len(part) // G
    for e in range(len(part) - 1, -1, -1):
        cnt = np.bincount(part, minlength=G)
        if cnt[part[e]] > per:
            part[e] = int(np.argmin(cnt))
    return part
