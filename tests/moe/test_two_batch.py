"""Two-batch overlap (`occult.moe.two_batch`, behind `hf.GraphedForward(micro_batches=k)`): on gloo
ranks two halves (and three micro-batches) of a batch through two sync-free expert-parallel layers (dedup and
standard over a placement, and dedup pruned to one device per token), interleaved, give the whole batch's output,
and every rank issues the exchanges in the interleaved order (A's dispatch, B's dispatch, A's combine, B's combine,
layer after layer; with three, C's after B's); the turn skips a finished micro-batch; the
caller's grad mode reaches the halves; an error in a half is raised in the caller after both threads end, never a
hang; nesting is refused; what `GraphedForward` refuses. (The halves on two streams of one capture:
tests/gpu/test_collective_hf.py.)"""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch

from occult.distributed import run_ranks
from occult.moe.config import RoutingConfig
from occult.moe.dense import DenseMoE
from occult.moe.layer import OccultMoE
from occult.moe.two_batch import exchange_issued, interleaving, run_interleaved
from occult.placement import Placement

WORLD = 2


def _logged(layer: OccultMoE, index: int, log: list) -> None:
    """Record (half, layer, exchange) each time `layer` issues a dispatch or a combine."""
    dispatcher = layer.dispatcher
    dispatch, combine = dispatcher.dispatch, dispatcher.combine

    def logged_dispatch(*args, **kwargs):
        log.append((threading.current_thread().name[-1], index, "dispatch"))
        return dispatch(*args, **kwargs)

    def logged_combine(*args, **kwargs):
        log.append((threading.current_thread().name[-1], index, "combine"))
        return combine(*args, **kwargs)

    dispatcher.dispatch, dispatcher.combine = logged_dispatch, logged_combine


def _worker(rank: int, world: int, seed: int) -> dict:
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    placement = Placement(np.stack([rng.permutation(np.arange(8) % world) for _ in range(2)]), world)
    out = {}
    for name, dispatcher, max_devices in (
        ("dedup", "dedup", None),
        ("standard", "standard", None),
        ("pruned1", "dedup", 1),  # each token's experts on one device (issue 53: the schedule stays orthogonal)
    ):
        dense = [DenseMoE(16, 12, 8, 3, dtype=torch.float64) for _ in range(2)]
        routing = RoutingConfig(max_devices=max_devices)
        layers = [
            OccultMoE.from_dense(d, placement=placement, layer_index=i, dispatcher=dispatcher, routing=routing)
            for i, d in enumerate(dense)
        ]
        model = torch.nn.Sequential(*layers)
        for layer in layers:
            layer.sync_free = True
        x = torch.randn(2 * 6, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 7 + rank))
        log: list = []
        for i, layer in enumerate(layers):
            _logged(layer, i, log)
        with torch.no_grad():
            whole = model(x)
            for parts in (2, 3):  # halves, and three micro-batches (the turn round all three)
                log.clear()
                micro = run_interleaved(lambda i: model(x.chunk(parts)[i]), (None,) * parts)
                out[name, parts] = {
                    "error": float((torch.cat(micro) - whole).abs().max()),
                    "order": list(log),
                    "grad": [m.requires_grad for m in micro],
                }
    return out


def test_interleaved_micro_batches_give_the_whole_batch_in_the_interleaved_order():
    per_rank = run_ranks(_worker, WORLD, random.randrange(2**31), timeout_s=300)
    for rank, out in enumerate(per_rank):
        for (name, parts), got in out.items():
            letters = "ABC"[:parts]
            expected = [(m, layer, op) for layer in (0, 1) for op in ("dispatch", "combine") for m in letters]
            assert got["error"] < 1e-12, (rank, name, parts, got["error"])
            assert got["order"] == expected, (rank, name, parts, got["order"])
            assert got["grad"] == [False] * parts, (rank, name)  # no_grad carried into the threads


