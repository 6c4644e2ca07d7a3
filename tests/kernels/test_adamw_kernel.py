"""`occult.training.optim.AdamW` through `occult.kernels.adamw` against torch's AdamW: the same update, the same
state, torch's step where the kernel does not apply, the step hooks once. Without a GPU the kernel runs under
Triton's CPU interpreter (tests/kernels/_triton_interpreter.py); on a GPU compiled (and
tests/gpu/test_fused_adamw_one_gpu.py adds the captured step)."""

from __future__ import annotations

import copy

import pytest
import torch

# first: Triton's CPU interpreter without a GPU, or this file in a fresh process (test_in_subprocess)
from _triton_interpreter import DEVICE, IN_PROCESS, needs_in_process, run_file_in_fresh_process

HYPER = {"lr": 0.05, "betas": (0.9, 0.95), "eps": 1e-8}  # large steps: a wrong update or decay shows
SHAPES = [(33, 7), (50,), (3, 5, 4), (0,)]  # not multiples of the block; an empty tensor


@pytest.fixture(autouse=True)
def _every_tensor_through_the_kernel(monkeypatch):
    """On a GPU tensors below `min_numel` go to torch's kernel; these small ones are to test occult's."""
    if IN_PROCESS:
        from occult.kernels import adamw as kernel

        monkeypatch.setattr(kernel, "min_numel", lambda: 0)


def _seeded() -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))


def _params(start, dtype):
    return [torch.nn.Parameter(t.to(dtype).clone()) for t in start]


def _groups(params, **extra):
    return [{"params": params[:2], "weight_decay": 0.1, **extra}, {"params": params[2:], "maximize": True}]


def _step_both(opts, params_of, grads):
    for opt, params in zip(opts, params_of):
        for p, g in zip(params, grads):
            p.grad = None if g is None else torch.empty_like(p).copy_(g)  # the parameter's layout, as autograd's
        opt.step()


def _fp32_pair(gen: torch.Generator):
    """fp32 parameters of SHAPES from one random start: occult's AdamW over one copy, torch's for-each the other."""
    from occult.training.optim import AdamW

    start = [torch.randn(s, device=DEVICE, generator=gen) for s in SHAPES]
    ours, ref = _params(start, torch.float32), _params(start, torch.float32)
    return (
        ours,
        ref,
        [AdamW(_groups(ours), fused=True, **HYPER), torch.optim.AdamW(_groups(ref), foreach=False, **HYPER)],
    )


def _counting_kernel(monkeypatch):
    from occult.kernels import adamw as kernel

    calls = []
    real = kernel.adamw_update_
    monkeypatch.setattr(
        kernel, "adamw_update_", lambda *a, **k: (calls.extend(p.shape for p in a[0]), real(*a, **k))[1]
    )
    return calls


@needs_in_process
def test_fp32_steps_are_torch_adamw_steps(monkeypatch):

    calls = _counting_kernel(monkeypatch)
    gen = _seeded()
    ours, ref, opts = _fp32_pair(gen)
    for i in range(4):
        grads = [torch.randn(s, device=DEVICE, generator=gen) for s in SHAPES]
        grads[1] = None if i == 2 else grads[1]  # a parameter without a gradient this step is left alone
        _step_both(opts, (ours, ref), grads)
    assert len(calls) == 4 * len(SHAPES) - 1
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(ours, ref):
        sa, sb = opts[0].state[a], opts[1].state[b]
        assert sa["step"].item() == sb["step"].item() and sa["step"].dtype == torch.float32
        torch.testing.assert_close(sa["exp_avg_sq"], sb["exp_avg_sq"], rtol=1e-5, atol=1e-9)


