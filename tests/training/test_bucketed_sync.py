"""`occult.training.bucketed_sync.BucketedSync` on gloo ranks: the dense gradients all-reduced a bucket at a time
while the backward runs give what one all-reduce after it gives (`all_reduce_grads`), into zeros where a
parameter got no gradient, with small and large buckets and two backwards in a row; every rank launches the buckets
in bucket order, the first ones before the backward ends (a bucket with a parameter that gets no gradient, and
every bucket after it, at `finish`); `close` removes the hooks. (On GPUs, recorded in a
captured step: tests/gpu/test_collective_captured_step.py.)"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn as nn

from occult.distributed import run_ranks
from occult.training import bucketed_sync
from occult.training.bucketed_sync import BucketedSync
from occult.training.grads import all_reduce_grads
from occult.training.parallel import setup_parallel

WORLD = 2


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    unused = nn.Linear(2, 2, dtype=torch.float64)  # never in the forward: its grad stays None (the last bucket)
    layers = [nn.Linear(8, 8, dtype=torch.float64) for _ in range(4)] + [nn.Linear(8, 3, bias=False)]
    model = nn.Sequential(unused, *layers)
    model.unused = unused
    return model.double()


def _backward(model: nn.Module, seed: int, rank: int) -> None:
    g = torch.Generator().manual_seed(seed * 13 + rank)
    x = torch.randn(5, 8, dtype=torch.float64, generator=g)
    y = x
    for i in range(1, 6):
        y = torch.tanh(model[i](y))
    y.square().sum().backward()


@pytest.mark.parametrize("bucket_bytes", [1, 400, 1 << 30])
def test_bucketed_all_reduces_during_the_backward_give_the_all_reduce_after_it(bucket_bytes):
    seed = random.randrange(2**31)
    out = run_ranks(_checked_worker, WORLD, seed, bucket_bytes, timeout_s=120)
    for rank, got in enumerate(out):
        assert got["max_err"] < 1e-12, (rank, got["max_err"], seed)
        assert got["unused_is_zero"], rank
        n = got["buckets"]
        order = [b for b, _ in got["launched"]]
        assert order == list(range(n)) * 2, (rank, order)  # in bucket order, every bucket, both steps
        during = [b for b, running in got["launched"][:n] if running]
        held = got["unused_buckets"]  # the last buckets: they hold the parameters with no gradient
        assert during == list(range(n - held)), (rank, during, held)  # the others went out during the backward
        assert got["after_close"] == 0, rank
    assert out[0]["launched"] == out[1]["launched"]


def _checked_worker(rank: int, world: int, seed: int, bucket_bytes: int) -> dict:
    par = setup_parallel()
    want_model, got_model = _model(seed), _model(seed)
    launched: list[tuple[int, bool]] = []
    sync = BucketedSync(list(got_model.parameters()), par.sync_group, world, bucket_bytes)
    running = [False]
    launch = sync._launch

    def logged(bucket):
        launched.append((next(i for i, b in enumerate(sync.buckets) if b is bucket), running[0]))
        return launch(bucket)

    sync._launch = logged
    max_err = 0.0
    for _ in range(2):  # two steps, gradients set to None between them
        want_model.zero_grad(set_to_none=True)
        _backward(want_model, seed, rank)
        all_reduce_grads(list(want_model.parameters()), par.sync_group, world, reduce=True)
        got_model.zero_grad(set_to_none=True)
        running[0] = True
        _backward(got_model, seed, rank)
        running[0] = False
        sync.finish()
        for a, b in zip(got_model.parameters(), want_model.parameters()):
            max_err = max(max_err, float((a.grad - b.grad).abs().max() / b.grad.abs().max().clamp_min(1e-300)))
    unused_is_zero = bool((got_model.unused.weight.grad == 0).all())
    sync.close()
    before = len(launched)
    got_model.zero_grad(set_to_none=True)
    _backward(got_model, seed, rank)  # hooks removed: nothing launched
    return {
        "max_err": max_err,
        "unused_is_zero": unused_is_zero,
        "buckets": len(sync.buckets),
        "unused_buckets": sum(any(p is q for p in b for q in got_model.unused.parameters()) for b in sync.buckets),
        "launched": launched,
        "after_close": len(launched) - before,
    }


def test_buckets_hold_one_dtype_in_reverse_order_and_bad_settings_are_refused():
    params = [
        nn.Parameter(torch.zeros(4)),
        nn.Parameter(torch.zeros(4, dtype=torch.float64)),
        nn.Parameter(torch.zeros(2)),
    ]
    buckets = bucketed_sync._buckets(list(reversed(params)), 1 << 20)
    assert [[id(p) for p in b] for b in buckets] == [[id(params[2])], [id(params[1])], [id(params[0])]]
    assert len(bucketed_sync._buckets(params[:1] * 3, 1)) == 3  # a bucket full at its first parameter
    with pytest.raises(ValueError, match="divide >= 1"):
        BucketedSync(params, None, 0)


def _twice_rank(rank: int, world: int) -> str:
    par = setup_parallel()
    model = _model(1)
    sync = BucketedSync(list(model.parameters()), par.sync_group, world)
    _backward(model, 1, rank)
    try:
        _backward(model, 1, rank)  # a second backward before finish(): refused, not summed wrong
    except RuntimeError as exc:
        return str(exc)
    finally:
        sync.close()
    return "no error"


def test_a_second_backward_before_finish_is_refused_on_every_rank():
    got = run_ranks(_twice_rank, WORLD, timeout_s=60)
    assert all("arrived twice before finish()" in m for m in got), got


def _held_rank(rank: int, world: int, seed: int) -> dict:
    """Two backwards a step, the first inside `held()`: the gradients of both summed and all-reduced once."""
    par = setup_parallel()
    want_model, got_model = _model(seed), _model(seed)
    sync = BucketedSync(list(got_model.parameters()), par.sync_group, world, 400)
    launches = [0]
    launch = sync._launch

    def counted(bucket):
        launches[0] += 1
        return launch(bucket)

    sync._launch = counted
    _backward(want_model, seed, rank)
    _backward(want_model, seed + 1, rank)
    all_reduce_grads(list(want_model.parameters()), par.sync_group, world, reduce=True)
    with sync.held():
        _backward(got_model, seed, rank)
    held_launches = launches[0]
    _backward(got_model, seed + 1, rank)
    sync.finish()
    err = max(
        float((a.grad - b.grad).abs().max() / b.grad.abs().max().clamp_min(1e-300))
        for a, b in zip(got_model.parameters(), want_model.parameters())
    )
    refused = []
    for misuse in ("nested", "after a counted backward"):
        try:
            if misuse == "nested":
                with sync.held(), sync.held():
                    pass
            else:
                _backward(got_model, seed, rank)
                with sync.held():
                    pass
        except RuntimeError as exc:
            refused.append(str(exc))
    sync.finish()
    sync.close()
    return {
        "err": err,
        "held_launches": held_launches,
        "launches": launches[0],
        "buckets": len(sync.buckets),
        "refused": refused,
    }


def test_a_backward_inside_held_adds_its_gradients_to_the_next_ones_reduction():
    seed = random.randrange(2**31)
    for got in run_ranks(_held_rank, WORLD, seed, timeout_s=120):
        assert got["err"] < 1e-12, (got["err"], seed)
        assert got["held_launches"] == 0  # nothing launched while held
        assert got["launches"] == 2 * got["buckets"]  # once a bucket in the step, then the misuse step's finish
        assert "cannot be nested" in got["refused"][0] and "call finish() first" in got["refused"][1], got["refused"]
