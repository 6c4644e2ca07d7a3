"""`occult.training.bucketed_sync.BucketedSync` on gloo ranks: the dense gradients all-reduced a bucket at a time
while the backward runs give what one all-reduce after it gives (`all_reduce_grads`), into zeros where a
parameter got no gradient, with small and large buckets and two backwards in a row; every rank launches the buckets
in bucket order, the first ones before the backward ends (a bucket with a parameter that gets no gradient, and
every bucket after it, at `finish`); `close` removes the hooks. Paced (`pace_bytes`), an oversized bucket's pieces
sum to the unpaced averages bit for bit (two ranks: each element is a + b however the flat is cut), go out one
more at each later bucket's launch, the same order on every rank, held or not. (On GPUs, recorded in a
captured step: tests/gpu/test_collective_captured_step.py.)"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
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


def _paced_model(seed: int) -> nn.Sequential:
    """At bucket_bytes 256 (fp32), four buckets (reverse order): the head (1280 B), the last layer (288 B: past 256
    by its weight, whole), the second (1568 B), the first (1728 B), three of them oversized."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 48), nn.Linear(48, 8), nn.Linear(8, 8), nn.Linear(8, 40, bias=False))


def _paced_backward(model: nn.Module, seed: int, rank: int) -> None:
    g = torch.Generator().manual_seed(seed * 7 + rank)
    y = torch.randn(6, 8, generator=g)
    for layer in model:
        y = torch.tanh(layer(y))
    y.square().sum().backward()


@contextlib.contextmanager
def _all_reduces(sync: BucketedSync, running: list[bool]) -> Iterator[list[tuple]]:
    """While entered: (bucket, piece index, during the backward) of every all-reduce (`dist.all_reduce`, wrapped)
    `sync` issues, in the order issued; ("other",) for any other all-reduce."""
    calls: list[tuple] = []
    flats: list[tuple[int, torch.Tensor]] = []
    launch, all_reduce = sync._launch, dist.all_reduce

    def launched(bucket):
        flat = launch(bucket)
        flats.append((next(i for i, b in enumerate(sync.buckets) if b is bucket), flat))
        return flat

    def logged(tensor, *args, **kwargs):
        ptr = tensor.untyped_storage().data_ptr()
        for i, flat in flats:
            if flat.untyped_storage().data_ptr() == ptr:
                a = tensor.storage_offset() - flat.storage_offset()
                calls.append((i, sync.pieces[i].index((a, a + tensor.numel())), running[0]))
                break
        else:
            calls.append(("other",))
        return all_reduce(tensor, *args, **kwargs)

    sync._launch, dist.all_reduce = launched, logged
    try:
        yield calls
    finally:
        sync._launch, dist.all_reduce = launch, all_reduce


def _paced_rank(rank: int, world: int, seed: int, pace_bytes: int | str, held: bool = False) -> dict:
    """Two steps of the same gradients through an unpaced and a paced `BucketedSync` (`held`: two backwards a step,
    the first inside `held()`); whether every averaged gradient is equal, the paced all-reduces of each step."""
    par = setup_parallel()
    plain_model, paced_model = _paced_model(seed), _paced_model(seed)
    plain = BucketedSync(list(plain_model.parameters()), par.sync_group, world, 256, pace_bytes=0)
    paced = BucketedSync(list(paced_model.parameters()), par.sync_group, world, 256, pace_bytes=pace_bytes)
    running, equal, steps = [False], True, []

    def step_of(model: nn.Module, sync: BucketedSync, step: int) -> None:
        model.zero_grad(set_to_none=True)
        if held:
            with sync.held():
                _paced_backward(model, seed + 100 + step, rank)
        running[0] = True
        _paced_backward(model, seed + step, rank)
        running[0] = False
        sync.finish()

    for step in range(2):  # fresh inputs each step
        step_of(plain_model, plain, step)
        with _all_reduces(paced, running) as calls:
            step_of(paced_model, paced, step)
        steps.append(calls)
        equal &= all(torch.equal(a.grad, b.grad) for a, b in zip(paced_model.parameters(), plain_model.parameters()))
    plain.close()
    paced.close()
    return {"equal": equal, "steps": steps, "pieces": paced.pieces, "plain_pieces": plain.pieces}