@needs_in_process
def test_small_tensors_take_torchs_multi_tensor_kernel(monkeypatch):
    """Below `min_numel` elements a tensor steps through torch's fused kernel (one launch for all), the rest
    through occult's: the same update either way, every step count advanced once."""
    from occult.kernels import adamw as kernel

    monkeypatch.setattr(kernel, "min_numel", lambda: 100)
    calls = _counting_kernel(monkeypatch)
    gen = _seeded()
    ours, ref, opts = _fp32_pair(gen)
    for _ in range(3):
        _step_both(opts, (ours, ref), [torch.randn(s, device=DEVICE, generator=gen) for s in SHAPES])
    assert calls == [torch.Size((33, 7))] * 3
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert opts[0].state[a]["step"].item() == 3


@needs_in_process
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_steps_follow_adamw_in_fp32(dtype):
    from occult.training.optim import AdamW

    gen = _seeded()
    start = [torch.randn(s, device=DEVICE, generator=gen) for s in SHAPES]
    ours, ref = _params(start, dtype), _params(start, torch.float32)
    opts = [AdamW(_groups(ours), fused=True, **HYPER), torch.optim.AdamW(_groups(ref), foreach=False, **HYPER)]
    steps = 5
    for _ in range(steps):
        _step_both(opts, (ours, ref), [torch.randn(s, device=DEVICE, generator=gen) for s in SHAPES])
    assert all(p.dtype == dtype and opts[0].state[p]["exp_avg"].dtype == dtype for p in ours)
    # the parameter rounded after every step, the moments kept in half precision (each update off by about a unit
    # in their last place of lr); twice bf16's unit: the interpreter truncates where a GPU rounds
    unit = 2**-7 if dtype == torch.bfloat16 else 2**-10
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.float(), b, rtol=steps * unit, atol=steps * HYPER["lr"] * 2 * unit)


@needs_in_process
def test_learning_rate_tensor_and_state_dict_round_trip():
    """A tensor rate (as a captured step fills it) is read on the device; the state is torch's fused layout, so
    torch's AdamW continues from it exactly where occult's would."""

    gen = _seeded()
    ours, ref, opts = _fp32_pair(gen)
    for group in opts[0].param_groups:
        group["lr"] = torch.tensor(HYPER["lr"], device=DEVICE)
    for lr in (0.05, 0.02):
        for group in opts[0].param_groups:
            group["lr"].fill_(lr)
        for group in opts[1].param_groups:
            group["lr"] = lr
        _step_both(opts, (ours, ref), [torch.randn(s, device=DEVICE, generator=gen) for s in SHAPES])
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    resumed = _params([p.detach() for p in ours], torch.float32)
    torch_resumed = torch.optim.AdamW(_groups(resumed), foreach=False, **HYPER)
    state = copy.deepcopy(opts[0].state_dict())  # as a checkpoint holds it (not the live moments)
    for group in state["param_groups"]:
        group["lr"] = 0.02
    torch_resumed.load_state_dict(state)
    grads = [torch.randn(s, device=DEVICE, generator=gen) for s in SHAPES]
    _step_both([opts[0], torch_resumed], (ours, resumed), grads)
    for a, b in zip(ours, resumed):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@needs_in_process
