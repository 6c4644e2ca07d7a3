"""`occult.training.optim.adamw` on a GPU: CUDA parameter groups take AdamW's fused kernel, and its steps
match the for-each path's (bf16 and fp32 parameters, weight decay, several steps). Single-process GPU test
(tests/gpu/run.sh's second stage)."""

from __future__ import annotations

import pytest
import torch

from occult.training.optim import adamw, fusable

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused kernel runs on a GPU")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_groups_step_as_the_for_each_path(dtype):
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    shapes = [(64, 48), (48,), (7, 5, 3)]
    start = [torch.randn(s, device="cuda", generator=gen).to(dtype) for s in shapes]
    fused_params = [torch.nn.Parameter(t.clone()) for t in start]
    plain_params = [torch.nn.Parameter(t.clone()) for t in start]
    assert fusable(fused_params)
    hyper = {"lr": 0.1, "betas": (0.9, 0.95), "eps": 1e-8}  # large steps: a wrong update or decay shows
    fused = adamw([{"params": fused_params[:2], "weight_decay": 0.1}, {"params": fused_params[2:]}], **hyper)
    plain = torch.optim.AdamW(
        [{"params": plain_params[:2], "weight_decay": 0.1}, {"params": plain_params[2:]}], foreach=True, **hyper
    )
    assert all(g["fused"] for g in fused.param_groups)
    for _ in range(5):
        grads = [torch.randn(s, device="cuda", generator=gen).to(dtype) for s in shapes]
        for params, opt in ((fused_params, fused), (plain_params, plain)):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
    # bf16: two units in the last place (each path rounds its own fp32 math), fp32: rounding only
    tol = {"rtol": 2**-6, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
    for a, b in zip(fused_params, plain_params):
        torch.testing.assert_close(a, b, **tol)
