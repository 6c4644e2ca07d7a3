"""Shared test fixtures."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_cpu_thread():
    """Tiny models run several times faster on one thread (and far faster on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
