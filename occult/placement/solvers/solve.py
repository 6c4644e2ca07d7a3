"""Placement solvers by name: solve one layer or every layer of a trace, pick the best candidate.

`METHODS` are the solvers `occult place --method` offers (module docstring of
`occult.placement.solvers`); `solve_layer` runs one on one layer, `place` on every layer of a
trace (optionally in worker processes), `best_method` says which to use where Mt-KaHyPar may
be missing. `contiguous_layer` is the baseline layout.

Optional `max_load_ratio`: a bound on max/mean per-device load, the load of a device being
the token-expert assignments it computes (the sum of its experts' loads, `device_load_D` in
`occult.placement.report`). Greedy and hypergraph repair violations with the swaps that cost the least
E[C_T]; if the bound cannot be met (one expert alone exceeds it), the most balanced layout
found is kept and a warning says so.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from occult.placement.layout import Placement, check_divisible
from occult.placement.solvers.greedy import greedy_layer
from occult.placement.solvers.hypergraph import _sample_tokens, kahypar_partition
from occult.placement.solvers.swap import (
    _device_load,
    _imbalance,
    _load_cap,
    _repair_only,
    _SwapState,
    merge_token_sets,
    rebalance_counts,
    refine_swaps,
)
from occult.placement.stats import coactivation
from occult.placement.trace import Trace

METHODS = ("contiguous", "greedy", "hypergraph")

# Mt-KaHyPar sees at most this many sampled tokens per layer: its run time grows with the
# number of hyperedges (about 7 s for 200k tokens of 64 experts on 2 cores, 0.3 s for 8k)
# while the partition it finds on a sample is as good once refined on all tokens.
DEFAULT_KAHYPAR_TOKENS = 8_000


def contiguous_layer(num_experts: int, num_devices: int) -> np.ndarray:
    """[E] expert -> device of the contiguous layout."""
    return np.arange(num_experts) // check_divisible(num_experts, num_devices)


def best_method() -> str:
    """"hypergraph" when Mt-KaHyPar is importable, else "greedy" (e.g. on an image without it)."""
    import importlib.util

    return "hypergraph" if importlib.util.find_spec("mtkahypar") is not None else "greedy"


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


def solve_layer(
    topk_ids_TK: np.ndarray,
    num_experts: int,
    num_devices: int,
    method: str = "hypergraph",
    *,
    max_load_ratio: float | None = None,
    seed: int = 0,
    threads: int | None = None,
    kahypar_tokens: int = DEFAULT_KAHYPAR_TOKENS,
    coact_EE: np.ndarray | None = None,
) -> LayerResult:
    """Place one layer's experts on `num_devices` devices with `method` (module docstring).

    `max_load_ratio` bounds max/mean device load (a RuntimeWarning says when it cannot be
    met); `seed` makes Mt-KaHyPar and its token sample reproducible; `kahypar_tokens` caps
    the tokens Mt-KaHyPar sees (the refinement always uses all of them); `coact_EE` reuses
    a co-activation matrix already computed.
    """
    res = _solve_layer(
        topk_ids_TK, num_experts, num_devices, method, max_load_ratio, seed, threads, kahypar_tokens, coact_EE
    )
    if res.warning:
        warnings.warn(res.warning, RuntimeWarning, stacklevel=2)
    return res


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown placement method {method!r}; choose one of {', '.join(METHODS)}")


def _solve_layer(
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
    _check_method(method)
    t0 = time.perf_counter()
    ids = np.asarray(topk_ids_TK)
    if ids.ndim != 2 or ids.shape[0] == 0:
        raise ValueError(f"topk_ids must have shape [tokens >= 1, top_k], got {list(ids.shape)}")
    per = check_divisible(num_experts, num_devices)
    sets, weights = merge_token_sets(ids, num_experts)
    state = _SwapState(sets, weights, num_experts, num_devices)
    cap = _load_cap(state.load_E, num_devices, max_load_ratio)
    contiguous = contiguous_layer(num_experts, num_devices)
    candidates: dict[str, np.ndarray] = {}
    if method == "contiguous":
        candidates["contiguous"] = contiguous if cap is None else _repair_only(state, contiguous, cap)
    else:
        if coact_EE is None:
            coact_EE = coactivation(ids, num_experts)
        greedy = greedy_layer(coact_EE, num_devices)
        if method == "greedy":
            candidates["greedy"] = greedy if cap is None else _repair_only(state, greedy, cap)
        else:
            candidates["contiguous"] = contiguous if cap is None else _repair_only(state, contiguous, cap)
            candidates["greedy"] = greedy if cap is None else _repair_only(state, greedy, cap)
            candidates["greedy+refine"] = refine_swaps(state, greedy, cap)
            multi = sets[:, 0] != sets[:, -1]  # tokens on a single expert never cost anything
            if num_devices > 1 and per > 1 and multi.any():
                rng = np.random.default_rng(seed)
                sub_sets, sub_w = merge_token_sets(_sample_tokens(ids, kahypar_tokens, rng), num_experts)
                keep = sub_sets[:, 0] != sub_sets[:, -1]
                if keep.any():
                    part = kahypar_partition(sub_sets[keep], sub_w[keep], num_experts, num_devices, seed, threads)
                    if np.bincount(part, minlength=num_devices).max() != per:
                        part = rebalance_counts(state, part)
                    candidates["kahypar+refine"] = refine_swaps(state, part, cap)
    scored = {name: state.mean_ct(dev) for name, dev in candidates.items()}
    peak = {name: _device_load(dev, state.load_E, num_devices).max() for name, dev in candidates.items()}
    feasible = [n for n in candidates if cap is None or peak[n] <= cap]
    warning = None
    if feasible:
        best = min(feasible, key=lambda n: scored[n])  # ties: the earliest (simplest) candidate
    else:
        best = min(candidates, key=lambda n: (peak[n], scored[n]))
        warning = (
            f"no placement meets max_load_ratio={max_load_ratio}: the most balanced one found has "
            f"max/mean device load {_imbalance(candidates[best], state.load_E, num_devices):.3f} "
            "(an expert's own load may exceed the bound); raise the bound or drop it"
        )
    dev = candidates[best].astype(np.int64)
    return LayerResult(
        dev,
        best,
        scored[best],
        scored,
        _imbalance(dev, state.load_E, num_devices),
        time.perf_counter() - t0,
        warning,
    )


@dataclass
class PlacementResult:
    """A multi-layer placement and the per-layer solver outcomes."""

    placement: Placement
    layers: list[LayerResult]
    method: str
    seconds: float
    jobs: int = 1


def available_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


# Below this many tokens in all, worker start-up (an interpreter importing torch) costs more
# than solving layers in parallel saves.
PARALLEL_MIN_TOKENS = 400_000


def _auto_jobs(trace: Trace, method: str) -> int:
    if method == "contiguous" or trace.num_layers < 2 or sum(trace.num_tokens) < PARALLEL_MIN_TOKENS:
        return 1
    return min(available_cpus(), trace.num_layers)


def _pool(jobs: int) -> Any:
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    # forkserver: workers fork from a fresh server process, never from this one, whose
    # threads (Mt-KaHyPar's TBB pool, OpenMP) must not be inherited by a fork.
    methods = mp.get_all_start_methods()
    ctx = mp.get_context("forkserver" if "forkserver" in methods else "spawn")
    return ProcessPoolExecutor(max_workers=jobs, mp_context=ctx)


def place(
    trace: Trace,
    num_devices: int,
    method: str = "hypergraph",
    *,
    max_load_ratio: float | None = None,
    seed: int = 0,
    threads: int | None = None,
    kahypar_tokens: int = DEFAULT_KAHYPAR_TOKENS,
    progress: bool = False,
    coacts_LEE: Sequence[np.ndarray] | None = None,
    jobs: int | None = 1,
    num_nodes: int = 1,
) -> PlacementResult:
    """Place every layer of `trace` on `num_devices` devices with `method` (layer i seeded seed + i).

    `num_nodes` > 1 solves hierarchically (`occult.placement.solvers.hierarchical`): experts to
    nodes (lowest E[N_T]) then to the node's D/M GPUs (lowest E[C_T]); device ids node-major.

    `jobs` worker processes solve layers in parallel (None: one per CPU when the trace is
    large enough to pay for starting them; `occult place` uses that); the result does not
    depend on it. `progress` shows a tqdm bar on stderr.
    """
    _check_method(method)
    check_divisible(trace.num_experts, num_devices)
    _load_cap(np.ones(1), 1, max_load_ratio)  # validate the bound before any work
    solver: Any = _solve_layer
    if num_nodes != 1:
        from occult.placement.solvers.hierarchical import _solve_layer_hierarchical, check_nodes

        check_nodes(num_devices, num_nodes)
        solver = _solve_layer_hierarchical
    t0 = time.perf_counter()
    L = trace.num_layers
    jobs = _auto_jobs(trace, method) if jobs is None else max(1, min(int(jobs), L))
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=L, desc=f"placing ({method})", unit="layer", file=sys.stderr, leave=False)

    def args(i: int) -> tuple[Any, ...]:
        coact = None if coacts_LEE is None else coacts_LEE[i]
        nodes = () if num_nodes == 1 else (num_nodes,)
        return (trace.layer(i), trace.num_experts, num_devices, *nodes, method, max_load_ratio, seed + i, threads,
                kahypar_tokens, coact)

    results: list[LayerResult | None] = [None] * L
    try:
        if jobs == 1:
            for i in range(L):
                results[i] = solver(*args(i))
                if bar is not None:
                    bar.update(1)
        else:
            from concurrent.futures import as_completed

            with _pool(jobs) as pool:
                futures = {pool.submit(solver, *args(i)): i for i in range(L)}
                for fut in as_completed(futures):
                    results[futures[fut]] = fut.result()
                    if bar is not None:
                        bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    done = [r for r in results if r is not None]
    for i, r in enumerate(done):
        if r.warning:
            warnings.warn(f"layer {i}: {r.warning}", RuntimeWarning, stacklevel=2)
    placement = Placement(np.stack([r.expert_device_E for r in done]), num_devices, num_nodes)
    return PlacementResult(placement, done, method, time.perf_counter() - t0, jobs)
