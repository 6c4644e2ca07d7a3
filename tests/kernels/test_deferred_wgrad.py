"""`OCCULT_DEFER_WGRAD=1` (`occult.kernels.deferred_wgrad`): the expert op's weight gradients computed apart from
its input gradient and added to `.grad` at the next deferral or the backward's end. Under Triton's CPU
interpreter there is no side stream, so these check the semantics: after `loss.backward()` every `.grad` equals
the op's without the setting, bit for bit (the same kernels on the same inputs), accumulation into an existing
`.grad`, weights cast for the kernels (autocast's bf16 copy of fp32 weights, here fp32 copies of fp64 leaves),
two ops in one backward, and the cases that must keep autograd's order: `torch.autograd.grad`,
`backward(inputs=...)`, a hook on a weight. (The side stream itself: tests/gpu/test_deferred_wgrad_one_gpu.py.)"""

from __future__ import annotations

import pytest
import torch

# first: Triton's CPU interpreter without a GPU, or this file in a fresh process (test_in_subprocess)
from _triton_interpreter import DEVICE, IN_PROCESS, needs_in_process, run_file_in_fresh_process

from occult import kernels

R, K, E, H, F = 24, 3, 4, 16, 8


def _inputs(seed: int, leaf_dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, H, generator=g).to(DEVICE).requires_grad_()
    slots = torch.randint(0, E, (R, K), generator=g)
    slots[torch.rand(R, K, generator=g) < 0.3] = -1
    gates = torch.rand(R, K, generator=g).to(DEVICE).requires_grad_()
    w1 = torch.nn.Parameter((torch.randn(E, 2 * F, H, generator=g) / H**0.5).to(DEVICE, leaf_dtype))
    w2 = torch.nn.Parameter((torch.randn(E, H, F, generator=g) / F**0.5).to(DEVICE, leaf_dtype))
    dy = torch.randn(R, H, generator=g).to(DEVICE)
    return x, slots.to(DEVICE), gates, w1, w2, dy


def _loss(x, slots, gates, w1, w2, dy) -> torch.Tensor:
    """fp64 weights are cast to x's fp32 inside the op, as autocast's bf16 x casts fp32 weights."""
    return (kernels.expert_mlp(x, slots, gates, w1, w2) * dy).sum()


def _grads(ins, monkeypatch, defer: bool, steps: int = 1) -> list[torch.Tensor]:
    monkeypatch.setenv("OCCULT_DEFER_WGRAD", "1" if defer else "0")
    x, slots, gates, w1, w2, dy = ins
    for t in (x, gates, w1, w2):
        t.grad = None
    for _ in range(steps):
        _loss(*ins).backward()
    return [t.grad.clone() for t in (x, gates, w1, w2)]


@needs_in_process
@pytest.mark.parametrize("leaf_dtype", [torch.float32, torch.float64])
def test_deferred_weight_gradients_are_the_ops_and_accumulate(monkeypatch, leaf_dtype):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    ins = _inputs(seed, leaf_dtype)
    calls = _spy(monkeypatch)
    for steps in (1, 2):  # the second: added to the first step's .grad, as autograd adds
        want = _grads(ins, monkeypatch, defer=False, steps=steps)
        assert not calls
        got = _grads(ins, monkeypatch, defer=True, steps=steps)
        assert len(calls) == steps
        calls.clear()
        for name, a, b in zip(("x", "gates", "gate_up", "down"), got, want):
            assert a.dtype == b.dtype and torch.equal(a, b), (seed, steps, name)


@needs_in_process
def test_the_weights_gradients_are_added_when_the_backward_ends(monkeypatch):
    """The op hands its weight gradients to `defer` (once per call) and returns none: inside the backward (a
    hook on the op's input, which runs after the op) the weights have no gradient yet; after it, they have."""
    calls = _spy(monkeypatch)
    monkeypatch.setenv("OCCULT_DEFER_WGRAD", "1")
    x, slots, gates, w1, w2, dy = _inputs(1)
    seen = []
    x.register_hook(lambda g: seen.append((w1.grad is None, w2.grad is None)) or g)
    _loss(x, slots, gates, w1, w2, dy).backward()
    assert calls == [1] and seen == [(True, True)] and w1.grad is not None and w2.grad is not None


def _spy(monkeypatch) -> list[int]:
    """Count `deferred_wgrad.defer` calls."""
    from occult.kernels import deferred_wgrad

    calls, defer = [], deferred_wgrad.defer
    monkeypatch.setattr(deferred_wgrad, "defer", lambda *a, **k: calls.append(1) or defer(*a, **k))
    return calls


@needs_in_process
def test_autograd_grad_inputs_and_hooks_keep_autograds_order(monkeypatch):
    """Where deferring is not what autograd would do, the weights' gradients come from the op itself."""
    ins = _inputs(2)
    x, slots, gates, w1, w2, dy = ins
    want = _grads(ins, monkeypatch, defer=False)
    calls = _spy(monkeypatch)
    monkeypatch.setenv("OCCULT_DEFER_WGRAD", "1")
    got = torch.autograd.grad(_loss(*ins), (x, gates, w1, w2))  # returns gradients, accumulates none
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    for t in (x, gates, w1, w2):
        t.grad = None
    _loss(*ins).backward(inputs=[x])  # the weights are not asked for: they get nothing
    assert torch.equal(x.grad, want[0]) and w1.grad is None and w2.grad is None
    x.grad = None
    hooked = []
    handle = w1.register_hook(lambda g: hooked.append(g) or g)  # a hook sees the gradient as autograd hands it
    _loss(*ins).backward()
    handle.remove()
    assert len(hooked) == 1 and torch.equal(hooked[0], want[2]) and torch.equal(w1.grad, want[2])
    assert torch.equal(w2.grad, want[3])
    assert calls == []  # none of the three deferred


@needs_in_process
def test_two_ops_in_one_backward_each_get_their_gradients(monkeypatch):
    """Two stacked ops: the second's deferral joins the first's (added to .grad mid-backward), the backward's
    end joins the second's; every gradient as without the setting."""
    calls = _spy(monkeypatch)
    first, second = _inputs(3), _inputs(4)
    x, slots, gates, w1, w2, dy = first
    _, slots_b, gates_b, w1_b, w2_b, _ = second

    def run(defer: bool) -> list[torch.Tensor]:
        monkeypatch.setenv("OCCULT_DEFER_WGRAD", "1" if defer else "0")
        for t in (x, gates, w1, w2, gates_b, w1_b, w2_b):
            t.grad = None
        y = kernels.expert_mlp(x, slots, gates, w1, w2)
        (kernels.expert_mlp(y, slots_b, gates_b, w1_b, w2_b) * dy).sum().backward()
        return [t.grad.clone() for t in (x, gates, w1, w2, gates_b, w1_b, w2_b)]

    want = run(defer=False)
    got = run(defer=True)
    assert len(calls) == 2 and all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.skipif(IN_PROCESS, reason="kernels already tested in this process")
def test_in_subprocess():
    run_file_in_fresh_process(__file__)
