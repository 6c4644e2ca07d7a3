"""The one-rank schedule (`occult.moe.local`): an identity with no host wait, still exact and
still reporting bad input.

Exactness of every dispatcher and schedule on one rank (outputs and gradients against
`DenseMoE`, edge cases, CommStats) is in tests/moe/test_layer.py::test_single_process_matches_dense;
here: that one rank really takes the identity (no count exchange, no plan), that bad input still
raises (at once on CPU; one layer later on CUDA, tests/gpu/test_local_gpu.py), and the deferred
check's bookkeeping.
"""

from __future__ import annotations

import random

import pytest
import torch

from occult import DenseMoE, OccultMoE, RoutingError, check_routing
from occult.moe import counts, dispatch, status


def _no_host_wait(*args, **kwargs):
    raise AssertionError("a one-rank dispatch must not plan rows or exchange counts")


@pytest.mark.parametrize("dispatcher", ["dedup", "standard"])
def test_one_rank_takes_the_identity_and_matches_dense(monkeypatch, dispatcher):
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    T, H, F, E, K = random.randrange(1, 40), 16, 12, 8, random.randrange(1, 9)
    dense = DenseMoE(H, F, E, K, norm_topk_prob=bool(seed % 2), dtype=torch.float64)
    layer = OccultMoE.from_dense(dense, dispatcher=dispatcher)
    monkeypatch.setattr(dispatch, "exchange_counts", _no_host_wait)
    monkeypatch.setattr(dispatch.FlatDispatcher, "plan_rows", _no_host_wait)
    x = torch.randn(T, H, dtype=torch.float64)
    g = torch.randn(T, H, dtype=torch.float64)
    x_ref = x.clone().requires_grad_()
    y_ref = dense(x_ref)
    (y_ref * g).sum().backward()
    x_occ = x.clone().requires_grad_()
    y = layer(x_occ)
    (y * g).sum().backward()
    assert torch.allclose(y, y_ref, rtol=1e-10, atol=1e-12), seed
    assert torch.allclose(x_occ.grad, x_ref.grad, rtol=1e-10, atol=1e-12), seed
    assert torch.allclose(layer.router.gate.weight.grad, dense.router.gate.weight.grad, rtol=1e-10, atol=1e-12), seed
    assert torch.allclose(layer.gate_up_proj.grad, dense.gate_up_proj.grad, rtol=1e-10, atol=1e-12), seed
    assert torch.allclose(layer.down_proj.grad, dense.down_proj.grad, rtol=1e-10, atol=1e-12), seed
    stats = layer.last_comm_stats
    rows = T if dispatcher == "dedup" else T * K
    assert stats.dispatch_rows == stats.combine_rows == rows
    assert stats.forward_rows == stats.backward_rows == 2 * rows
    assert stats.forward_remote_rows == stats.backward_remote_rows == 0
    assert stats.forward_bytes == stats.backward_bytes == 2 * rows * H * 8


def test_one_rank_bad_input_raises_and_the_layer_still_works():
    layer = OccultMoE(8, 4, 8, 2, dtype=torch.float64)
    x = torch.randn(6, 8, dtype=torch.float64)
    x[2, 3] = float("nan")
    with pytest.raises(RoutingError, match="rank 0: router produced NaN"):
        layer(x)
    with pytest.raises(ValueError, match="hidden size 7"):
        layer(torch.randn(6, 7, dtype=torch.float64))
    assert layer(torch.randn(5, 8, dtype=torch.float64)).shape == (5, 8)
    with torch.no_grad():  # ids out of range from a custom router
        layer.router = _OutOfRange(layer.router)
        with pytest.raises(RoutingError, match="expert ids out of range"):
            layer(torch.randn(5, 8, dtype=torch.float64))


class _OutOfRange(torch.nn.Module):
    def __init__(self, router):
        super().__init__()
        self.inner = router

    def forward(self, x):
        weights, ids = self.inner(x)
        return weights, ids + 100


def test_deferred_statuses_are_read_by_check_routing(monkeypatch):
    """The bookkeeping of the CUDA path, with host tensors standing in for the pinned copies."""
    monkeypatch.setattr(status, "_PENDING", [])
    status._PENDING.extend([(torch.tensor([0]), None), (torch.tensor([counts.STATUS_WRONG_HIDDEN - 2]), None)])
    with pytest.raises(RoutingError, match="NaN"):
        check_routing()
    assert status._PENDING == []  # read once: the next check has nothing left
    check_routing()


