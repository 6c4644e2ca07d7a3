"""A training step as two interleaved micro-batches (`occult.training.two_batch.interleaved_backward`, issue 53) on
gloo ranks: sync-free expert-parallel layers (dedup over a placement, standard, dedup pruned to one
device per token) between dense layers give the gradients of the two halves' mean loss, as two micro-batches one
after the other do; the forward issues the exchanges interleaved (A's dispatch, B's dispatch, A's combine, B's
combine, ...) and the backward issues them in exactly the reverse order on every rank, whatever order the autograd
engine would pick (the chain of `occult.moe.two_batch`); a rank whose tokens all go elsewhere, top-1 and top-k =
all; what it refuses. (On GPUs, the halves on two streams inside a recorded step: tests/gpu.)"""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch
import torch.nn as nn

from occult.distributed import run_ranks
from occult.kernels import deferred_wgrad
from occult.moe import comm
from occult.moe.config import RoutingConfig
from occult.moe.dense import DenseMoE
from occult.moe.layer import OccultMoE
from occult.placement import Placement
from occult.training.two_batch import check_two_batch, interleaved_backward

WORLD = 2
HIDDEN, FFN, EXPERTS = 16, 12, 8
CASES = {  # name: (dispatcher, top-k, max devices per token)
    "dedup": ("dedup", 3, None),
    "standard": ("standard", 3, None),
    "pruned1": ("dedup", 3, 1),
    "top1": ("dedup", 1, None),
    "topall": ("dedup", EXPERTS, None),
}


def ep_model(case: str, seed: int, world: int) -> nn.Sequential:
    """dense -> MoE -> dense -> MoE (fp64), the MoE layers sync-free and expert-parallel over `world` ranks."""
    dispatcher, top_k, max_devices = CASES[case]
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    placement = Placement(np.stack([rng.permutation(np.arange(EXPERTS) % world) for _ in range(2)]), world)
    blocks: list[nn.Module] = []
    for i in range(2):
        blocks.append(nn.Linear(HIDDEN, HIDDEN, dtype=torch.float64))
        dense = DenseMoE(HIDDEN, FFN, EXPERTS, top_k, dtype=torch.float64)
        layer = OccultMoE.from_dense(
            dense,
            placement=placement,
            layer_index=i,
            dispatcher=dispatcher,
            routing=RoutingConfig(max_devices=max_devices),
        )
        layer.sync_free = True
        blocks.append(layer)
    return nn.Sequential(*blocks)


class _Log:
    """Which half issued each `_Exchange` forward, and which exchange (its forward's index) each backward was, in
    call order, while entered."""

    def __enter__(self) -> _Log:
        self.forward: list[str] = []
        self.backward: list[int] = []
        self._saved = forward, backward = comm._Exchange.forward, comm._Exchange.backward

        def logged_forward(ctx, *args):
            ctx.logged_index = len(self.forward)
            self.forward.append(threading.current_thread().name[-1])
            return forward(ctx, *args)

        def logged_backward(ctx, *grads):
            self.backward.append(ctx.logged_index)
            return backward(ctx, *grads)

        comm._Exchange.forward, comm._Exchange.backward = staticmethod(logged_forward), staticmethod(logged_backward)
        return self

    def __exit__(self, *exc) -> None:
        comm._Exchange.forward, comm._Exchange.backward = (staticmethod(f) for f in self._saved)


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _worker(rank: int, world: int, seed: int, tokens: int) -> dict:
    out = {}
    for case in CASES:
        model = ep_model(case, seed, world)
        gen = torch.Generator().manual_seed(seed * 7 + rank)
        x = torch.randn(2 * tokens, HIDDEN, dtype=torch.float64, generator=gen)
        if case == "top1" and rank == 1:  # every token of this rank routed to the other rank's experts
            x = x * 0
        w = torch.randn(2 * tokens, HIDDEN, dtype=torch.float64, generator=gen)
        halves, weights = x.chunk(2), w.chunk(2)

        def loss_of(half: torch.Tensor, halves=halves, weights=weights, model=model) -> torch.Tensor:
            i = 0 if half is halves[0] else 1
            return (model(half) * weights[i]).sum() / half.shape[0]

        for half in halves:  # the reference: two micro-batches one after the other, the mean of their losses
            (loss_of(half) / 2).backward()
        want = grads_of(model)
        model.zero_grad(set_to_none=True)
        with _Log() as log:
            loss = interleaved_backward(model, loss_of, halves)
        got = grads_of(model)
        errors = {k: float((got[k] - v).abs().max() / v.abs().max().clamp_min(1e-300)) for k, v in want.items()}
        out[case] = {
            "missing": sorted(set(want) ^ set(got)),
            "max_rel_err": max(errors.values()),
            "forward": log.forward,
            "backward": log.backward,
            "loss_requires_grad": loss.requires_grad,
        }
    return out


