"""`OCCULT_DEFER_WGRAD=1` over NCCL (`occult.kernels.deferred_wgrad`): an expert-parallel layer's backward with the
expert weight GEMMs on their side stream, under the dispatch's backward all-to-all, gives every gradient (input,
router, experts) of the same backward without the setting, bit for bit: the count exchange, the sync-free
schedule and the device transport, standard and dedup, fp32, bf16 and fp16, token counts that differ between
ranks. (On CPU ranks the experts run the torch reference, which defers nothing: skipped there; the deferral's
semantics on CPU: tests/kernels/test_deferred_wgrad.py.)"""

from __future__ import annotations

import pytest
import torch
from test_collective_layer import DTYPES, FFN, HIDDEN, _placement, skip_without_transport

from occult import DenseMoE, OccultMoE


def _layer(ranks, transport: str, dispatcher: str, dtype: torch.dtype) -> OccultMoE:
    if ranks.device.type != "cuda":
        pytest.skip("the expert kernels, whose weight gradients are deferred, run on GPUs here")
    if transport == "device":
        skip_without_transport(ranks, "device")
    torch.manual_seed(ranks.seed + 53)
    E = 4 * ranks.world_size
    dense = DenseMoE(HIDDEN, FFN, E, 4, dtype=dtype, device=ranks.device)
    placement = _placement("random", E, ranks.world_size, ranks.seed)
    sync_free = transport == "sync_free"
    return OccultMoE.from_dense(
        dense,
        placement=placement,
        dispatcher=dispatcher,
        sync_free=sync_free,
        transport="counts" if sync_free else transport,
    )


def _grads(layer: OccultMoE, x: torch.Tensor, w: torch.Tensor, monkeypatch, defer: bool) -> dict[str, torch.Tensor]:
    monkeypatch.setenv("OCCULT_DEFER_WGRAD", "1" if defer else "0")
    x = x.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    (layer(x).float() * w).sum().backward()
    found = {name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}
    return {"x": x.grad.clone(), **found}


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("dispatcher", ["standard", "dedup"])
@pytest.mark.parametrize("transport", ["counts", "sync_free", "device"])
def test_deferred_weight_gradients_give_the_layers_gradients_bit_for_bit(
    ranks, monkeypatch, transport, dispatcher, dtype_name
):
    dtype = DTYPES[dtype_name]
    layer = _layer(ranks, transport, dispatcher, dtype)
    tokens = 96 if transport == "sync_free" else 96 + 13 * ranks.rank  # sync-free: the same count everywhere
    gen = torch.Generator(device=ranks.device).manual_seed(ranks.seed * 29 + ranks.rank)
    mismatched = 0
    for _ in range(2):
        x = torch.randn(tokens, HIDDEN, dtype=dtype, device=ranks.device, generator=gen)
        w = torch.randn(tokens, HIDDEN, device=ranks.device, generator=gen)
        want = _grads(layer, x, w, monkeypatch, defer=False)
        got = _grads(layer, x, w, monkeypatch, defer=True)
        assert got.keys() == want.keys(), (sorted(got), sorted(want))
        mismatched += sum(not torch.equal(got[k], want[k]) for k in want)
    assert ranks.all_max(float(mismatched)) == 0, (transport, dispatcher, dtype_name, mismatched)
