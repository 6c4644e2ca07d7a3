"""`occult.training.optim.adamw` on a GPU: CUDA parameter groups take AdamW's fused kernel, and its steps follow
AdamW's for-each path run in fp32 on the same gradients (fp32 parameters: to rounding; bf16 parameters: to a few
units in the last place, which the bf16 for-each path itself does not keep to). Weight decay in one group, several
large steps; FSDP2's sharded parameters (one rank) on the fused kernel too. Single-process GPU test
(tests/gpu/run.sh's second stage)."""

from __future__ import annotations

import copy

import pytest
import torch

from occult.training.optim import adamw, fusable

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused kernel runs on a GPU")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_groups_step_as_adamw_in_fp32(dtype):
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    shapes = [(64, 48), (48,), (7, 5, 3)]
    start = [torch.randn(s, device="cuda", generator=gen).to(dtype) for s in shapes]
    fused_params = [torch.nn.Parameter(t.clone()) for t in start]
    ref_params = [torch.nn.Parameter(t.float()) for t in start]
    assert fusable(fused_params)
    hyper = {"lr": 0.1, "betas": (0.9, 0.95), "eps": 1e-8}  # large steps: a wrong update or decay shows
    fused = adamw([{"params": fused_params[:2], "weight_decay": 0.1}, {"params": fused_params[2:]}], **hyper)
    ref = torch.optim.AdamW(
        [{"params": ref_params[:2], "weight_decay": 0.1}, {"params": ref_params[2:]}], foreach=True, **hyper
    )
    assert all(g["fused"] for g in fused.param_groups)
    steps = 5
    for _ in range(steps):
        grads = [torch.randn(s, device="cuda", generator=gen).to(dtype) for s in shapes]
        for params, opt in ((fused_params, fused), (ref_params, ref)):
            for p, g in zip(params, grads):
                p.grad = g.to(p.dtype)
            opt.step()
    # bf16: the parameter rounded after every step (half a unit in the last place, <= 2^-8 relative, each) and
    # the moments kept in bf16 (each update off by ~2^-8 of lr); fp32: rounding only
    if dtype == torch.bfloat16:
        tol = {"rtol": steps * 2**-8, "atol": steps * hyper["lr"] * 2**-7}
    else:
        tol = {"rtol": 1e-5, "atol": 1e-6}
    for a, b in zip(fused_params, ref_params):
        torch.testing.assert_close(a.float(), b, **tol)


def test_fsdp2_shards_take_the_fused_kernel():
    """A one-rank FSDP2 model's DTensor parameters: fused groups, and the steps of the unsharded model's."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from occult.distributed import free_port

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
        plain = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).cuda()
        sharded = copy.deepcopy(plain)
        fully_shard(sharded)
        x, y = torch.randn(16, 32, device="cuda"), torch.randn(16, 8, device="cuda")
        hyper = {"lr": 0.05, "weight_decay": 0.1}
        opts = [adamw([{"params": list(m.parameters())}], **hyper) for m in (sharded, plain)]
        assert fusable(sharded.parameters()) and all(g["fused"] for opt in opts for g in opt.param_groups)
        for _ in range(4):
            for m, opt in zip((sharded, plain), opts):
                opt.zero_grad()
                torch.nn.functional.mse_loss(m(x), y).backward()
                opt.step()
        for a, b in zip(sharded.parameters(), plain.parameters()):
            torch.testing.assert_close(a.full_tensor(), b, rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group()
