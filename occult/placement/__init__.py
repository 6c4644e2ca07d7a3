"""Expert placement: which device holds which expert, and everything needed to choose it.

    layout      `Placement` (per-layer expert -> device, JSON I/O, apply/invert/shard helpers),
                `PlacementError`, `check_divisible`
    trace       routing-trace files (safetensors): read, write, validate, record
    synthetic   uniform and planted (hidden expert groups) traces
    stats       per-token and per-expert statistics: co-activation, C_T, E[C_T], bytes moved
    report      whole-layer / whole-trace reports, a placement against a baseline
    solvers/    contiguous, greedy (the paper's), hypergraph (Mt-KaHyPar) + swap refinement
    plots       co-activation heat maps ordered by device (matplotlib, optional)

Importing the package imports only `layout` (numpy, torch); the other modules load on use.
`from occult.placement import Placement` is the public path of the type.
"""

from occult.placement.layout import Placement, PlacementError, check_divisible

__all__ = ["Placement", "PlacementError", "check_divisible"]
