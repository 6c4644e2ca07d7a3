"""`occult.moe.host_time`: a layer call's host time named in profiles, forward and backward, one range each
per call, and no hook left on tensors outside a profile."""

from __future__ import annotations

import random

import torch

from occult import OccultMoE
from occult.moe.host_time import BACKWARD, FORWARD
from occult.training.step_profile import median_busy_ms, moe_host_ms


def test_each_call_is_one_forward_and_one_backward_range_while_profiling():
    torch.manual_seed(random.randrange(2**31))
    layers = [OccultMoE(16, 8, 4, 2, dtype=torch.float32) for _ in range(2)]
    x = torch.randn(random.randrange(1, 20), 16, requires_grad=True)
    calls = random.randrange(1, 4)
    with torch.profiler.profile() as prof:
        for _ in range(calls):
            h = x
            for layer in layers:
                h = h + layer(h)
            h.sum().backward()
    found = {a.key: a.count for a in prof.key_averages() if a.key in (FORWARD, BACKWARD)}
    assert found == {FORWARD: 2 * calls, BACKWARD: 2 * calls}, found
    summary = moe_host_ms(prof.events(), calls)
    assert summary["forward"] > 0 and summary["backward"] > 0 and summary["forward_calls_per_step"] == 2


def test_a_call_counts_its_host_time_less_its_waits_for_the_gpu_on_its_own_thread():
    # (thread, start us, end us): three calls on thread 1; waits on threads 1 and 2 (another thread's
    # wait, e.g. the autograd engine's, is not this call's)
    calls = [(1, 0.0, 1000.0), (1, 2000.0, 2500.0), (1, 3000.0, 6000.0)]
    waits = [(1, 200.0, 700.0), (1, 1500.0, 2100.0), (2, 3000.0, 5000.0), (1, 5500.0, 6500.0)]
    # busy ms: 1.0 - 0.5 = 0.5; 0.5 - 0.1 = 0.4; 3.0 - 0.5 = 2.5 -> median 0.5
    assert median_busy_ms(calls, waits) == 0.5
    assert median_busy_ms(calls, []) == 1.0
    assert median_busy_ms([], waits) is None


def test_no_backward_range_without_a_profile_or_an_input_gradient():
    layer = OccultMoE(16, 8, 4, 2, dtype=torch.float32)
    x = torch.randn(5, 16, requires_grad=True)
    y = layer(x * 1.0)
    assert not y._backward_hooks  # not profiling: nothing registered
    with torch.profiler.profile() as prof:
        y = layer(torch.randn(5, 16))  # the input takes no gradient: no range that would never close
        y.sum().backward()
    found = {a.key for a in prof.key_averages()}
    assert FORWARD in found and BACKWARD not in found
