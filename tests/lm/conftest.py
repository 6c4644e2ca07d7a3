"""Fixtures of the occult.lm tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def data():
    """The tiny Shakespeare corpus (tokenizers needed), once per test module."""
    pytest.importorskip("tokenizers")
    from _train_helpers import load_tiny

    return load_tiny()
