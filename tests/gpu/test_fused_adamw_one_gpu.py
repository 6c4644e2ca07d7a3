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
        # atol 2e-3 lr: the two models' gradients differ by rounding, which Adam's m / sqrt(v) magnifies where a
        # gradient is near zero (5e-6 seen); a wrong update (decay, bias correction) is off by ~lr * 0.1 a step
        for a, b in zip(sharded.parameters(), plain.parameters()):
            torch.testing.assert_close(a.full_tensor(), b, rtol=1e-5, atol=1e-4)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_occult_kernel_steps_as_torch_fused(dtype, monkeypatch):
    """`adamw`'s CUDA groups step through occult's kernel (every parameter once a step), and its steps are torch's
    fused AdamW's: fp32 to rounding, half precision to a unit in the last place a step."""
    from occult.kernels import adamw as kernel

    monkeypatch.setattr(kernel, "min_numel", lambda: 0)  # every tensor through occult's kernel
    calls = []
    real = kernel.adamw_update_
    monkeypatch.setattr(kernel, "adamw_update_", lambda *a, **k: (calls.extend(a[0]), real(*a, **k))[1])
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    shapes = [(1000, 33), (4097,), (7, 5, 3)]
    start = [torch.randn(s, device="cuda", generator=gen).to(dtype) for s in shapes]
    ours, ref = ([torch.nn.Parameter(t.clone()) for t in start] for _ in range(2))
    hyper = {"lr": 0.05, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    opts = [adamw([{"params": ours}], **hyper), torch.optim.AdamW(ref, fused=True, **hyper)]
    steps = 5
    for _ in range(steps):
        grads = [torch.randn(s, device="cuda", generator=gen).to(dtype) for s in shapes]
        for params, opt in zip((ours, ref), opts):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
    assert len(calls) == steps * len(shapes)
    unit = {torch.float32: 1e-6, torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.float(), b.float(), rtol=steps * unit, atol=steps * hyper["lr"] * unit)


def test_a_captured_kernel_step_replays_the_eager_steps():
    """`make_capturable` then one CUDA graph of `step()`: replays with new gradients and rates (`set_lr`) give the
    eager steps' parameters bit for bit (the same kernels on the same values): a tensor of `min_numel` elements
    through occult's kernel, a small one through torch's."""
    from occult.training.step_graph import make_capturable, set_lr

    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    from occult.kernels.adamw import min_numel

    shapes = [(min_numel() // 1024, 1024), (96,)]
    start = [torch.randn(s, device="cuda", generator=gen, dtype=torch.bfloat16) for s in shapes]
    graphed, eager = ([torch.nn.Parameter(t.clone()) for t in start] for _ in range(2))
    opts = [adamw([{"params": graphed}], lr=0.05, weight_decay=0.1), adamw([{"params": eager}], lr=0.05)]
    opts[1].param_groups[0]["weight_decay"] = 0.1
    for opt in opts:
        make_capturable(opt)

    def grads():
        return [torch.randn(s, device="cuda", generator=gen, dtype=torch.bfloat16) for s in shapes]

    for p, g in zip(graphed, grads()):
        p.grad = g
    for p, q in zip(eager, graphed):
        p.grad = q.grad.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the warm-up step, as torch.cuda.graphs' recipe has it
        opts[0].step()
    torch.cuda.current_stream().wait_stream(side)
    opts[1].step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opts[0].step()
    for lr in (0.05, 0.01, 0.03):
        for p, q, g in zip(graphed, eager, grads()):
            p.grad.copy_(g)
            q.grad = g.clone()
        for opt in opts:
            set_lr(opt, lr)
        graph.replay()
        opts[1].step()
    torch.cuda.synchronize()
    for a, b in zip(graphed, eager):
        assert torch.equal(a, b)
    assert opts[0].state[graphed[0]]["step"].item() == opts[1].state[eager[0]]["step"].item() == 4


def test_a_recorded_step_takes_occult_kernel_down_to_the_recorded_size(monkeypatch):
    """In a CUDA graph being recorded a tensor of `RECORDED_MIN_NUMEL` elements steps through occult's kernel (an
    eager step sends it to torch's), and the replayed updates are torch's fused AdamW's to a unit in the last place
    a step; a smaller one stays on torch's kernel."""
    from occult.kernels import adamw as kernel
    from occult.training.step_graph import make_capturable

    calls = []
    real = kernel.adamw_update_
    monkeypatch.setattr(kernel, "adamw_update_", lambda *a, **k: (calls.extend(a[0]), real(*a, **k))[1])
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    shapes = [(kernel.RECORDED_MIN_NUMEL // 512, 512), (kernel.RECORDED_MIN_NUMEL // 512 - 1, 512)]
    start = [torch.randn(s, device="cuda", generator=gen, dtype=torch.bfloat16) for s in shapes]
    graphed, ref = ([torch.nn.Parameter(t.clone()) for t in start] for _ in range(2))
    hyper = {"lr": 0.05, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    opt, ref_opt = adamw([{"params": graphed}], **hyper), torch.optim.AdamW(ref, fused=True, **hyper)
    make_capturable(opt)
    grads = [[torch.randn(s, device="cuda", generator=gen, dtype=torch.bfloat16) for s in shapes] for _ in range(4)]
    for p, q, g in zip(graphed, ref, grads[0]):
        p.grad, q.grad = g.clone(), g.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        opt.step()  # eager: both tensors on torch's kernel
    torch.cuda.current_stream().wait_stream(side)
    ref_opt.step()
    assert calls == []
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    assert len(calls) == 1 and calls[0] is graphed[0]
    for step_grads in grads[1:]:
        for p, q, g in zip(graphed, ref, step_grads):
            p.grad.copy_(g)
            q.grad = g.clone()
        graph.replay()
        ref_opt.step()
    torch.cuda.synchronize()
    unit = 2**-8
    for a, b in zip(graphed, ref):
        torch.testing.assert_close(a.float(), b.float(), rtol=4 * unit, atol=4 * hyper["lr"] * unit)
