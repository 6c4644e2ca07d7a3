"""One MoE layer's data flow, one module per stage; read them in this order:

    routing    `TopKRouter`: gate, softmax top-k, `norm_topk_prob`, device-limit hook
    pruning    device-limited (collaboration-pruned) top-k, expert similarity tables
    plan       `DispatchPlan`: which rows go to which rank (standard: k copies, dedup: one per device)
    comm       `all_to_all`, the exchange autograd node, metadata packing, `CommStats`
    dispatch   `Dispatcher` (`StandardDispatcher`, `DedupDispatcher`): counts, dispatch, combine
    experts    SwiGLU experts on received rows (torch reference; Triton via `occult.kernels`)
    overlap    the same stages over token chunks, all-to-alls hidden behind expert compute
    two_batch  two halves of a batch interleaved at the all-to-alls (two-batch overlap)
    layer      `OccultMoE`, the expert-parallel layer that runs the stages above
    dense      `DenseMoE`, the single-process reference, and the expert-parameter init

The public names are re-exported by `occult` itself (`from occult import OccultMoE`).
"""
