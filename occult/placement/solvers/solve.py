"""Placement solvers by name: solve one layer or every layer of a trace, pick the best candidate.

`METHODS` are the solvers `occult place --method` offers (module docstring of
`occult.placement.solvers`); `solve_layer` runs one on one layer, `place` on every layer of a
trace (optionally in worker processes), `best_method` says which to use where Mt-KaHyPar may
be missing. The one-layer solvers they call live below: `flat.py` (`solve_layer_flat`; also
`contiguous_layer`, the baseline layout) and `hierarchical.py` (nodes, then GPUs).

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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from occult.placement.layout import Placement, check_divisible
from occult.placement.solvers.flat import (
    DEFAULT_KAHYPAR_TOKENS,
    METHODS,
    LayerResult,
    check_method,
    contiguous_layer,
    solve_layer_flat,
)
from occult.placement.solvers.hierarchical import check_nodes, solve_layer_hierarchical
from occult.placement.solvers.swap import device_load_cap
from occult.placement.trace import Trace

__all__ = [  # LayerResult, METHODS, ... live in flat.py; this module is their registry
    "DEFAULT_KAHYPAR_TOKENS",
    "METHODS",
    "PARALLEL_MIN_TOKENS",
    "LayerResult",
    "PlacementResult",
    "available_cpus",
    "best_method",
    "contiguous_layer",
    "place",
    "solve_layer",
]


def best_method() -> str:
    """ "hypergraph" when Mt-KaHyPar is importable, else "greedy" (e.g. on an image without it)."""
    import importlib.util

    return "hypergraph" if importlib.util.find_spec("mtkahypar") is not None else "greedy"


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
    res = solve_layer_flat(
        topk_ids_TK, num_experts, num_devices, method, max_load_ratio, seed, threads, kahypar_tokens, coact_EE
    )
    if res.warning:
        warnings.warn(res.warning, RuntimeWarning, stacklevel=2)
    return res


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
    check_method(method)
    check_divisible(trace.num_experts, num_devices)
    device_load_cap(np.ones(1), 1, max_load_ratio)  # validate the bound before any work
    solver: Any = solve_layer_flat
    if num_nodes != 1:
        check_nodes(num_devices, num_nodes)
        solver = solve_layer_hierarchical
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
        return (
            trace.layer(i),
            trace.num_experts,
            num_devices,
            *nodes,
            method,
            max_load_ratio,
            seed + i,
            threads,
            kahypar_tokens,
            coact,
        )

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
