"""One MoE layer's data flow, one module per stage; read them in this order:

    config     `MoEConfig`, `RoutingConfig`, `ExecConfig`: a layer's settings, validated
    routing    `TopKRouter`: gate, softmax top-k, `norm_topk_prob`, device-limit hook
    pruning    device-limited (collaboration-pruned) top-k, expert similarity tables
    expert_map `ExpertMap`: the device and local slot of every expert
    plan       `DispatchPlan`: which rows go to which rank (standard: k copies, dedup: one per device)
    comm       `all_to_all`, the exchange autograd node, metadata packing, `CommStats`
    counts     the one host sync: row counts and every rank's input status, `RoutingError`
    gather     rows and gates between token and plan layouts, per-token sums (with gradients)
    contract   the one dispatcher contract: `Dispatcher`, `Schedule`, `Capabilities`, `Received`
    dispatch   the flat dispatchers (`StandardDispatcher`, `DedupDispatcher`)
    local      their one-rank schedule: an identity, no host wait (status read one layer later)
    two_level  `TwoLevelDispatcher` ("dedup2"): one copy per node, then per GPU inside it
    registry   the dispatcher name table, `make_dispatcher`
    experts    SwiGLU experts on received rows (torch reference; Triton via `occult.kernels`)
    layer      `OccultMoE`, the expert-parallel layer: route -> dispatch -> experts -> combine
    step       `agreed_step`: the device transport's ranks agree once per training step, not per call
    dense      `DenseMoE`, the single-process reference, and the expert-parameter init
    two_batch  two halves of a batch interleaved at the layers' exchanges (two threads, a turn)

The public names are re-exported by `occult` itself (`from occult import OccultMoE`).
"""
