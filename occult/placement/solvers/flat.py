"""The flat solver of one layer: every candidate of a method scored by exact E[C_T], the best kept.

`solve_layer_flat` runs contiguous, greedy and (hypergraph) Mt-KaHyPar candidates, each
refined by swaps on all tokens and repaired to `max_load_ratio`; `LayerResult` says which won.
The registry (`solve.py`: `solve_layer`, `place`) and the hierarchical solver (nodes, then
GPUs: `hierarchical.py`) both build on it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from occult.placement.layout import check_divisible
from occult.placement.solvers.greedy import greedy_layer
from occult.placement.solvers.hypergraph import kahypar_partition, sample_tokens
from occult.placement.solvers.swap import (
    SwapState,
    device_load,
    device_load_cap,
    load_imbalance,
    merge_token_sets,
    rebalance_counts,
    refine_swaps,
    repair_load_only,
)
from occult.placement.stats import coactivation

METHODS = ("contiguous", "greedy", "hypergraph")

# Mt-KaHyPar sees at most this many sampled tokens per layer: its run time grows with the
# number of hyperedges, while the partition it finds on a sample is as good once refined on all
# tokens (docs/history.md, "Placement solver on CPU", has the times).
DEFAULT_KAHYPAR_TOKENS = 8_000


def contiguous_layer(num_experts: int, num_devices: int) -> np.ndarray:
    """[E] expert -> device of the contiguous layout."""
    return np.arange(num_experts) // check_divisible(num_experts, num_devices)


@dataclass
class LayerResult:
    """Outcome of solving one layer: the expert -> device map and how it was chosen."""

    expert_device_E: np.ndarray
    method: str  # the candidate that won, e.g. "kahypar+refine"
    mean_ct: float
    candidates: dict[str, float] = field(default_factory=dict)  # candidate -> E[C_T]
    load_imbalance: float = 1.0  # max / mean device load of the result
    seconds: float = 0.0
    warning: str | None = None  # set when max_load_ratio could not be met
    mean_nt: float | None = None  # E[N_T] (nodes per token) of a hierarchical solve


def check_method(method: str) -> None:
    """Raise a clear error for a method name not in `METHODS`."""
    if method not in METHODS:
        raise ValueError(f"unknown placement method {method!r}; choose one of {', '.join(METHODS)}")


def solve_layer_flat(
    topk_ids_TK: np.ndarray,
    num_experts: int,
    num_devices: int,
    method: str,
    max_load_ratio: float | None,
    seed: int,
    threads: int | None,
    kahypar_tokens: int,
    coact_EE: np.ndarray | None,
) -> LayerResult:
    """One layer on `num_devices` devices, flat (no nodes): every candidate of `method`, the best
    feasible one kept; a bound that cannot be met is reported in `LayerResult.warning`, not warned
    (`solve_layer` warns; worker processes return it to `place`)."""
    check_method(method)
    t0 = time.perf_counter()
    ids = np.asarray(topk_ids_TK)
    if ids.ndim != 2 or ids.shape[0] == 0:
        raise ValueError(f"topk_ids must have shape [tokens >= 1, top_k], got {list(ids.shape)}")
    per = check_divisible(num_experts, num_devices)
    sets, weights = merge_token_sets(ids, num_experts)
    state = SwapState(sets, weights, num_experts, num_devices)
    cap = device_load_cap(state.load_E, num_devices, max_load_ratio)
    contiguous = contiguous_layer(num_experts, num_devices)
    candidates: dict[str, np.ndarray] = {}
    if method == "contiguous":
        candidates["contiguous"] = contiguous if cap is None else repair_load_only(state, contiguous, cap)
    else:
        if coact_EE is None:
            coact_EE = coactivation(ids, num_experts)
        greedy = greedy_layer(coact_EE, num_devices)
        if method == "greedy":
            candidates["greedy"] = greedy if cap is None else repair_load_only(state, greedy, cap)
        else:
            candidates["contiguous"] = contiguous if cap is None else repair_load_only(state, contiguous, cap)
            candidates["greedy"] = greedy if cap is None else repair_load_only(state, greedy, cap)
            candidates["greedy+refine"] = refine_swaps(state, greedy, cap)
            multi = sets[:, 0] != sets[:, -1]  # tokens on a single expert never cost anything
            if num_devices > 1 and per > 1 and multi.any():
                rng = np.random.default_rng(seed)
                sub_sets, sub_w = merge_token_sets(sample_tokens(ids, kahypar_tokens, rng), num_experts)
                keep = sub_sets[:, 0] != sub_sets[:, -1]
                if keep.any():
                    part = kahypar_partition(sub_sets[keep], sub_w[keep], num_experts, num_devices, seed, threads)
                    if np.bincount(part, minlength=num_devices).max() != per:
                        part = rebalance_counts(state, part)
                    candidates["kahypar+refine"] = refine_swaps(state, part, cap)
    scored = {name: state.mean_ct(dev) for name, dev in candidates.items()}
    peak = {name: device_load(dev, state.load_E, num_devices).max() for name, dev in candidates.items()}
    feasible = [n for n in candidates if cap is None or peak[n] <= cap]
    warning = None
    if feasible:
        best = min(feasible, key=lambda n: scored[n])  # ties: the earliest (simplest) candidate
    else:
        best = min(candidates, key=lambda n: (peak[n], scored[n]))
        warning = (
            f"no placement meets max_load_ratio={max_load_ratio}: the most balanced one found has "
            f"max/mean device load {load_imbalance(candidates[best], state.load_E, num_devices):.3f} "
            "(an expert's own load may exceed the bound); raise the bound or drop it"
        )
    dev = candidates[best].astype(np.int64)
    return LayerResult(
        dev,
        best,
        scored[best],
        scored,
        load_imbalance(dev, state.load_E, num_devices),
        time.perf_counter() - t0,
        warning,
    )
