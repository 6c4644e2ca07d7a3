"""Shared test fixtures.

The CPU suite starts its gloo ranks (`occult.distributed.run_ranks`) from a fork server that
loaded torch once (`OCCULT_RANK_START=forkserver`): a rank test's start-up falls from ~1.8 s to
~0.2 s. Set before any test runs; the Ctrl-C tests run the command line without it (the default,
spawned ranks, is what users get)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("OCCULT_RANK_START", "forkserver")


@pytest.fixture(scope="module")
def one_cpu_thread():
    """Tiny models run several times faster on one thread (and far faster on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
