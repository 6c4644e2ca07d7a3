"""`ExecConfig(graphs=True)` on every GPU over NCCL: a layer's forwards replayed from its own CUDA
graphs give what the count exchange gives eagerly, call after call, for token counts that differ
between ranks and between calls (captured, replayed, recaptured after the transport's buffers
grew), in fp32, bf16 and fp16; bad routing inside a replay is still raised on every rank; its
`last_comm_stats` are the replayed call's."""

from __future__ import annotations

import pytest
import torch
from test_collective_layer import DTYPES, FFN, HIDDEN, _placement, _rel, skip_without_transport

from occult import DenseMoE, OccultMoE, RoutingError, TopKRouter, check_routing
from occult.moe.graphs import EAGER_CALLS

REPLAY_RESERVE_BYTES = 16 << 20  # > any call of the replay case (2 ranks x 4 rows x 256 tokens x ~2.2 KB fp32 rows)
TOL_VS_EAGER = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _layers(ranks, transport: str, dtype: torch.dtype, salt: int, dispatcher: str = "dedup", train_graphs=False):
    """(the layer with graphs over `transport` (`train_graphs`: training calls too), the same layer eager
    over the count exchange)."""
    if ranks.device.type != "cuda" or ranks.backend != "nccl":
        pytest.skip("CUDA graphs of collectives need GPUs with NCCL")
    if transport == "device":
        skip_without_transport(ranks, "device")
    torch.manual_seed(ranks.seed + salt)
    E = 8 * ranks.world_size
    dense = DenseMoE(HIDDEN, FFN, E, 4, dtype=dtype, device=ranks.device)
    with torch.no_grad():
        dense.router.gate.weight.mul_(3.0)
    placement = _placement("random", E, ranks.world_size, ranks.seed)
    sync_free = transport == "sync_free"
    graphed = OccultMoE.from_dense(
        dense,
        placement=placement,
        dispatcher=dispatcher,
        graphs=True,
        train_graphs=train_graphs,
        sync_free=sync_free,
        transport="counts" if sync_free else "device",
    )
    eager = OccultMoE.from_dense(dense, placement=placement, dispatcher=dispatcher, transport="counts")
    return graphed, eager


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("dispatcher", ["standard", "dedup"])
@pytest.mark.parametrize("transport", ["device", "sync_free"])
def test_replayed_forwards_match_the_eager_layer(ranks, transport, dispatcher, dtype_name):
    dtype = DTYPES[dtype_name]
    graphed, eager = _layers(ranks, transport, dtype, 21, dispatcher)
    same = transport == "sync_free"  # sync-free: every rank passes the same token count
    # token counts call by call, and the graphs the layer holds after each call: a signature is
    # captured at its third call. Before call 7 the transport's buffers grow (as another layer's
    # larger call would make them); call 7, seeing their new generation, drops every graph and
    # captures its own signature again at once (seen before); call 10 does the same for the other
    sizes = [96, 96, 96, 96, 40, 40, 40, 96, 96, 96, 40, 40]
    held = [0, 0, 1, 1, 1, 1, 2, 1, 1, 1, 2, 2] if not same else [0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2]
    gen = torch.Generator(device=ranks.device).manual_seed(ranks.seed * 11 + ranks.rank)
    worst = 0.0
    with torch.no_grad():
        if not same:  # the case starts with the transport released (conftest.py): grow it now past what these
            # calls need, so that only call 7's growth drops graphs
            graphed.dispatcher.transport.reserve(REPLAY_RESERVE_BYTES)
        for i, size in enumerate(sizes):
            if i == 7 and not same:
                transport = graphed.dispatcher.transport
                transport.reserve(transport.capacity_bytes + 1)  # one MiB more (every rank: growth is collective)
            tokens = size if same else size + 13 * ranks.rank
            x = torch.randn(tokens, HIDDEN, dtype=dtype, device=ranks.device, generator=gen)
            y = graphed(x)
            y_ref = eager(x)
            worst = max(worst, _rel(y, y_ref))
            stats, ref_stats = graphed.last_comm_stats, eager.last_comm_stats
            if not same:  # (sync-free sends its whole capacity: other counts by design)
                assert (stats.forward_rows, stats.dispatch_rows) == (ref_stats.forward_rows, ref_stats.dispatch_rows), (
                    i,
                    stats.as_dict(),
                    ref_stats.as_dict(),
                )
            assert len(graphed.graphs) == held[i], (i, len(graphed.graphs), held)
    assert ranks.all_max(worst) <= TOL_VS_EAGER[dtype], (transport, dispatcher, dtype_name, worst)


def test_replays_keep_up_with_weights_changed_in_place_and_a_new_router(ranks):
    """A graph reads the layer's tensors where they are: an in-place update is seen; a replaced
    router (another module) gets its own graph."""
    graphed, eager = _layers(ranks, "device", torch.bfloat16, 22)
    x = torch.randn(64 + 5 * ranks.rank, HIDDEN, dtype=torch.bfloat16, device=ranks.device)
    with torch.no_grad():
        for _ in range(EAGER_CALLS + 1):
            graphed(x)
        for layer in (graphed, eager):
            layer.down_proj.mul_(-0.5)
        worst = _rel(graphed(x), eager(x))
        router = TopKRouter(HIDDEN, graphed.num_experts, graphed.top_k, dtype=torch.bfloat16, device=ranks.device)
        router.gate.weight.copy_(torch.randn_like(router.gate.weight))
        graphed.router, eager.router = router, router
        for _ in range(EAGER_CALLS + 2):
            worst = max(worst, _rel(graphed(x), eager(x)))
    assert len(graphed.graphs) == 2
    assert ranks.all_max(worst) <= TOL_VS_EAGER[torch.bfloat16], worst


