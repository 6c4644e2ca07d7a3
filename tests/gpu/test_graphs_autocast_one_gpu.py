"""A layer call recorded inside an autocast region whose earlier eager calls cached the casts of its weights
(autocast's weight cache): the recording makes its own casts (`occult.moe.capture_stream.autocast_uncached`),
so its replays in a later region, after the cached copies were freed and their memory written over, give the
eager output. Before, a recording read the cached copies: `occult train --layer-graphs` evaluations replayed
NaN gates. Forward-only and training recordings; single-process GPU tests (tests/gpu/run.sh's second stage)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from occult import OccultMoE, set_graphs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def _region(train: bool) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast("cuda", torch.bfloat16))
    stack.enter_context(contextlib.nullcontext() if train else torch.no_grad())
    return stack


@pytest.mark.parametrize("train", [False, True], ids=["forward", "train"])
def test_a_recording_after_cached_casts_replays_the_eager_output(train):
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    layer = OccultMoE(256, 128, 16, 4, graphs=True, train_graphs=True, device="cuda")  # fp32 weights
    x = torch.randn(512, 256, device="cuda")
    with _region(train):
        for _ in range(3):  # two eager calls (they cache the casts), then the recording
            y = layer(x)
            if train:
                y.float().square().sum().backward()
    assert len(layer.graphs) == 1
    # blocks the size of each weight's bf16 cast, full of NaN: the caching allocator hands freed blocks of a size
    # out again, so the freed casts' memory is likely among them
    junk = [torch.full(p.shape, float("nan"), device="cuda", dtype=torch.bfloat16) for p in layer.parameters()]
    junk = junk + [t.clone() for t in junk for _ in range(7)]
    with _region(train):
        got = layer(x)  # a replay
    assert len(layer.graphs) == 1
    set_graphs(layer, False)
    with _region(train):
        ref = layer(x)
    del junk
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=0, atol=0)  # the same kernels on the same inputs
