"""The reference expert path traced the way TorchTitan compiles its blocks (`capture_scalar_outputs`: the
per-expert row counts become unbacked symbols; TorchTitan's apply_compile sets it for the whole process):
no guard on a count (before: "Could not guard on data-dependent expression" at the empty-expert skip),
the same outputs and gradients as eager, an expert with no rows among them."""

from __future__ import annotations

import random

import pytest
import torch

from occult.moe.experts import expert_mlp_reference


def _inputs(seed: int, R: int, E: int, K: int, H: int = 16, F: int = 8):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, H, generator=g)
    slots = torch.randint(-1, E - 1, (R, K), generator=g)  # the last expert gets no row
    gates = torch.rand(R, K, generator=g)
    w1, w2 = torch.randn(E, 2 * F, H, generator=g) * 0.3, torch.randn(E, H, F, generator=g) * 0.3
    return [t.requires_grad_(t.is_floating_point()) for t in (x, slots, gates, w1, w2)]


def _run(fn, inputs):
    y = fn(*inputs)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return y.detach(), [t.grad for t in inputs if t.is_floating_point()]


@pytest.mark.parametrize("rows,experts,top_k", [(24, 4, 2), (9, 3, 1), (12, 4, 4)])
def test_reference_experts_trace_with_unbacked_counts(rows, experts, top_k):
    seed = random.randrange(2**31)
    torch._dynamo.reset()
    traced = torch.compile(expert_mlp_reference, backend="aot_eager")
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        y, grads = _run(traced, _inputs(seed, rows, experts, top_k))
    y_ref, grads_ref = _run(expert_mlp_reference, _inputs(seed, rows, experts, top_k))
    scale = y_ref.abs().max().item() + 1.0
    assert torch.allclose(y, y_ref, atol=1e-5 * scale, rtol=1e-5), (seed, (y - y_ref).abs().max())
    for got, want in zip(grads, grads_ref, strict=True):
        assert torch.allclose(got, want, atol=1e-5 * (want.abs().max().item() + 1.0), rtol=1e-5), seed
