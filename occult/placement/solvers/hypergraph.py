"""Hypergraph partitioning of one layer's experts with Mt-KaHyPar (km1 = E[C_T] - 1 objective).

Tokens are hyperedges over their k experts (identical expert sets merged into one weighted
hyperedge); the connectivity (km1) objective divided by T is E[C_T] - 1. Mt-KaHyPar partitions
a seeded sample of the hyperedges (`sample_tokens`) with exact balance; the swap refinement
(`occult.placement.solvers.swap`) then lowers E[C_T] on all tokens.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

# One Mt-KaHyPar thread: seeded single-threaded runs are reproducible, and on few cores
# more threads do not pay for themselves on hypergraphs this small.
DEFAULT_KAHYPAR_THREADS = 1

_KAHYPAR_LOCK = threading.Lock()
_KAHYPAR: dict[str, Any] = {}


def _kahypar(threads: int | None = None) -> Any:
    """The process-wide Mt-KaHyPar initializer (mtkahypar.initialize may run once per process,
    so the first caller's thread count holds for the process)."""
    with _KAHYPAR_LOCK:
        if "init" not in _KAHYPAR:
            try:
                import mtkahypar
            except ImportError as exc:  # pragma: no cover - it is a dependency
                raise ImportError(
                    "the hypergraph solver needs Mt-KaHyPar: pip install mtkahypar (or use --method greedy)"
                ) from exc
            _KAHYPAR["module"] = mtkahypar
            _KAHYPAR["init"] = mtkahypar.initialize(int(threads or DEFAULT_KAHYPAR_THREADS), False)
        return _KAHYPAR["module"], _KAHYPAR["init"]


def kahypar_partition(
    sets_UK: np.ndarray | list[list[int]],
    weights_U: np.ndarray,
    num_experts: int,
    num_devices: int,
    seed: int = 0,
    threads: int | None = None,
) -> np.ndarray:
    """[E] Mt-KaHyPar km1 (connectivity) partition of the experts into D blocks of exactly E/D.

    Uses the DEFAULT preset seeded with `seed`; with one thread (the default) the result is
    reproducible. The caller checks the balance (`rebalance_counts` repairs it if needed).
    `sets_UK` may also be a list of hyperedges of different sizes (a node's share of each token).
    """
    edges = sets_UK.tolist() if isinstance(sets_UK, np.ndarray) else [list(map(int, s)) for s in sets_UK]
    mtk, init = _kahypar(threads)
    with _KAHYPAR_LOCK:  # set_seed is global state of the library
        mtk.set_seed(int(seed))
        ctx = init.context_from_preset(mtk.PresetType.DEFAULT)
        ctx.set_partitioning_parameters(int(num_devices), 0.0, mtk.Objective.KM1)
        ctx.logging = False
        hg = init.create_hypergraph(
            ctx,
            int(num_experts),
            len(edges),
            edges,
            [1] * int(num_experts),
            np.asarray(weights_U, dtype=np.int64).tolist(),
        )
        part = hg.partition(ctx)
        return np.asarray(part.get_partition(), dtype=np.intp)


def sample_tokens(topk_ids_TK: np.ndarray, max_tokens: int, rng: np.random.Generator) -> np.ndarray:
    """At most `max_tokens` rows of `topk_ids_TK`, drawn without replacement with `rng`, in order."""
    T = topk_ids_TK.shape[0]
    if T <= max_tokens:
        return topk_ids_TK
    return topk_ids_TK[np.sort(rng.choice(T, size=max_tokens, replace=False))]
