"""Paired micro-batches (combined 1F1B, `occult.training.accumulation`, issue 53) on one GPU: the model of
test_two_batch_train_one_gpu.py (blocks exchanging their rows over a one-rank NCCL group as an expert-parallel layer
does, a one-rank `OccultMoE` between them) accumulates three micro-batches with each next forward (its own thread
and stream) paired with the previous backward (whose exchanges' backward nodes run on autograd's device thread and
hand the turn over there). The eager step gives the gradients of the micro-batches in turn (bf16, fp16, fp32; with
the deferred weight gradients too), the exchanges go in the paired order, and the step recorded as one CUDA graph
(`StepGraph`) gives the eager steps' losses. Single-process GPU tests (tests/gpu/run.sh's second stage); the same
logic on CPU gloo ranks: tests/training/test_accumulation.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from micro_batch_helpers import exchange_events, paired_order
from test_two_batch_train_one_gpu import (
    DTYPES,
    TOKENS,
    TOL,
    WIDTH,
    _grads,
    _model,
    group,
    step_losses,
    worst_gradient_error,
)

from occult.training.accumulation import accumulate_backward

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="streams and NCCL need a GPU")
COUNT, PER_PASS = 3, 4  # micro-batches; exchanges a forward (two exchanging blocks, two each)
__all__ = ["group"]  # the module-scoped NCCL group fixture, shared with test_two_batch_train_one_gpu.py


@pytest.mark.parametrize("defer", [False, True], ids=["plain", "deferwgrad"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_paired_micro_batches_give_the_accumulated_gradients_in_the_paired_order(group, dtype_name, defer, monkeypatch):
    monkeypatch.setenv("OCCULT_DEFER_WGRAD", "1" if defer else "0")
    dtype = DTYPES[dtype_name]
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    model = _model(group, dtype, seed)
    micro = torch.randn(COUNT * TOKENS, WIDTH, dtype=dtype, device="cuda").chunk(COUNT)
    targets = torch.randn(COUNT * TOKENS, WIDTH, device="cuda").chunk(COUNT)

    def loss_of(m: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(m).float(), targets[next(i for i, part in enumerate(micro) if part is m)])

    want_loss = accumulate_backward(model, loss_of, micro)
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    with exchange_events() as events:
        loss = accumulate_backward(model, loss_of, micro, paired=True)
    torch.cuda.synchronize()
    assert worst_gradient_error(_grads(model), want) <= TOL[dtype_name], (dtype_name, seed)
    assert float(abs(loss - want_loss) / abs(want_loss)) <= 1e-5, (float(loss), float(want_loss), seed)
    assert events == paired_order(COUNT, PER_PASS), events


def _losses(model: nn.Module, batches: list[torch.Tensor], recorded: bool, paired: bool) -> list[float]:
    """`step_losses` of steps of COUNT accumulated micro-batches, in turn or paired."""
    return step_losses(
        model, batches, recorded, lambda loss_of, x: accumulate_backward(model, loss_of, x.chunk(COUNT), paired)
    )


@pytest.mark.parametrize("dtype_name", ["bf16", "fp32"])
def test_a_recorded_paired_step_gives_the_eager_steps_losses(group, dtype_name):
    dtype = DTYPES[dtype_name]
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    batches = [torch.randn(COUNT * TOKENS, WIDTH, dtype=dtype, device="cuda") for _ in range(9)]
    got = _losses(_model(group, dtype, seed), batches, recorded=True, paired=True)
    want = _losses(_model(group, dtype, seed), batches, recorded=False, paired=False)
    gap = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    assert gap <= (1e-3 if dtype_name == "bf16" else 1e-4), (dtype_name, gap, seed)
