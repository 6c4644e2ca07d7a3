"""`finish_distributed`: every rank leaves together after success, at once after a failure."""

from __future__ import annotations

import time

import torch.distributed as dist

from occult.distributed import finish_distributed, run_ranks


def leave(rank: int, world_size: int, ok: bool, late_s: float) -> dict:
    if rank == 0:
        time.sleep(late_s)  # the slow rank (rank 0 writing its files, say)
    t0 = time.perf_counter()
    error = None
    try:
        finish_distributed(ok=ok or rank == 0)
    except RuntimeError as exc:  # rank 0 succeeded, its peer failed and left: an error, not a hang
        error = str(exc)
    return {"waited_s": time.perf_counter() - t0, "initialized": dist.is_initialized(), "error": error}


def test_success_waits_for_the_slowest_rank_then_destroys_the_groups():
    late = 1.5
    slow, fast = run_ranks(leave, 2, True, late, timeout_s=60, collective_timeout_s=30)
    assert fast["waited_s"] > 0.6 * late and not fast["initialized"] and not slow["initialized"]
    assert slow["error"] is None and fast["error"] is None


def test_failure_leaves_at_once():
    late = 3.0
    slow, fast = run_ranks(leave, 2, False, late, timeout_s=60, collective_timeout_s=30)
    assert fast["waited_s"] < 0.5 * late and not fast["initialized"] and fast["error"] is None
    # the rank that succeeded meets no one at the barrier: an error well inside the 30 s timeout
    assert slow["error"] and slow["waited_s"] < 10 and not slow["initialized"]


def test_without_a_process_group_is_a_no_op():
    assert not dist.is_initialized()
    finish_distributed()
    finish_distributed(ok=False)
