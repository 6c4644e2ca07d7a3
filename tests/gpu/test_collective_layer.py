"""OccultMoE on every GPU of the machine over NCCL, in fp32, bf16 and fp16, against DenseMoE in fp32.

Each rank feeds its own tokens (uneven counts; one case with a rank that has none). The reference
is the plain single-process `DenseMoE` in fp32, holding the same (upcast) weights and taking the
same expert choices as the layer under test: half-precision routing may legitimately break a
near-tie the other way, and that is not an error of the expert-parallel path. Its weights are the
router's fp32 probabilities of those experts, so the comparison measures only what the
dispatchers, the kernels and the half-precision arithmetic add. Reference gradients of the
weights are summed over ranks (every rank's tokens reach every expert); the layer's router
gradient is one rank's contribution, so it is summed too. Errors are relative Frobenius norms.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from occult import DenseMoE, OccultMoE, Placement, RoutingError, check_routing

# Relative error bounds against the fp32 reference. fp32: exact ("ieee") products in the Triton
# kernels; bf16/fp16: the inputs, weights and every intermediate are rounded (8 and 11 bits).
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

HIDDEN, FFN = 512, 256


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of `a` against `b`; inf where `a` is not finite (a NaN would pass `max` and `<=`)."""
    a, b = a.detach().double(), b.detach().double()
    if not torch.isfinite(a).all():
        return float("inf")
    denom = b.norm().item()
    return (a - b).norm().item() / (denom if denom > 0 else 1.0)


