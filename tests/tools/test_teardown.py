"""`occult.teardown`: what holds captured collectives is released before a process group goes."""

from __future__ import annotations

import gc

import torch.distributed as dist

from occult.distributed import run_ranks
from occult.teardown import hold_collectives, release_captured


class Holder:
    """Stands in for a StaticDecoder with a captured graph: counts its releases."""

    def __init__(self) -> None:
        self.released = 0

    def release(self) -> None:
        self.released += 1


def destroy_with_holders(rank: int, world_size: int) -> dict:
    kept, dropped = Holder(), Holder()
    hold_collectives(kept)
    hold_collectives(dropped)
    hold_collectives(kept)  # twice: still released once, destroy wrapped once
    del dropped
    gc.collect()  # held weakly: a collected holder is not called
    wrapped_once = not getattr(dist.destroy_process_group.__wrapped__, "releases_captured", False)
    dist.destroy_process_group()  # the plain call a user makes
    return {
        "released": kept.released,
        "initialized": dist.is_initialized(),
        "wrapped_once": wrapped_once,
        "left": release_captured(),
    }


def test_plain_destroy_releases_every_live_holder_once_then_destroys():
    for out in run_ranks(destroy_with_holders, 2, timeout_s=60, collective_timeout_s=30):
        assert out == {"released": 1, "initialized": False, "wrapped_once": True, "left": 0}


def test_release_captured_by_hand():
    holder = Holder()
    hold_collectives(holder)
    assert release_captured() == 1 and holder.released == 1
    assert release_captured() == 0 and holder.released == 1