@pytest.mark.parametrize("tokens", [5, 1])
def test_two_interleaved_micro_batches_train_as_two_in_turn_and_back_propagate_in_reverse_order(tokens):
    per_rank = run_ranks(_worker, WORLD, random.randrange(2**31), tokens, timeout_s=600)
    for rank, out in enumerate(per_rank):
        for case, got in out.items():
            assert not got["missing"], (rank, case, got["missing"])
            assert got["max_rel_err"] < 1e-10, (rank, case, got["max_rel_err"])
            assert not got["loss_requires_grad"]
            n = len(got["forward"])  # two layers, two halves, a dispatch and a combine each
            assert got["forward"] == ["A", "B"] * 4, (rank, case, got["forward"])
            assert got["backward"] == list(range(n - 1, -1, -1)), (rank, case, got["backward"])
    for case in CASES:  # every rank issued the same sequence
        assert len({tuple(out[case]["forward"]) for out in per_rank}) == 1, case


def test_what_two_interleaved_micro_batches_refuse():
    model = ep_model("dedup", 5, 1)
    with pytest.raises(ValueError, match="give an even batch"):
        check_two_batch(model, 3)
    layer = next(m for m in model.modules() if isinstance(m, OccultMoE))
    layer.num_ranks = 2  # stands in for an expert-parallel layer over the device transport (not sync-free)
    layer.sync_free = False
    with pytest.raises(ValueError, match="need sync-free MoE layers.*set_sync_free"):
        check_two_batch(model, 4)
    x = torch.randn(4, HIDDEN, dtype=torch.float64)
    with pytest.raises(ValueError, match="need sync-free"):
        interleaved_backward(model, lambda h: model(h).sum(), x.chunk(2))
    assert all(p.grad is None for p in model.parameters())  # refused before any work
    with pytest.raises(ValueError, match="two halves of one shape"):
        interleaved_backward(model, lambda h: model(h).sum(), x.split([3, 1]))


def test_one_rank_trains_two_halves_as_two_micro_batches():
    model = ep_model("dedup", 11, 1)
    x = torch.randn(8, HIDDEN, dtype=torch.float64)
    for half in x.chunk(2):
        (model(half).square().mean() / 2).backward()
    want = grads_of(model)
    model.zero_grad(set_to_none=True)
    loss = interleaved_backward(model, lambda h: model(h).square().mean(), x.chunk(2))
    got = grads_of(model)
    assert set(got) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-12, atol=1e-14)
    with torch.no_grad():
        torch.testing.assert_close(loss, (model(x[:4]).square().mean() + model(x[4:]).square().mean()) / 2)


class _AsPlain(torch.autograd.Function):
    """x @ w, its gradients returned as autograd's (the reference of `_DeferringMatmul`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w = ctx.saved_tensors
        return grad @ w.T, x.T @ grad


class _DeferringMatmul(_AsPlain):
    """x @ w whose backward defers w's gradient to `deferred_wgrad` where it may (as the expert op does), and
    records whether it did."""

    deferred: list[bool] = []

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w = ctx.saved_tensors
        may = deferred_wgrad.deferrable([w])
        _DeferringMatmul.deferred.append(may)
        if not may:
            return _AsPlain.backward(ctx, grad)
        deferred_wgrad.defer(lambda: (x.T @ grad,), [w], (x, grad), x.device)
        return grad @ w.T, None


def test_a_two_batch_backward_defers_both_halves_weight_gradients():
    """With OCCULT_DEFER_WGRAD both halves defer one weight's gradient; the two are added to its `.grad` one after
    the other (on a GPU on the one side stream): the gradients of two micro-batches, also onto an existing `.grad`."""
    torch.manual_seed(3)
    w = nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
    model = nn.Sequential(nn.Linear(4, 4, dtype=torch.float64))
    x = torch.randn(6, 4, dtype=torch.float64)

    def loss_of(h: torch.Tensor) -> torch.Tensor:
        return _DeferringMatmul.apply(model(h), w).square().sum()

    for start in (None, torch.randn(4, 4, dtype=torch.float64)):
        w.grad = None if start is None else start.clone()
        for half in x.chunk(2):  # the reference: two micro-batches in turn, plain backward (nothing deferred)
            (_AsPlain.apply(model(half), w).square().sum() / 2).backward()
        want = w.grad.clone()
        w.grad = None if start is None else start.clone()
        model.zero_grad(set_to_none=True)
        _DeferringMatmul.deferred = []
        interleaved_backward(model, loss_of, x.chunk(2))
        assert _DeferringMatmul.deferred == [True, True]
        torch.testing.assert_close(w.grad, want, rtol=1e-12, atol=1e-14)