def test_bad_routing_in_a_replay_raises_on_every_rank(ranks):
    """NaN activations on the last rank inside a replayed call: every rank raises the same
    `RoutingError` (by `check_routing()` or the next call), then the layer works on."""
    graphed, _ = _layers(ranks, "device", torch.bfloat16, 23)
    x = torch.randn(64, HIDDEN, dtype=torch.bfloat16, device=ranks.device)
    with torch.no_grad():
        for _ in range(EAGER_CALLS + 1):
            graphed(x)
        assert len(graphed.graphs) == 1
        bad = x.clone()
        if ranks.rank == ranks.world_size - 1:
            bad[3, 5] = float("nan")
        with pytest.raises(RoutingError, match=f"rank {ranks.world_size - 1}: router produced NaN"):
            graphed(bad)
            check_routing()
        y = graphed(x)
    assert torch.isfinite(y).all()


def test_wrong_hidden_size_raises_on_every_rank_with_graphs(ranks):
    graphed, _ = _layers(ranks, "device", torch.bfloat16, 24)
    x = torch.randn(32, HIDDEN, dtype=torch.bfloat16, device=ranks.device)
    with torch.no_grad():
        for _ in range(EAGER_CALLS + 1):
            graphed(x)
        wrong = torch.randn(32, HIDDEN + 1 if ranks.rank == 0 else HIDDEN, dtype=torch.bfloat16, device=ranks.device)
        expected = (ValueError, "hidden size") if ranks.rank == 0 else (RoutingError, "rank 0: input hidden size")
        with pytest.raises(expected[0], match=expected[1]):
            graphed(wrong)
        assert torch.isfinite(graphed(x)).all()


def test_autograd_calls_run_eagerly_and_match(ranks):
    """Under autograd the layer runs eagerly (graphs are for inference): gradients as the count exchange's."""
    graphed, eager = _layers(ranks, "device", torch.bfloat16, 25)
    x = torch.randn(80 + 3 * ranks.rank, HIDDEN, dtype=torch.bfloat16, device=ranks.device)
    grads = []
    for layer in (graphed, eager):
        xi = x.clone().requires_grad_()
        layer(xi).float().sum().backward()
        grads.append(xi.grad)
    assert len(graphed.graphs) == 0
    assert ranks.all_max(_rel(grads[0], grads[1])) <= TOL_VS_EAGER[torch.bfloat16]


def test_converted_model_with_layer_graphs_matches_and_generates_the_same_tokens(ranks):
    """A tiny OLMoE converted over the device transport with `graphs=True`: forwards (replayed from
    the layers' graphs from the third call of a shape on) give the count exchange's logits in fp32,
    with batches that differ between ranks; `hf.generate` (its decode step captured whole, the
    layers running inside that capture) returns the same tokens."""
    pytest.importorskip("transformers")
    import copy

    import numpy as np

    from occult import ExecConfig, Placement
    from occult.integrations import hf

    if ranks.device.type != "cuda" or ranks.backend != "nccl":
        pytest.skip("CUDA graphs of collectives need GPUs with NCCL")
    skip_without_transport(ranks, "device")
    seed, vocab = ranks.seed + 303, 96
    base = hf.tiny_random_model("olmoe", seed=seed, vocab_size=vocab).to(ranks.device, torch.float32).eval()
    E, L = int(hf.moe_blocks(base)[0][1].gate.weight.shape[0]), len(hf.moe_blocks(base))
    rng = np.random.default_rng(seed)
    placement = Placement(
        np.stack([rng.permutation(np.arange(E) % ranks.world_size) for _ in range(L)]), ranks.world_size
    )
    models = {
        name: hf.convert(copy.deepcopy(base), placement=placement, dispatcher="dedup", execution=execution)
        for name, execution in (
            ("graphs", ExecConfig(transport="device", graphs=True)),
            ("counts", ExecConfig(transport="counts")),
        )
    }
    gen = torch.Generator().manual_seed(seed + ranks.rank)
    worst = 0.0
    with torch.no_grad():
        for batch in (2, 2, 2, 2, 3, 2):
            ids = torch.randint(3, vocab, (batch + ranks.rank, 9), generator=gen).to(ranks.device)
            got, ref = (models[n](input_ids=ids, use_cache=False).logits for n in ("graphs", "counts"))
            worst = max(worst, _rel(got, ref))
    layers = [m for m in models["graphs"].modules() if isinstance(m, OccultMoE)]
    assert all(len(layer.graphs) >= 1 for layer in layers)
    prompts = torch.randint(3, vocab, (1 + ranks.rank, 5), generator=gen).to(ranks.device)
    tokens = {
        n: hf.generate(m, prompts, 5, cuda_graph=(n == "graphs"), eos_token_id=[], reuse=False)
        for n, m in models.items()
    }
    same = float(torch.equal(tokens["graphs"], tokens["counts"]))
    assert ranks.all_max(worst) < 1e-5, worst
    assert ranks.all_max(1.0 - same) == 0.0, tokens