class RecordingRouter(nn.Module):
    """Wraps a router; keeps the ids it chose (over all calls since the last `clear`, in call
    order: a two-batch forward calls it once per half) and can return its weights in another dtype."""

    def __init__(self, inner: nn.Module, weights_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.inner, self.weights_dtype, self.parts = inner, weights_dtype, []

    @property
    def ids_TK(self) -> torch.Tensor:
        return torch.cat(self.parts)

    def clear(self) -> None:
        self.parts = []

    def set_expert_device(self, expert_device_E):
        self.inner.set_expert_device(expert_device_E)

    def forward(self, x_TH):
        weights_TK, ids_TK = self.inner(x_TH)
        self.parts.append(ids_TK.detach().clone())
        if self.weights_dtype is not None:
            weights_TK = weights_TK.to(self.weights_dtype)
        return weights_TK, ids_TK


class GivenIdsRouter(nn.Module):
    """fp32 softmax over a gate, gathered at expert ids fixed in advance (the reference's router)."""

    def __init__(self, gate: nn.Linear, ids_TK: torch.Tensor, norm_topk_prob: bool) -> None:
        super().__init__()
        self.gate, self.ids_TK, self.norm_topk_prob = gate, ids_TK, norm_topk_prob

    def forward(self, x_TH):
        scores_TE = torch.softmax(self.gate(x_TH).float(), dim=-1)
        weights_TK = scores_TE.gather(1, self.ids_TK)
        if self.norm_topk_prob:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        return weights_TK, self.ids_TK


def _placement(kind: str, num_experts: int, world_size: int, seed: int) -> Placement:
    if kind == "contiguous":
        return Placement.contiguous(num_experts, world_size)
    rng = np.random.default_rng(seed)
    return Placement(rng.permutation(np.arange(num_experts) % world_size)[None], world_size)


def skip_without_transport(ranks, transport: str) -> None:
    """Skip the device-transport cases where it cannot run (gloo, CPU ranks, ranks on several hosts)."""
    from occult.moe.symm import unavailable_reason

    reason = unavailable_reason(dist.group.WORLD) if transport == "device" else None
    if transport == "host" and (ranks.device.type != "cuda" or ranks.backend != "nccl"):
        reason = "the host transport serves NCCL ranks on CUDA GPUs"
    if reason:
        pytest.skip(f"device transport: {reason}")


def run_case(
    ranks,
    *,
    dtype,
    dispatcher="dedup",
    placement="random",
    experts=None,
    top_k=4,
    tokens=None,
    max_devices=None,
    router_weights_dtype=None,
    norm=False,
    sync_free=False,
    salt=0,
    transport="auto",
    sync_free_capacity=1.0,
) -> dict:
    """One layer forward+backward on every rank; the worst relative errors over all ranks."""
    D, rank, dev = ranks.world_size, ranks.rank, ranks.device
    E = experts or 8 * D
    skip_without_transport(ranks, transport)
    seed = ranks.seed + salt
    torch.manual_seed(seed)  # same weights on every rank
    dense32 = DenseMoE(HIDDEN, FFN, E, top_k, norm_topk_prob=norm, dtype=torch.float32, device=dev)
    with torch.no_grad():  # sharper routing than the default init
        dense32.router.gate.weight.mul_(3.0)
    low = DenseMoE(HIDDEN, FFN, E, top_k, norm_topk_prob=norm, dtype=dtype, device=dev)
    low.load_state_dict({k: v.to(dtype) for k, v in dense32.state_dict().items()})
    with torch.no_grad():  # the reference holds exactly the weights the layer holds
        for p32, p in zip(dense32.parameters(), low.parameters()):
            p32.copy_(p.float())
    layer = OccultMoE.from_dense(
        low,
        placement=_placement(placement, E, D, seed),
        dispatcher=dispatcher,
        max_devices=max_devices,
        sync_free=sync_free,
        transport=transport,
        sync_free_capacity=sync_free_capacity,
    )
    layer.router = RecordingRouter(layer.router, router_weights_dtype)

    counts = tokens if tokens is not None else [384 + 61 * r for r in range(D)]
    gen = torch.Generator(device=dev).manual_seed(seed * 131 + rank)  # each rank its own tokens
    x32 = torch.randn(counts[rank], HIDDEN, device=dev, generator=gen)
    g32 = torch.randn(counts[rank], HIDDEN, device=dev, generator=gen)

    x = x32.to(dtype).requires_grad_()
    y = layer(x)
    (y.float() * g32).sum().backward()

    dense32.router = GivenIdsRouter(dense32.router.gate, layer.router.ids_TK, norm)
    x_ref = x.detach().float().requires_grad_()
    y_ref = dense32(x_ref)
    if y_ref.requires_grad:  # a rank without tokens reaches no weight (its reference has no graph)
        (y_ref * g32).sum().backward()

    def grad_or_zero(p):
        return p.grad if p.grad is not None else torch.zeros_like(p)

    ref_grads = [grad_or_zero(p).float() for p in (dense32.router.gate.weight, dense32.gate_up_proj, dense32.down_proj)]
    router_grad = grad_or_zero(layer.router.inner.gate.weight).float()
    for t in (*ref_grads, router_grad):
        dist.all_reduce(t)
    local = layer.local_expert_ids
    errors = {
        "y": _rel(y, y_ref) if counts[rank] else 0.0,
        "dx": _rel(x.grad, x_ref.grad) if counts[rank] else float(x.grad is None or x.grad.numel() != 0),
        "d_router": _rel(router_grad, ref_grads[0]),
        "d_gate_up": _rel(grad_or_zero(layer.gate_up_proj), ref_grads[1][local]),
        "d_down": _rel(grad_or_zero(layer.down_proj), ref_grads[2][local]),
    }
    finite = all(torch.isfinite(t).all().item() for t in (y, grad_or_zero(layer.gate_up_proj)))
    errors["nonfinite"] = 0.0 if finite else 1.0
    if max_devices is not None and counts[rank]:
        dev_of = layer.expert_device_E[layer.router.ids_TK]
        per_token = torch.stack([(dev_of == d).any(dim=1) for d in range(D)], dim=1).sum(dim=1)
        errors["devices_over_limit"] = float((per_token > max_devices).sum().item())
    return {k: ranks.all_max(v) for k, v in errors.items()}


def _assert_within(errors: dict, tol: float, where: str) -> None:
    assert errors.get("nonfinite", 0.0) == 0.0, (where, errors)
    assert errors.get("devices_over_limit", 0.0) == 0.0, (where, errors)
    worst = {k: v for k, v in errors.items() if k not in ("nonfinite", "devices_over_limit")}
    assert max(worst.values()) <= tol, (where, f"tolerance {tol:g}", worst)


@pytest.mark.parametrize("transport", ["device", "counts", "host"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("placement", ["contiguous", "random"])
@pytest.mark.parametrize("dispatcher", ["standard", "dedup"])
def test_layer_matches_fp32_reference(ranks, dispatcher, placement, dtype_name, transport):
    """Every transport (the device transport where it runs: NCCL ranks of one host; the count exchange; the host
    transport: NCCL ranks of one host, rows through shared pinned host memory)."""
    dtype = DTYPES[dtype_name]
    errors = run_case(ranks, dtype=dtype, dispatcher=dispatcher, placement=placement, salt=1, transport=transport)
    _assert_within(errors, TOL[dtype], f"{dispatcher}/{placement}/{dtype_name}/{transport} seed {ranks.seed}")


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("max_devices", [1, 2])
def test_pruned_layer_matches_fp32_reference(ranks, max_devices, dtype_name):
    dtype = DTYPES[dtype_name]
    errors = run_case(ranks, dtype=dtype, max_devices=max_devices, top_k=6, salt=2)
    _assert_within(errors, TOL[dtype], f"max_devices={max_devices}/{dtype_name} seed {ranks.seed}")


@pytest.mark.parametrize("dtype_name", ["bf16", "fp16"])
@pytest.mark.parametrize("dispatcher", ["standard", "dedup"])
def test_router_returning_half_precision_weights(ranks, dispatcher, dtype_name):
    """The crash of issue 13: a router (like transformers') that returns bf16/fp16 gate weights."""
    dtype = DTYPES[dtype_name]
    errors = run_case(ranks, dtype=dtype, dispatcher=dispatcher, router_weights_dtype=dtype, norm=True, salt=3)
    _assert_within(errors, TOL[dtype], f"half-precision router weights, {dispatcher}/{dtype_name}")


@pytest.mark.parametrize("transport", ["device", "counts", "host"])
@pytest.mark.parametrize("dispatcher", ["standard", "dedup"])
def test_rank_with_no_tokens(ranks, dispatcher, transport):
    tokens = [0 if r == 1 else 300 + 17 * r for r in range(ranks.world_size)]
    errors = run_case(ranks, dtype=torch.bfloat16, dispatcher=dispatcher, tokens=tokens, salt=4, transport=transport)
    _assert_within(errors, TOL[torch.bfloat16], f"rank 1 without tokens, {dispatcher}")


@pytest.mark.parametrize("top_k", ["one", "all"])
def test_top1_and_topk_all(ranks, top_k):
    E = 2 * ranks.world_size
    k = 1 if top_k == "one" else E
    errors = run_case(ranks, dtype=torch.bfloat16, experts=E, top_k=k, salt=5)
    _assert_within(errors, TOL[torch.bfloat16], f"top_k={k} of {E}")


@pytest.mark.parametrize("transport", ["counts", "host"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("dispatcher", ["standard", "dedup"])
def test_sync_free_layer_matches_fp32_reference(ranks, dispatcher, dtype_name, transport):
    """Fixed-capacity (sync-free) dispatch: same function, forward and backward (over NCCL, and through host memory)."""
    dtype = DTYPES[dtype_name]
    tokens = [96] * ranks.world_size
    errors = run_case(
        ranks, dtype=dtype, dispatcher=dispatcher, tokens=tokens, sync_free=True, salt=8, transport=transport
    )
    _assert_within(errors, TOL[dtype], f"sync-free {dispatcher}/{dtype_name}")


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_bounded_sync_free_layer_matches_fp32_reference(ranks, dtype_name):
    """Sync-free blocks for the other ranks bounded to 0.75 T rows (`sync_free_capacity`): top-1 sends about
    T/D rows to each other rank, so every copy fits; the same function, forward and backward, nothing reported."""
    dtype = DTYPES[dtype_name]
    tokens = [128] * ranks.world_size
    errors = run_case(ranks, dtype=dtype, tokens=tokens, top_k=1, sync_free=True, sync_free_capacity=0.75, salt=10)
    check_routing()
    _assert_within(errors, TOL[dtype], f"bounded sync-free/{dtype_name}")


def test_bounded_sync_free_drops_are_reported_after_a_replay(ranks):
    """Blocks too small for the routing, the layer's forward replayed from its CUDA graphs: `check_routing()`
    raises on every rank (here each dropped copies), names `sync_free_capacity`; then the group works on."""
    if ranks.device.type != "cuda" or ranks.backend != "nccl":
        pytest.skip("CUDA-graph capture of collectives needs GPUs with NCCL")
    torch.manual_seed(ranks.seed + 11)
    E, T = 8 * ranks.world_size, 64
    dense = DenseMoE(HIDDEN, FFN, E, 4, dtype=torch.bfloat16, device=ranks.device)
    layer = OccultMoE.from_dense(dense, sync_free=True, sync_free_capacity=0.05, graphs=True)
    x = torch.randn(T, HIDDEN, dtype=torch.bfloat16, device=ranks.device)
    raised = []
    with torch.no_grad():
        for _ in range(3):  # eager warm-up, capture, replay (occult.moe.graphs)
            layer(x)
            try:
                check_routing()
            except RoutingError as e:
                raised.append(str(e))
    assert raised and all("sync_free_capacity" in r and f"rank {ranks.rank}" in r for r in raised), raised
    layer.execution = type(layer.execution)(sync_free=True, graphs=True)  # capacity 1.0: every routing fits
    with torch.no_grad():
        y = layer(x)
    check_routing()
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "replayed"])
def test_a_drop_on_one_rank_is_reported_on_every_rank(ranks, graphs):
    """Only rank 0 drops copies (its tokens all choose rank 1's experts; the others' their own): every rank's
    `check_routing()` raises after the call, naming rank 0 alone (the blocks' header rows carry it), eager and
    replayed from the layer's CUDA graphs (eager also over gloo: GPUs shared, or CPU ranks)."""
    if graphs and (ranks.device.type != "cuda" or ranks.backend != "nccl"):
        pytest.skip("CUDA-graph capture of collectives needs GPUs with NCCL")
    torch.manual_seed(ranks.seed + 12)
    E, T, H = 2 * ranks.world_size, 64, 64
    dense = DenseMoE(H, FFN, E, 2, dtype=torch.bfloat16, device=ranks.device)
    with torch.no_grad():
        dense.router.gate.weight.copy_(torch.eye(E, H, dtype=torch.bfloat16, device=ranks.device) * 10)
    layer = OccultMoE.from_dense(dense, sync_free=True, sync_free_capacity=0.1, graphs=graphs)
    x = torch.randn(T, H, dtype=torch.bfloat16, device=ranks.device) * 0.1
    mine = 1 if ranks.rank == 0 else ranks.rank  # (experts 2r and 2r + 1 on rank r)
    x[:, [2 * mine, 2 * mine + 1]] += 1.0
    raised = []
    with torch.no_grad():
        for _ in range(3 if graphs else 1):  # eager warm-up, capture, replay (occult.moe.graphs)
            layer(x)
            try:
                check_routing()
            except RoutingError as e:
                raised.append(str(e))
    assert raised and all("rank 0:" in r and "rank 1:" not in r for r in raised), raised


@pytest.mark.parametrize("dispatcher", ["standard", "dedup"])
@pytest.mark.parametrize("transport", ["sync_free", "device", "host"])
def test_forward_replays_in_a_cuda_graph(ranks, dispatcher, transport):
    """A forward with no host wait (the sync-free schedule over NCCL or through host memory, or the device
    transport) captured once in a CUDA graph gives, on fresh inputs, what an eager call gives; with the device
    transport, eager calls of other sizes between replays (its buffers grow) leave the graph intact; with the host
    transport, eager exchanges of other sizes between replays walk the same slots on."""
    if ranks.device.type != "cuda" or ranks.backend != "nccl":
        pytest.skip("CUDA-graph capture of collectives needs GPUs with NCCL")
    if transport == "device":
        skip_without_transport(ranks, "device")
    torch.manual_seed(ranks.seed + 9)
    E, T = 8 * ranks.world_size, 64
    dense = DenseMoE(HIDDEN, FFN, E, 8, dtype=torch.bfloat16, device=ranks.device)
    with torch.no_grad():
        dense.router.gate.weight.mul_(3.0)
    sync_free = transport in ("sync_free", "host")
    layer = OccultMoE.from_dense(
        dense,
        placement=_placement("random", E, ranks.world_size, ranks.seed),
        dispatcher=dispatcher,
        sync_free=sync_free,
        transport={"sync_free": "counts"}.get(transport, transport),
    )
    counts_layer = OccultMoE.from_dense(
        dense,
        placement=_placement("random", E, ranks.world_size, ranks.seed),
        dispatcher=dispatcher,
        transport="counts",
    )
    gen = torch.Generator(device=ranks.device).manual_seed(ranks.seed * 7 + ranks.rank)
    static_x = torch.randn(T, HIDDEN, dtype=torch.bfloat16, device=ranks.device, generator=gen)
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                layer(static_x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = layer(static_x)
        worst = 0.0
        for step in range(3):
            fresh = torch.randn(T, HIDDEN, dtype=torch.bfloat16, device=ranks.device, generator=gen)
            static_x.copy_(fresh)
            graph.replay()
            layer.sync_free = False
            expected = layer(fresh)
            layer.sync_free = sync_free
            worst = max(worst, _rel(static_y, expected))
            if transport != "sync_free":  # an eager call 64x larger: the device transport's buffers grow under the
                # graph; the host transport's exchanges cut it in chunks through the slots the graph walks too
                big = torch.randn(T * 64 * (step + 1), HIDDEN, dtype=torch.bfloat16, device=ranks.device)
                worst = max(worst, _rel(layer(big), counts_layer(big)))  # (the call that grows them too)
        graph.reset()
    assert ranks.all_max(worst) < 1e-2, worst


@pytest.mark.parametrize("transport", ["device", "counts", "host"])
def test_nan_input_raises_on_every_rank_and_the_group_survives(ranks, transport):
    """NaN activations on one rank: every rank raises the same clear error, then works on. The
    count exchange raises in the call; the device transport (no host wait) at the latest in
    `check_routing()` (a converted model calls it after every forward), on every rank."""
    torch.manual_seed(ranks.seed + 6)
    dense = DenseMoE(HIDDEN, FFN, 8 * ranks.world_size, 4, dtype=torch.bfloat16, device=ranks.device)
    skip_without_transport(ranks, transport)
    layer = OccultMoE.from_dense(dense, transport=transport)
    x = torch.randn(64, HIDDEN, dtype=torch.bfloat16, device=ranks.device)
    bad = x.clone()
    if ranks.rank == ranks.world_size - 1:
        bad[3, 5] = float("nan")
    with pytest.raises(RoutingError, match=f"rank {ranks.world_size - 1}: router produced NaN"):
        layer(bad)
        check_routing()
    y = layer(x)  # the same group still works after the error
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("transport", ["device", "counts", "host"])
def test_wrong_hidden_size_raises_on_every_rank(ranks, transport):
    torch.manual_seed(ranks.seed + 7)
    dense = DenseMoE(HIDDEN, FFN, 8 * ranks.world_size, 4, dtype=torch.bfloat16, device=ranks.device)
    skip_without_transport(ranks, transport)
    layer = OccultMoE.from_dense(dense, transport=transport)
    width = HIDDEN + 1 if ranks.rank == 0 else HIDDEN
    x = torch.randn(32, width, dtype=torch.bfloat16, device=ranks.device)
    if ranks.rank == 0:
        with pytest.raises(ValueError, match=f"hidden size {HIDDEN + 1} but this MoE layer expects {HIDDEN}"):
            layer(x)
    else:
        with pytest.raises(RoutingError, match="rank 0: input hidden size does not match"):
            layer(x)
    y = layer(torch.randn(32, HIDDEN, dtype=torch.bfloat16, device=ranks.device))
    assert torch.isfinite(y).all()


def test_device_transport_has_no_host_wait(ranks):
    """Over NCCL the device transport runs a forward and backward
    with no device-to-host synchronisation (CUDA's sync debug mode raises on any), also when the
    buffers grow and the ranks' token counts differ; the same result as the count exchange."""
    skip_without_transport(ranks, "device")
    torch.manual_seed(ranks.seed + 13)
    E = 8 * ranks.world_size
    dense = DenseMoE(HIDDEN, FFN, E, 4, dtype=torch.bfloat16, device=ranks.device)
    device = OccultMoE.from_dense(
        dense, placement=_placement("random", E, ranks.world_size, ranks.seed), transport="device"
    )
    counts = OccultMoE.from_dense(
        dense, placement=_placement("random", E, ranks.world_size, ranks.seed), transport="counts"
    )
    assert "transport=device" in repr(device) and "transport=counts" in repr(counts), repr(device)
    worst = 0.0
    for tokens in (64 + 9 * ranks.rank, 3000 + 77 * ranks.rank):  # the second call grows the buffers
        x = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16, device=ranks.device).requires_grad_()
        device(x).float().sum().backward()  # warm: kernels compile, buffers are allocated
        torch.cuda.synchronize()
        x.grad = None
        torch.cuda.set_sync_debug_mode("error")
        try:
            y = device(x)
            y.float().sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        x2 = x.detach().clone().requires_grad_()
        y2 = counts(x2)
        y2.float().sum().backward()
        worst = max(worst, _rel(y, y2), _rel(x.grad, x2.grad))
        assert device.last_comm_stats.forward_rows == counts.last_comm_stats.forward_rows
        assert device.last_comm_stats.backward_rows == counts.last_comm_stats.backward_rows
    check_routing()
    assert ranks.all_max(worst) < 1e-2, worst