def test_groups_the_kernel_does_not_take_step_as_torch_and_hooks_run_once(monkeypatch):
    """amsgrad, an unfused group and a non-contiguous parameter take torch's step (the kernel is not called for
    them); the step's hooks run once a step, even with torch's own AdamW class patched by an instance of it."""
    from occult.training.optim import AdamW

    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # torch patches its class's step with its hooks
    calls = _counting_kernel(monkeypatch)
    gen = _seeded()
    start = [torch.randn(s, device=DEVICE, generator=gen) for s in [(6, 4), (5,), (4, 6), (3,)]]
    ours, ref = _params(start, torch.float32), _params(start, torch.float32)
    ours[2] = torch.nn.Parameter(start[2].t().contiguous().t().clone())  # (4, 6) values, non-contiguous layout

    def groups(params, fused):
        return [
            {"params": params[:1], "fused": fused},
            {"params": params[1:2], "amsgrad": True, "fused": fused},
            {"params": params[2:3], "fused": fused},
            {"params": params[3:], "fused": False},
        ]

    opts = [AdamW(groups(ours, True), **HYPER), torch.optim.AdamW(groups(ref, False), foreach=False, **HYPER)]
    seen = []
    opts[0].register_step_pre_hook(lambda *_: seen.append("pre"))
    opts[0].register_step_post_hook(lambda *_: seen.append("post"))
    for _ in range(3):
        _step_both(opts, (ours, ref), [torch.randn(t.shape, device=DEVICE, generator=gen) for t in start])
    assert seen == ["pre", "post"] * 3
    assert calls == [torch.Size((6, 4))] * 3
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@needs_in_process
def test_a_step_count_the_kernel_cannot_read_takes_torchs_step(monkeypatch):
    """A step count kept as another dtype (a state loaded from elsewhere): torch's step reads it, not the kernel
    (which reads an fp32 count on the parameters' device)."""
    calls = _counting_kernel(monkeypatch)
    gen = _seeded()
    ours, ref, opts = _fp32_pair(gen)
    _step_both(opts, (ours, ref), [torch.randn(s, device=DEVICE, generator=gen) for s in SHAPES])
    assert len(calls) == len(SHAPES)
    for p in ours[:2]:
        opts[0].state[p]["step"] = opts[0].state[p]["step"].double()
    _step_both(opts, (ours, ref), [torch.randn(s, device=DEVICE, generator=gen) for s in SHAPES])
    assert len(calls) == 2 * len(SHAPES) - 2  # the first group (its two parameters) took torch's step
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@needs_in_process
def test_fsdp2_shards_step_through_their_local_tensors(monkeypatch):
    """A one-rank FSDP2 model's DTensor parameters: the kernel updates their local shards in place, and the steps
    are torch's AdamW's on the unsharded model."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from occult.distributed import free_port
    from occult.training.optim import AdamW

    calls = _counting_kernel(monkeypatch)
    backend = "nccl" if DEVICE == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        gen = _seeded()
        plain = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(DEVICE)
        sharded = copy.deepcopy(plain)
        fully_shard(sharded)
        x, y = (torch.randn(16, n, device=DEVICE, generator=gen) for n in (32, 8))
        opts = [AdamW(list(sharded.parameters()), fused=True, **HYPER), torch.optim.AdamW(plain.parameters(), **HYPER)]
        for _ in range(3):
            for model, opt in zip((sharded, plain), opts):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
        assert len(calls) == 3 * 4
        # atol 2e-3 lr: the two models' gradients differ by rounding, which Adam's m / sqrt(v) magnifies where a
        # gradient is near zero (5e-6 seen); a wrong update (decay, bias correction) is off by ~lr * 0.1 a step
        for a, b in zip(sharded.parameters(), plain.parameters()):
            torch.testing.assert_close(a.full_tensor(), b, rtol=1e-5, atol=1e-4)
    finally:
        dist.destroy_process_group()


@needs_in_process
def test_bad_input_is_refused():
    from occult.kernels.adamw import adamw_update_
    from occult.training.optim import AdamW

    with pytest.raises(ValueError, match="differentiable"):
        AdamW([torch.nn.Parameter(torch.zeros(2))], differentiable=True)
    p, one = torch.zeros(4, device=DEVICE), torch.ones((), device=DEVICE)
    hyper = {"lr": 0.1, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.0}
    with pytest.raises(ValueError, match="contiguous tensors of one shape"):
        adamw_update_([p], [torch.zeros(5, device=DEVICE)], [p.clone()], [p.clone()], [one], **hyper)
    with pytest.raises(ValueError, match="contiguous tensors of one shape"):
        adamw_update_([p], [p.clone()], [p.clone()], [p.clone().half()], [one], **hyper)
    with pytest.raises(ValueError, match="per parameter"):
        adamw_update_([p], [p.clone()], [p.clone()], [], [one], **hyper)
    assert torch.equal(p, torch.zeros(4, device=DEVICE))  # nothing written


def test_in_subprocess():
    if IN_PROCESS:
        pytest.skip("ran in this process")
    run_file_in_fresh_process(__file__)