@pytest.mark.parametrize("bad", [False, True])
def test_a_compiled_graph_queues_the_status_as_an_eager_call_does(monkeypatch, bad):
    """Traced by torch.compile (one whole graph: `fullgraph=True`), `status.queue` with a sink becomes the op
    `occult::queue_routing_status`, which reads the previous status and queues this one when the graph
    runs: a bad status raises from the compiled call as from an eager one, and the sink holds it."""
    monkeypatch.setattr(status, "_PENDING", [])
    value = counts.STATUS_WRONG_HIDDEN - 2 if bad else 0  # NaN gates, or none bad

    def step(x_T: torch.Tensor, sink_1: torch.Tensor) -> torch.Tensor:
        status.queue((x_T[:1] * 0).long() + value, sink_1)
        return x_T * 2

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    sink_1 = torch.full((1,), -1, dtype=torch.int64)
    x_T = torch.randn(random.randrange(1, 9))
    if bad:
        with pytest.raises(RoutingError, match="NaN"):
            compiled(x_T, sink_1)
        return
    assert torch.equal(compiled(x_T, sink_1), x_T * 2)
    assert sink_1.tolist() == [0]
    status._PENDING.append((torch.tensor([counts.STATUS_WRONG_HIDDEN - 2]), None))  # an earlier call's, bad
    with pytest.raises(RoutingError, match="NaN"):  # read by the next compiled call, as an eager one reads it
        compiled(x_T, sink_1)


def test_a_traced_status_without_a_sink_is_not_queued(monkeypatch):
    monkeypatch.setattr(status, "_PENDING", [])
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: (status.queue(x[:1].long() * 0 + 5), x + 1)[1], fullgraph=True, backend="eager")
    assert torch.equal(compiled(torch.zeros(3)), torch.ones(3))
    assert status._PENDING == []


def one_launch_worker(rank: int, world: int, seed: int, dispatcher: str) -> dict:
    """One rank, OCCULT_PLAN=triton under Triton's interpreter: the slots and the routing status come
    from one launch (`occult.moe.plan.routed_slots`); the layer still equals `DenseMoE`, and NaN gates
    still raise (on CPU at the next one-rank call's check, or `check_routing()`)."""
    from occult.moe.plan import routed_slots

    torch.manual_seed(seed)
    T, H, E, K = 1 + seed % 37, 16, 8, 1 + seed % 8
    dense = DenseMoE(H, 12, E, K, dtype=torch.float32)
    layer = OccultMoE.from_dense(dense, dispatcher=dispatcher)
    x = torch.randn(T, H)
    g = torch.randn(T, H)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    for model, xi in zip((layer, dense), xs):
        (model(xi) * g).sum().backward()
    out = {
        "routed": routed_slots(torch.zeros(2, K, dtype=torch.int64), torch.ones(2, K), layer.expert_slot_E) is not None,
        "y": float((layer(x) - dense(x)).abs().max()),
        "dx": float((xs[0].grad - xs[1].grad).abs().max()),
    }
    bad = x.clone()
    bad[0, 0] = float("nan")
    try:
        layer(bad)
        check_routing()
        out["nan"] = "no error"
    except RoutingError as exc:
        out["nan"] = str(exc)
    return out


@pytest.mark.parametrize("dispatcher", ["dedup", "standard"])
def test_one_rank_one_launch_slots_and_status(monkeypatch, dispatcher):
    from occult.distributed import run_ranks

    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("OCCULT_PLAN", "triton")
    out = run_ranks(one_launch_worker, 1, random.randrange(2**31), dispatcher, timeout_s=300)[0]
    assert out["routed"] and out["y"] < 1e-5 and out["dx"] < 1e-5, out
    assert "router produced NaN" in out["nan"], out


@pytest.mark.parametrize("dispatcher", ["dedup", "standard"])
def test_one_rank_rows_reach_the_experts_as_dense(monkeypatch, dispatcher):
    # one rank: every slot is a local expert, so the experts may keep buffers sized by R*K (kernels' gemm1);
    # an expert-parallel dispatch's rows are padded and are never marked dense (Received's default)
    from occult.moe import experts
    from occult.moe.contract import Received

    seen = []
    real = experts.expert_mlp
    monkeypatch.setattr(experts, "expert_mlp", lambda *a, **kw: seen.append(kw["dense"]) or real(*a, **kw))
    layer = OccultMoE(16, 8, 6, random.randrange(1, 7), dispatcher=dispatcher, dtype=torch.float64)
    layer(torch.randn(random.randrange(1, 30), 16, dtype=torch.float64))
    assert seen == [True]
    assert Received(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1)).dense is False
