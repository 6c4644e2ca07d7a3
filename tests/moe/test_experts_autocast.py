"""Under autocast the Triton expert path runs in the autocast dtype, as the reference's matmuls do
(a custom kernel is not cast by autocast: before this, bf16-autocast training ran the expert
kernels in fp32), and hands back x's dtype."""

from __future__ import annotations

import random

import pytest
import torch

from occult import kernels
from occult.moe.experts import expert_mlp, expert_mlp_reference


def _inputs(seed: int, R: int = 24, H: int = 16, F: int = 8, E: int = 4, K: int = 2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, H, generator=g)
    slots = torch.randint(-1, E, (R, K), generator=g)
    gates = torch.rand(R, K, generator=g)
    w1, w2 = torch.randn(E, 2 * F, H, generator=g) * 0.3, torch.randn(E, H, F, generator=g) * 0.3
    return x, slots, gates, w1, w2


@pytest.mark.parametrize("autocast", [False, True])
def test_triton_path_takes_the_autocast_dtype(monkeypatch, autocast):
    seen = {}

    def recording_kernel(x, slots, gates, w1, w2, **kw):  # stands in for the Triton op (same contract)
        seen["dtype"] = x.dtype
        return expert_mlp_reference(x, slots, gates, w1.to(x.dtype), w2.to(x.dtype))

    monkeypatch.setattr(kernels, "expert_mlp", recording_kernel)
    x, slots, gates, w1, w2 = _inputs(random.randrange(2**31))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = expert_mlp(x, slots, gates, w1, w2, backend="triton")
        ref = expert_mlp(x, slots, gates, w1, w2, backend="torch")
    assert seen["dtype"] == (torch.bfloat16 if autocast else torch.float32)
    assert y.dtype == torch.float32 == ref.dtype
    tol = 3e-2 if autocast else 1e-6
    assert (y - ref).norm() <= tol * ref.norm(), ((y - ref).norm() / ref.norm()).item()
