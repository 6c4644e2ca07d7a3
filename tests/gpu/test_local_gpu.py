"""The one-rank schedule on a GPU (`occult.moe.local`): exact in half precision and fp32, no host
wait, and bad input still raised as `RoutingError`: one layer later or at `check_routing()`, and
at the end of a converted transformers model's forward, never as a device-side assert.

Single-process GPU tests (tests/gpu/run.sh's second stage).
"""

from __future__ import annotations

import random

import pytest
import torch

from occult import DenseMoE, OccultMoE, RoutingError, check_routing

DEV = "cuda"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dispatcher", ["dedup", "standard"])
def test_one_rank_matches_fp32_dense(dtype, dispatcher):
    """Per-token relative error against an fp32 reference holding the layer's own (rounded) weights and
    routing (SameRouting): median and p95 as the suite's other half-precision checks."""
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    dense = DenseMoE(256, 128, 16, 4, dtype=torch.float32, device=DEV)
    with torch.no_grad():
        dense.router.gate.weight.normal_(0, 1.0)  # well-separated choices
    layer = OccultMoE.from_dense(dense, dispatcher=dispatcher).to(dtype)
    ref_layer = layer.to_dense().float()
    ref_layer.router = SameRouting(layer.router, dtype)
    tol = (1e-2, 3e-2) if dtype != torch.float32 else (1e-5, 1e-4)
    for T in (1, 7, 300):  # the decode kernels and the grouped GEMMs
        x = torch.randn(T, 256, device=DEV).to(dtype)
        with torch.no_grad():
            ref = ref_layer(x.float())
            y = layer(x).float()
        err_T = (y - ref).norm(dim=1) / ref.norm(dim=1)
        med, p95 = err_T.median().item(), err_T.quantile(0.95).item()
        assert med < tol[0] and p95 < tol[1], (seed, T, med, p95)
    x = torch.randn(64, 256, device=DEV, dtype=dtype, requires_grad=True)
    layer(x).float().square().sum().backward()
    assert torch.isfinite(x.grad).all() and layer.gate_up_proj.grad is not None


class SameRouting(torch.nn.Module):
    """The layer's own router (its dtype) in the fp32 reference: both combine the same experts with
    the same weights, so the check sees the dispatch and the experts, not the router's half-precision
    logits (a bf16 logit of magnitude ~30 moves a softmax weight by several percent)."""

    def __init__(self, router: torch.nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.router, self.dtype = router, dtype

    def forward(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights_TK, ids_TK = self.router(x_TH.to(self.dtype))
        return weights_TK.float(), ids_TK


def test_bad_input_is_raised_one_layer_later_without_a_device_assert():
    layers = [OccultMoE(64, 32, 8, 2, dtype=torch.bfloat16, device=DEV) for _ in range(2)]
    x = torch.randn(10, 64, device=DEV, dtype=torch.bfloat16)
    bad = x.clone()
    bad[3, 5] = float("nan")
    y = layers[0](bad)  # queued: nothing waits for the status here
    with pytest.raises(RoutingError, match="router produced NaN"):
        layers[1](y)
    layers[0](x)
    with pytest.raises(RoutingError, match="NaN"):
        layers[1](bad)
        check_routing()
    check_routing()  # nothing pending now
    assert torch.isfinite(layers[1](layers[0](x))).all()
    torch.cuda.synchronize()


def test_converted_model_raises_at_the_end_of_its_forward():
    pytest.importorskip("transformers")
    from occult.integrations import hf

    model = hf.tiny_random_model("olmoe", seed=0, vocab_size=64).to(device=DEV, dtype=torch.bfloat16).eval()
    hf.convert(model, group=None)
    last = hf.moe_blocks(model)[-1][1]
    with torch.no_grad():
        last.gate.weight[0, 0] = float("nan")  # only the last MoE layer routes badly
        ids = torch.randint(64, (2, 9), device=DEV)
        with pytest.raises(RoutingError, match="NaN"):
            model(input_ids=ids)
    torch.cuda.synchronize()
