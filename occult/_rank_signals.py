"""A rank process spawned by `occult.distributed.run_ranks` ignores Ctrl-C from its first import of
occult on (before torch loads): the terminal's SIGINT reaches the whole process group, and the
parent alone handles it (it ends the ranks and prints one line). The ranks start with SIGINT
blocked too; this also drops a SIGINT that arrived while blocked, should anything unblock it."""

from __future__ import annotations

import multiprocessing
import signal

RANK_PROCESS_PREFIX = "occult-rank-"


def ignore_interrupts_in_ranks() -> None:
    """In a process named by `run_ranks` (`RANK_PROCESS_PREFIX`; the name is set before the rank
    unpickles its target, which imports occult), SIGINT is ignored; elsewhere nothing."""
    if multiprocessing.current_process().name.startswith(RANK_PROCESS_PREFIX):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
