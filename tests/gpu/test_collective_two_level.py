"""Two-level dispatch ("dedup2") on 4 GPUs as 2 nodes x 2 over NCCL, against DenseMoE in fp32.

Runs under torchrun with the rest of the collective suite (`bash tests/gpu/run.sh`) and only at
world size 4 (skipped otherwise): ranks 0-1 play node 0, ranks 2-3 node 1. NCCL between GPUs of
one host is not a real inter-node link, so this checks correctness (outputs, gradients, the
rows per link) over NCCL and the Triton kernels, not speed. The reference is the plain fp32
`DenseMoE` holding exactly the layer's (rounded) weights and taking the layer's expert choices,
as in `test_collective_layer.py`. With `OCCULT_GPU_SUITE_ON_CPU=1 OCCULT_GPU_SUITE_NPROC=4` it
runs on 4 CPU gloo ranks at a small shape (a check of the test's logic, not of NCCL).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from occult import DenseMoE, OccultMoE, Placement, RoutingError
from occult.moe.two_level import TwoLevelDispatcher

ON_CPU = os.environ.get("OCCULT_GPU_SUITE_ON_CPU", "0") == "1"
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HIDDEN, FFN = (64, 32) if ON_CPU else (512, 256)
NODES, WORLD = 2, 4


@pytest.fixture
def ranks2x2(ranks):
    if ranks.world_size != WORLD:
        pytest.skip(f"two-level tests simulate 2 nodes x 2 GPUs: need exactly {WORLD} ranks, have {ranks.world_size}")
    return ranks


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    denom = b.norm().item()
    return (a - b).norm().item() / (denom if denom > 0 else 1.0)


class RecordingRouter(nn.Module):
    """Wraps a router; keeps the ids it chose and can return its weights in another dtype."""

    def __init__(self, inner: nn.Module, weights_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.inner, self.weights_dtype, self.ids_TK = inner, weights_dtype, None

    def forward(self, x_TH):
        weights_TK, ids_TK = self.inner(x_TH)
        self.ids_TK = ids_TK.detach().clone()
        return (weights_TK if self.weights_dtype is None else weights_TK.to(self.weights_dtype)), ids_TK


class GivenIdsRouter(nn.Module):
    """fp32 softmax over a gate, gathered at expert ids fixed in advance (the reference's router)."""

    def __init__(self, gate: nn.Linear, ids_TK: torch.Tensor, norm_topk_prob: bool) -> None:
        super().__init__()
        self.gate, self.ids_TK, self.norm_topk_prob = gate, ids_TK, norm_topk_prob

    def forward(self, x_TH):
        weights_TK = torch.softmax(self.gate(x_TH).float(), dim=-1).gather(1, self.ids_TK)
        if self.norm_topk_prob:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        return weights_TK, self.ids_TK


def _placement(kind: str, num_experts: int, seed: int) -> Placement:
    rng = np.random.default_rng(seed)
    if kind == "contiguous":
        return Placement.contiguous(num_experts, WORLD, num_nodes=NODES)
    if kind == "random":
        return Placement(rng.permutation(np.arange(num_experts) % WORLD)[None], WORLD, NODES)
    from occult.placement.solvers import place  # hierarchical: experts -> nodes -> GPUs on a planted trace
    from occult.placement.synthetic import planted_nodes_trace

    trace = planted_nodes_trace(4000, num_experts, 4, num_nodes=NODES, groups_per_node=2, seed=seed)
    return place(trace.trace, WORLD, "greedy", num_nodes=NODES).placement


def run_case(
    ranks,
    *,
    dtype,
    placement="random",
    experts=32,
    top_k=4,
    tokens=None,
    router_weights_dtype=None,
    norm=False,
    sync_free=False,
    explicit=False,
    salt=0,
) -> dict:
    """One dedup2 layer forward+backward on every rank; the worst relative errors over all ranks."""
    rank, dev, seed = ranks.rank, ranks.device, ranks.seed + salt
    torch.manual_seed(seed)
    dense32 = DenseMoE(HIDDEN, FFN, experts, top_k, norm_topk_prob=norm, dtype=torch.float32, device=dev)
    with torch.no_grad():
        dense32.router.gate.weight.mul_(3.0)
    low = DenseMoE(HIDDEN, FFN, experts, top_k, norm_topk_prob=norm, dtype=dtype, device=dev)
    low.load_state_dict({k: v.to(dtype) for k, v in dense32.state_dict().items()})
    with torch.no_grad():
        for p32, p in zip(dense32.parameters(), low.parameters()):
            p32.copy_(p.float())
    placed = _placement(placement, experts, seed)
    if explicit:  # a flat placement, the node layout given to the dispatcher itself
        placed = Placement(placed.expert_device_LE, WORLD)
    dispatcher = TwoLevelDispatcher(devices_per_node=WORLD // NODES) if explicit else "dedup2"
    layer = OccultMoE.from_dense(low, placement=placed, dispatcher=dispatcher, sync_free=sync_free)
    assert layer.dispatcher.name == "dedup2" and layer.dispatcher.devices_per_node == 2
    layer.router = RecordingRouter(layer.router, router_weights_dtype)

    scale = 8 if ON_CPU else 1
    counts = tokens if tokens is not None else [(384 + 61 * r) // scale for r in range(WORLD)]
    gen = torch.Generator(device=dev).manual_seed(seed * 131 + rank)
    x32 = torch.randn(counts[rank], HIDDEN, device=dev, generator=gen)
    g32 = torch.randn(counts[rank], HIDDEN, device=dev, generator=gen)
    x = x32.to(dtype).requires_grad_()
    y = layer(x)
    (y.float() * g32).sum().backward()

    dense32.router = GivenIdsRouter(dense32.router.gate, layer.router.ids_TK, norm)
    x_ref = x.detach().float().requires_grad_()
    y_ref = dense32(x_ref)
    if y_ref.requires_grad:
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
        "dx": _rel(x.grad, x_ref.grad) if counts[rank] else 0.0,
        "d_router": _rel(router_grad, ref_grads[0]),
        "d_gate_up": _rel(grad_or_zero(layer.gate_up_proj), ref_grads[1][local]),
        "d_down": _rel(grad_or_zero(layer.down_proj), ref_grads[2][local]),
        "nonfinite": 0.0 if torch.isfinite(y).all().item() else 1.0,
    }
    # Rows across nodes: one per (token, remote node) each way (sync-free: T per remote node).
    node_of = layer.expert_device_E[layer.router.ids_TK] // 2
    touched = torch.stack([(node_of == n).any(dim=1) for n in range(NODES)], dim=1)
    remote = int(touched.sum().item()) - int(touched[:, rank // 2].sum().item())
    if sync_free:
        remote = counts[rank] * (NODES - 1)
    stats = layer.last_comm_stats
    totals = torch.tensor([remote, stats.forward_internode_rows, stats.backward_internode_rows], device=dev)
    dist.all_reduce(totals)
    errors["internode_rows_off"] = float(
        abs(totals[1].item() - 2 * totals[0].item()) + abs(totals[2] - totals[1]).item()
    )
    return {k: ranks.all_max(v) for k, v in errors.items()}


def _assert_within(errors: dict, tol: float, where: str) -> None:
    assert errors.pop("nonfinite") == 0.0, (where, errors)
    assert errors.pop("internode_rows_off") == 0.0, (where, "inter-node rows != 2 x (token, remote node) pairs")
    assert max(errors.values()) <= tol, (where, f"tolerance {tol:g}", errors)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("placement", ["contiguous", "random", "hierarchical"])
def test_two_level_matches_fp32_reference(ranks2x2, placement, dtype_name):
    dtype = DTYPES[dtype_name]
    errors = run_case(ranks2x2, dtype=dtype, placement=placement, salt=21)
    _assert_within(errors, TOL[dtype], f"dedup2/{placement}/{dtype_name} seed {ranks2x2.seed}")


@pytest.mark.parametrize(
    "case", ["empty_rank", "empty_node", "top1", "topk_all", "sync_free", "half_router", "explicit"]
)
def test_two_level_edge_cases(ranks2x2, case):
    dtype = torch.bfloat16
    kw = {
        "empty_rank": dict(tokens=[0, 40, 33, 17]),
        "empty_node": dict(tokens=[0, 0, 33, 17]),
        "top1": dict(top_k=1, experts=8),
        "topk_all": dict(top_k=8, experts=8),
        "sync_free": dict(tokens=[48] * WORLD, sync_free=True),
        "half_router": dict(router_weights_dtype=dtype, norm=True),
        "explicit": dict(explicit=True),
    }[case]
    errors = run_case(ranks2x2, dtype=dtype, salt=22, **kw)
    _assert_within(errors, TOL[dtype], f"dedup2 {case} seed {ranks2x2.seed}")


def test_two_level_nan_input_raises_on_every_rank(ranks2x2):
    torch.manual_seed(ranks2x2.seed + 23)
    dense = DenseMoE(HIDDEN, FFN, 16, 4, dtype=torch.bfloat16, device=ranks2x2.device)
    layer = OccultMoE.from_dense(dense, placement=Placement.contiguous(16, WORLD, num_nodes=NODES), dispatcher="dedup2")
    x = torch.randn(64, HIDDEN, dtype=torch.bfloat16, device=ranks2x2.device)
    bad = x.clone()
    if ranks2x2.rank == 2:
        bad[3, 5] = float("nan")
    with pytest.raises(RoutingError, match="rank 2: router produced NaN"):
        layer(bad)
    assert torch.isfinite(layer(x)).all()
