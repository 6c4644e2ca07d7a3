"""Gradient accumulation in turn and paired (combined 1F1B: `occult.training.accumulation`, issue 53) on gloo
ranks: sync-free expert-parallel layers (dedup over a placement, standard, dedup pruned to one device per token,
top-1 with a rank whose tokens all go elsewhere, top-k = all) between dense layers, K micro-batches paired give
the gradients of the K micro-batches one after the other (and of the whole batch's mean loss), and every rank
issues the exchanges in one order: the first forward alone, then each next forward's exchanges alternating with
the previous micro-batch's backward ones, then the last backward; `run_paired` raises a side's error once both
ended; what pairing refuses. (On GPUs, inside a recorded step: the GPU suite.)"""

from __future__ import annotations

import random
import threading

import pytest
import torch
from micro_batch_helpers import exchange_events, paired_order
from test_two_batch_step import CASES, HIDDEN, ep_model, grads_of

from occult.distributed import run_ranks
from occult.moe.layer import OccultMoE
from occult.moe.two_batch import backward_exchange_issued, exchange_issued, run_paired
from occult.training.accumulation import accumulate_backward, check_paired

WORLD = 2


def _worker(rank: int, world: int, seed: int, tokens: int, count: int) -> dict:
    out = {}
    for case in CASES:
        model = ep_model(case, seed, world)
        gen = torch.Generator().manual_seed(seed * 7 + rank)
        x = torch.randn(count * tokens, HIDDEN, dtype=torch.float64, generator=gen)
        if case == "top1" and rank == 1:  # every token of this rank routed to the other rank's experts
            x = x * 0
        w = torch.randn(count * tokens, HIDDEN, dtype=torch.float64, generator=gen)
        micro, weights = x.chunk(count), w.chunk(count)

        def loss_of(m: torch.Tensor, micro=micro, weights=weights, model=model) -> torch.Tensor:
            i = next(j for j, part in enumerate(micro) if part is m)
            return (model(m) * weights[i]).sum() / m.shape[0]

        whole = sum((model(m) * weights[i]).sum() / m.shape[0] for i, m in enumerate(micro)) / count
        whole.backward()  # the reference: one backward of the mean over the micro-batches
        want = grads_of(model)
        model.zero_grad(set_to_none=True)
        in_turn = accumulate_backward(model, loss_of, micro)
        turn_grads = grads_of(model)
        model.zero_grad(set_to_none=True)
        with exchange_events() as events:
            loss = accumulate_backward(model, loss_of, micro, paired=True)
        got = grads_of(model)

        def worst(grads: dict) -> float:
            return max(float((grads[k] - v).abs().max() / v.abs().max().clamp_min(1e-300)) for k, v in want.items())

        out[case] = {
            "missing": sorted(set(want) ^ set(got)) + sorted(set(want) ^ set(turn_grads)),
            "paired_err": worst(got),
            "in_turn_err": worst(turn_grads),
            "loss_err": float(abs(loss - whole.detach()) / abs(whole.detach())),
            "in_turn_loss_err": float(abs(in_turn - whole.detach()) / abs(whole.detach())),
            "events": events,
            "loss_requires_grad": loss.requires_grad,
        }
    return out


@pytest.mark.parametrize("tokens, count", [(5, 2), (1, 3)])
def test_paired_micro_batches_give_the_accumulated_gradients_in_one_order_on_every_rank(tokens, count):
    per_rank = run_ranks(_worker, WORLD, random.randrange(2**31), tokens, count, timeout_s=600)
    for rank, out in enumerate(per_rank):
        for case, got in out.items():
            assert not got["missing"], (rank, case, got["missing"])
            assert got["paired_err"] < 1e-10 and got["in_turn_err"] < 1e-10, (rank, case, got)
            assert got["loss_err"] < 1e-12 and got["in_turn_loss_err"] < 1e-12, (rank, case, got)
            assert not got["loss_requires_grad"]
            per_pass = 4  # two layers, a dispatch and a combine each
            assert got["events"] == paired_order(count, per_pass), (rank, case, got["events"])
    for case in CASES:
        assert len({tuple(out[case]["events"]) for out in per_rank}) == 1, case


def test_run_paired_raises_a_sides_error_once_both_ended():
    """The forward's error after the backward ran to its end, and the other way round; the survivor runs on alone;
    pairing cannot nest."""
    done = []

    def forward_fails() -> None:
        exchange_issued()
        raise KeyError("forward")

    with pytest.raises(KeyError, match="forward"):
        run_paired(forward_fails, lambda: done.append("backward"))
    assert done == ["backward"]

    def backward_fails() -> None:
        raise KeyError("backward")

    def forward() -> str:
        exchange_issued()
        exchange_issued()
        done.append("forward")
        return threading.current_thread().name

    with pytest.raises(KeyError, match="backward"):
        run_paired(forward, backward_fails)
    assert done[-1] == "forward"

    def nested() -> None:
        run_paired(lambda: None, lambda: None)

    with pytest.raises(RuntimeError, match="cannot be nested"):
        run_paired(forward, nested)
    assert run_paired(forward, lambda: None) == "occult-1f1b-forward"


def test_a_backward_exchange_on_another_thread_hands_the_turn_over():
    """On a GPU the backward's exchange nodes run on autograd's device thread, neither the caller's nor the
    forward's: the pairing is found there too (module state), and the turn alternates; outside a pairing the call
    does nothing."""
    order = []

    def forward() -> str:
        for step in range(2):
            order.append(("f", step))
            exchange_issued()
        return "done"

    def backward() -> None:
        def engine() -> None:
            for step in range(2):
                order.append(("b", step))
                backward_exchange_issued()

        thread = threading.Thread(target=engine)
        thread.start()
        thread.join()

    assert run_paired(forward, backward) == "done"
    assert order == [("f", 0), ("b", 0), ("f", 1), ("b", 1)]
    backward_exchange_issued()  # outside: nothing happens


def test_what_pairing_refuses():
    model = ep_model("dedup", 5, 1)
    with pytest.raises(ValueError, match="two or more micro-batches"):
        check_paired(model, 1)
    layer = next(m for m in model.modules() if isinstance(m, OccultMoE))
    layer.num_ranks = 2  # stands in for an expert-parallel layer over the device transport (not sync-free)
    layer.sync_free = False
    x = torch.randn(6, HIDDEN, dtype=torch.float64)
    with pytest.raises(ValueError, match="need sync-free MoE layers.*set_sync_free"):
        accumulate_backward(model, lambda m: model(m).sum(), x.chunk(3), paired=True)
    assert all(p.grad is None for p in model.parameters())  # refused before any work
    with pytest.raises(ValueError, match="micro-batches of one shape"):
        accumulate_backward(model, lambda m: model(m).sum(), x.split([4, 2]))


def test_one_rank_accumulates_paired_as_in_turn():
    model = ep_model("dedup", 11, 1)
    x = torch.randn(12, HIDDEN, dtype=torch.float64)
    accumulate_backward(model, lambda m: model(m).square().mean(), x.chunk(3))
    want = grads_of(model)
    model.zero_grad(set_to_none=True)
    loss = accumulate_backward(model, lambda m: model(m).square().mean(), x.chunk(3), paired=True)
    got = grads_of(model)
    assert set(got) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-12, atol=1e-14)
    with torch.no_grad():
        torch.testing.assert_close(loss, sum(model(m).square().mean() for m in x.chunk(3)) / 3)
