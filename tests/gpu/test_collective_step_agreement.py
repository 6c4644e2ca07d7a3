"""`occult.agreed_step` over the device transport on every GPU of the machine (NCCL), fp32, bf16, fp16.

A step of three MoE layers (forward and backward) agreed once must give what the per-call agreement
gives, and a rank's bad input inside the step must raise on every rank (that rank: its own error;
the others: `RoutingError`) with no rank left inside an all-to-all, after which the group works on.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from test_collective_layer import DTYPES, FFN, HIDDEN, _placement, _rel, skip_without_transport  # (tests/gpu)

from occult import DenseMoE, OccultMoE, RoutingError, agreed_step, check_routing

LAYERS = 3


@pytest.fixture(autouse=True)
def step_agreement_on(monkeypatch):
    """The step agreement is opt-in (`OCCULT_AGREEMENT=step`)."""
    monkeypatch.setenv("OCCULT_AGREEMENT", "step")


def _stack(ranks, dtype: torch.dtype, transport: str = "device") -> nn.ModuleList:
    torch.manual_seed(ranks.seed + 31)
    E = 8 * ranks.world_size
    placement = _placement("random", E, ranks.world_size, ranks.seed)
    return nn.ModuleList(
        OccultMoE.from_dense(
            DenseMoE(HIDDEN, FFN, E, 4, dtype=dtype, device=ranks.device), placement=placement, transport=transport
        )
        for _ in range(LAYERS)
    )


def _step(layers, x, g, agreed: bool, bad: dict | None = None):
    for p in layers.parameters():
        p.grad = None
    x = x.clone().requires_grad_()
    with agreed_step(layers, x.shape[0]) if agreed else _nothing():
        h = x
        for i, layer in enumerate(layers):
            h = h + layer(bad[i] if bad and i in bad else h)
        (h.float() * g).sum().backward()
    return [h.detach(), x.grad] + [p.grad for p in layers.parameters()]


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_a_step_agreed_once_equals_per_call_agreement(ranks, dtype_name):
    skip_without_transport(ranks, "device")
    dtype = DTYPES[dtype_name]
    layers, counts = _stack(ranks, dtype), _stack(ranks, dtype, "counts")
    worst_same, worst_counts = 0.0, 0.0
    for n, tokens in enumerate((200 + 37 * ranks.rank, 1500 - 11 * ranks.rank, 0 if ranks.rank == 0 else 64)):
        gen = torch.Generator(device=ranks.device).manual_seed(ranks.seed + 10 * n + ranks.rank)
        x = torch.randn(tokens, HIDDEN, dtype=dtype, device=ranks.device, generator=gen)
        g = torch.randn(x.shape, device=ranks.device, generator=gen)
        stepped = _step(layers, x, g, agreed=True)
        per_call = _step(layers, x, g, agreed=False)
        by_counts = _step(counts, x, g, agreed=True)  # no device transport: agreed_step agrees nothing
        worst_same = max([worst_same] + [_rel(a, b) for a, b in zip(stepped, per_call)])
        worst_counts = max([worst_counts] + [_rel(a, b) for a, b in zip(stepped, by_counts)])
    check_routing()
    assert ranks.all_max(worst_same) < 1e-6, worst_same  # the same kernels on the same bound
    assert ranks.all_max(worst_counts) < {"fp32": 1e-4, "bf16": 3e-2, "fp16": 5e-3}[dtype_name], worst_counts


@pytest.mark.parametrize("at_layer", [1, LAYERS - 1], ids=["middle", "last"])
@pytest.mark.parametrize("kind", ["hidden", "over-bound"])
def test_bad_input_inside_a_step_raises_on_every_rank(ranks, at_layer, kind):
    skip_without_transport(ranks, "device")
    layers = _stack(ranks, torch.bfloat16)
    x = torch.randn(96, HIDDEN, dtype=torch.bfloat16, device=ranks.device)
    g = torch.randn(x.shape, device=ranks.device)
    last = ranks.world_size - 1
    bad = {}
    if ranks.rank == last:
        shape = (96, HIDDEN + 1) if kind == "hidden" else (97, HIDDEN)
        bad[at_layer] = torch.randn(shape, dtype=torch.bfloat16, device=ranks.device)
    own = f"hidden size {HIDDEN + 1}" if kind == "hidden" else "has 97 tokens but the training step's agreement"
    peer = f"rank {last}: " + ("input hidden size" if kind == "hidden" else "more tokens than the training step's")
    if ranks.rank == last:
        with pytest.raises(ValueError, match=own):
            _step(layers, x, g, agreed=True, bad=bad)
    else:
        with pytest.raises(RoutingError, match=peer):
            _step(layers, x, g, agreed=True, bad=bad)
    clean = _step(layers, x, g, agreed=True)  # the group works on
    again = _step(layers, x, g, agreed=False)
    check_routing()
    assert ranks.all_max(max(_rel(a, b) for a, b in zip(clean, again))) < 1e-6