def test_an_error_in_a_half_is_raised_after_both_end():
    finished = []

    def run(i: int) -> int:
        exchange_issued()
        if i == 1:
            raise KeyError("half B")
        exchange_issued()
        finished.append(i)
        return i

    with pytest.raises(KeyError, match="half B"):
        run_interleaved(run)
    assert finished == [0]  # A ran on alone to its end once B had failed


def test_the_turn_goes_round_unfinished_micro_batches_and_an_error_waits_for_all():
    """Three micro-batches with 3, 1 and 2 exchanges: the turn passes A, B, C, A, then skips B (finished); an error
    in one of three is raised once the other two ran to their ends, the others' noted; 1 or 17 streams refused."""
    order = []

    def run(i: int) -> int:
        for step in range((3, 1, 2)[i]):
            order.append((i, step))
            exchange_issued()
        return i

    assert run_interleaved(run, (None,) * 3) == [0, 1, 2]
    assert order == [(0, 0), (1, 0), (2, 0), (0, 1), (2, 1), (0, 2)]
    finished = []

    def failing(i: int) -> int:
        exchange_issued()
        if i > 0:
            raise KeyError(f"micro-batch {i}")
        exchange_issued()
        finished.append(i)
        return i

    with pytest.raises(KeyError, match="micro-batch 1") as raised:
        run_interleaved(failing, (None,) * 3)
    assert finished == [0]
    assert any("micro-batch 2" in note for note in raised.value.__notes__)
    for streams in ((None,), (None,) * 17):
        with pytest.raises(ValueError, match="interleave 2 to 16 micro-batches"):
            run_interleaved(lambda i: i, streams)


def test_turns_alternate_at_each_exchange_and_nesting_is_refused():
    order = []

    def run(i: int) -> str:
        assert interleaving()
        for step in range(3):
            order.append((i, step))
            exchange_issued()
        with pytest.raises(RuntimeError, match="cannot be nested"):
            run_interleaved(lambda j: j)
        return "AB"[i]

    assert run_interleaved(run) == ["A", "B"]
    assert order == [(i, step) for step in range(3) for i in (0, 1)]
    assert not interleaving()
    exchange_issued()  # outside: nothing happens


def test_graphed_forward_refuses_what_two_micro_batches_cannot_run():
    pytest.importorskip("transformers")
    from occult.integrations import hf
    from occult.integrations.hf.graphed import check_micro_batches

    model = hf.convert(hf.tiny_random_model("olmoe", seed=3, vocab_size=64, num_hidden_layers=2), group=None)
    for batch, parts in ((3, 2), (4, 3), (4, 0), (34, 17)):
        with pytest.raises(ValueError, match="micro_batches must be 1 to 16 and divide the batch"):
            check_micro_batches(model, batch, parts)
    layer = next(m for m in model.modules() if isinstance(m, OccultMoE))
    layer.num_ranks = 2  # stands in for an expert-parallel layer over the device transport (not sync-free)
    for parts in (2, 3):
        with pytest.raises(ValueError, match=f"{parts} interleaved micro-batches need sync-free MoE layers"):
            check_micro_batches(model, 6, parts)
    layer.sync_free = True
    check_micro_batches(model, 4, 2)
    check_micro_batches(model, 6, 3)
    check_micro_batches(model, 3, 1)


def test_halves_run_under_the_callers_autocast_without_its_process_wide_cast_cache():
    """Autocast's on/off and dtype are per thread, its cache of weight casts one for the process: each half runs
    under the caller's autocast with the cache off (and an autocast it enters itself too), so neither reads a cast
    the other made on its stream; the caller's own settings are left as they were."""
    seen: dict = {}

    def half(i: int) -> int:
        seen[i] = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.is_autocast_cache_enabled())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            seen[i, "own"] = torch.is_autocast_cache_enabled()
        return i

    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert run_interleaved(half) == [0, 1]
        assert torch.is_autocast_cache_enabled()
    assert seen[0] == seen[1] == (True, torch.bfloat16, False)
    assert seen[0, "own"] is False and seen[1, "own"] is False
    run_interleaved(half)  # without autocast in the caller: none in the halves either
    assert seen[0][0] is False and torch.is_autocast_cache_enabled()