@pytest.mark.parametrize("pace_bytes", [256, 64, 1])
def test_paced_pieces_give_the_unpaced_averages_bit_for_bit_in_one_order_on_every_rank(pace_bytes):
    seed = random.randrange(2**31)
    out = run_ranks(_paced_rank, WORLD, seed, pace_bytes, timeout_s=120)
    for rank, got in enumerate(out):
        assert got["equal"], (rank, seed)  # torch.equal: on two ranks each element is a + b however it is cut
        pieces = got["pieces"]
        assert all(len(p) == 1 for p in got["plain_pieces"]) and len(pieces[0]) > 1, pieces
        for bucket in pieces:  # contiguous pieces that cover the flat once
            assert bucket[0][0] == 0 and all(a[1] == b[0] < b[1] for a, b in zip(bucket, bucket[1:])), bucket
        for calls in got["steps"]:
            assert ("other",) not in calls
            for i, bucket in enumerate(pieces):  # every piece once, a bucket's pieces in order
                assert [j for b, j, _ in calls if b == i] == list(range(len(bucket))), (i, calls)
    assert out[0]["steps"] == out[1]["steps"], seed  # the same all-reduces in the same order on both ranks


def test_a_paced_bucket_sends_one_more_piece_as_each_later_bucket_goes_out():
    """Launching a bucket: one more piece of each earlier bucket with pieces left (bucket order), then its own
    first piece; at finish() the rest, round by round."""
    got = run_ranks(_paced_rank, WORLD, random.randrange(2**31), 256, timeout_s=120)[0]
    assert [len(p) for p in got["pieces"]] == [5, 1, 4, 7]  # round(bytes / 256); the 288-byte bucket stays whole
    during, after = True, False
    want = [
        (0, 0, during),  # the head's bucket, first: its piece 0
        *[(0, 1, during), (1, 0, during)],  # bucket 1 goes out: the head's piece 1 first
        *[(0, 2, during), (2, 0, during)],
        *[(0, 3, during), (2, 1, during), (3, 0, during)],  # the last bucket: its gradients in during the backward
        *[(0, 4, after), (2, 2, after), (3, 1, after)],  # finish(): round by round, in bucket order
        *[(2, 3, after), (3, 2, after)],
        *[(3, 3, after), (3, 4, after), (3, 5, after), (3, 6, after)],
    ]
    assert got["steps"][0] == want and got["steps"][1] == want


def test_a_paced_step_of_held_backwards_gives_the_unpaced_sums(monkeypatch):
    """Paced through the setting (OCCULT_PACE_BUCKETS=1: pieces of about bucket_bytes): nothing goes out while
    held, and the two backwards' sum is reduced as unpaced, bit for bit."""
    monkeypatch.setenv("OCCULT_PACE_BUCKETS", "1")  # (the ranks get this environment)
    seed = random.randrange(2**31)
    for got in run_ranks(_paced_rank, WORLD, seed, "setting", True, timeout_s=120):
        assert got["equal"], seed
        assert [len(p) for p in got["pieces"]] == [5, 1, 4, 7]  # (pace_bytes = bucket_bytes = 256)
        for calls in got["steps"]:
            assert len(calls) == 17 and calls[0] == (0, 0, True)  # nothing from the held backward: all from the second


def test_pieces_are_about_pace_bytes_and_a_bad_pace_is_refused():
    head = [nn.Parameter(torch.empty(50304, 2048, dtype=torch.bfloat16, device="meta"))]  # OLMoE's LM head
    pieces = bucketed_sync._pieces(head, bucketed_sync.BUCKET_BYTES)
    assert len(pieces) == 8 and pieces[0] == (0, 12_877_824) and pieces[-1][1] == 50304 * 2048  # 206 MB / 26 MB
    assert all(a % 128 == 0 for a, _ in pieces)  # starts 256-byte aligned
    layer = [nn.Parameter(torch.empty(4, 2**20, dtype=torch.bfloat16, device="meta"))]  # 8 MiB: 1.3 buckets of 6
    assert bucketed_sync._pieces(layer, 6 * 2**20) == [(0, 4 * 2**20)]  # past by its last parameter: whole
    assert bucketed_sync._pieces(head, 0) == [(0, 50304 * 2048)]
    for bad in (-1, 2.5):
        with pytest.raises(ValueError, match="pace_bytes must be a byte count >= 0"):
            BucketedSync(head, None, 1, pace_bytes=bad)
