"""`occult.moe.agree`: the host-only maximum the device transport agrees on, on 3 CPU ranks."""

from __future__ import annotations

import random
import time

import pytest
import torch.distributed as dist

from occult.distributed import run_ranks
from occult.moe.agree import GlooBoard, SharedBoard, make_board


def rounds_worker(rank: int, world: int, seed: int) -> list[list[int]]:
    board = make_board(dist.group.WORLD, 4, 30.0)
    gloo = GlooBoard(dist.group.WORLD)
    assert isinstance(board, SharedBoard)  # every rank on this host
    rng = random.Random(seed + rank)
    out = []
    for step in range(300):
        values = [rng.randrange(-5, 1000) for _ in range(4)]
        if step % 37 == rank:
            time.sleep(0.01)  # one rank late now and then: the others wait for it
        shared = board.max_reduce(values)
        assert shared == gloo.max_reduce(values), (step, shared)
        out.append(shared)
    return out


def test_shared_board_equals_gloo_over_many_rounds():
    results = run_ranks(rounds_worker, 3, random.randrange(2**31), timeout_s=120)
    assert results[0] == results[1] == results[2] and len(results[0]) == 300


def dead_peer_worker(rank: int, world: int) -> str:
    board = make_board(dist.group.WORLD, 1, 2.0)
    board.max_reduce([rank])
    if rank == 1:
        return "left"  # never joins round 2
    try:
        board.max_reduce([rank])
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_a_peer_that_never_arrives_is_a_clear_error():
    out = run_ranks(dead_peer_worker, 2, timeout_s=60)
    assert out[1] == "left"
    assert "ranks [1] did not reach" in out[0] and "2 s" in out[0], out[0]


@pytest.mark.parametrize("world", [1])
def test_one_rank_board(world):
    assert run_ranks(lambda_free_worker, world, timeout_s=60) == [[7, 3]]


def lambda_free_worker(rank: int, world: int) -> list[int]:
    return make_board(dist.group.WORLD, 2, 5.0).max_reduce([7, 3])


def split_rounds_worker(rank: int, world: int, seed: int, board_kind: str) -> list[list[int]]:
    """Rounds posted now and read one round later (a step's layer calls), mixed with whole rounds; every
    rank knows every rank's values (drawn from the seed), so nothing but the board keeps the hosts together."""
    board = make_board(dist.group.WORLD, 3, 30.0) if board_kind == "shared" else GlooBoard(dist.group.WORLD)
    shape = random.Random(seed)  # the same pattern on every rank
    out, previous = [], None
    for step in range(300):
        drawn = [random.Random(f"{seed}-{r}-{step}") for r in range(world)]
        every = [[d.randrange(-5, 1000) for _ in range(3)] for d in drawn]
        values, expected = every[rank], [max(col) for col in zip(*every)]
        if step % 29 == rank or random.Random(f"{seed}-{rank}-{step}-late").random() < 0.05:
            time.sleep(0.005)  # one rank's host late now and then
        if shape.random() < 0.3:
            got = board.max_reduce(values)  # a whole round (a step's first agreement, a growth vote)
            assert got == expected and not board.unread, (step, got, expected)
            previous = None
        else:
            if board.unread:
                assert board.collect() == previous, step  # the last call's round, read one call late
            board.post(values)
            previous = expected
        out.append(expected)
    if board.unread:
        assert board.collect() == previous
    return out


@pytest.mark.parametrize("board_kind", ["shared", "gloo"])
def test_rounds_read_one_round_late_equal_whole_rounds(board_kind):
    results = run_ranks(split_rounds_worker, 3, random.randrange(2**31), board_kind, timeout_s=120)
    assert results[0] == results[1] == results[2]
