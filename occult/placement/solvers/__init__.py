"""Placement solvers: choose, per layer, which device holds which expert to lower E[C_T].

- `contiguous`: experts [d*E/D, (d+1)*E/D) on device d, the layout every framework uses (baseline).
- `greedy`: the paper's clustering on the pairwise co-activation matrix. Device 0 is seeded
  with the most co-activated pair, a device grows with the unplaced expert of highest mean
  co-activation with its members, and the next device is seeded with the unplaced expert
  least co-activated with all experts placed so far.
- `hypergraph`: minimises E[C_T] itself. Tokens are hyperedges over their k experts
  (identical expert sets merged into one weighted hyperedge); E[C_T] - 1 is the
  connectivity (km1) objective divided by T. Mt-KaHyPar partitions a seeded sample of the
  hyperedges with exact balance, then a swap refinement on *all* tokens lowers E[C_T]
  exactly, keeping E/D experts per device. Greedy and contiguous are candidates too and
  the best candidate wins, so the result is never worse than either.
- hierarchical (`place(..., num_nodes=M)`): any method, first experts to M nodes (E[N_T]),
  then each node's experts to its D/M GPUs (E[C_T], swaps inside nodes).

One module per job: `solve` (the registry: `solve_layer`, `place`, `best_method`), `flat` (one
layer: `METHODS`, the candidates, the contiguous baseline), `greedy` (the paper's clustering), `hypergraph` (Mt-KaHyPar)
and `swap` (the exact swap refinement and the load-bound repair), `hierarchical` (nodes, then GPUs).
"""

from occult.placement.solvers.greedy import greedy_layer
from occult.placement.solvers.hierarchical import check_nodes
from occult.placement.solvers.hypergraph import DEFAULT_KAHYPAR_THREADS, kahypar_partition
from occult.placement.solvers.solve import (
    DEFAULT_KAHYPAR_TOKENS,
    METHODS,
    PARALLEL_MIN_TOKENS,
    LayerResult,
    PlacementResult,
    available_cpus,
    best_method,
    contiguous_layer,
    place,
    solve_layer,
)
from occult.placement.solvers.swap import DEFAULT_MAX_ROUNDS, merge_token_sets, rebalance_counts, refine_swaps

__all__ = [
    "DEFAULT_KAHYPAR_THREADS",
    "DEFAULT_KAHYPAR_TOKENS",
    "DEFAULT_MAX_ROUNDS",
    "METHODS",
    "PARALLEL_MIN_TOKENS",
    "LayerResult",
    "PlacementResult",
    "available_cpus",
    "check_nodes",
    "best_method",
    "contiguous_layer",
    "greedy_layer",
    "kahypar_partition",
    "merge_token_sets",
    "place",
    "rebalance_counts",
    "refine_swaps",
    "solve_layer",
]
