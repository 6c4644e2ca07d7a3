"""Two interleaved micro-batches in training (`occult.training.two_batch`, issue 53) on one GPU: a model whose
blocks exchange their rows over a one-rank NCCL group as an expert-parallel layer does (`occult.moe.comm.exchange`,
the turn handed over after each), with a one-rank `OccultMoE` (Triton kernels) between them, trains its two halves
in two threads on two streams. The eager step gives the gradients of two micro-batches one after the other (bf16,
fp16, fp32), its backward issues the exchanges in the reverse of the forward's interleaved order, and the step
recorded as one CUDA graph (`StepGraph`, the halves' streams forked and joined inside the recording) gives the
losses of the eager steps, also with each half under bf16 autocast. Single-process GPU tests (tests/gpu/run.sh's
second stage); the same over several NCCL ranks with sync-free expert-parallel layers:
tests/gpu/test_collective_two_batch_train.py."""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from occult.distributed import free_port
from occult.moe import comm
from occult.moe.comm import CommStats
from occult.moe.dense import DenseMoE
from occult.moe.layer import OccultMoE
from occult.moe.two_batch import exchange_issued
from occult.training.step_graph import WARMUP_STEPS, CudaRecorder, StepGraph, make_capturable
from occult.training.two_batch import interleaved_backward

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="two streams and NCCL need a GPU")
WIDTH, TOKENS = 256, 512
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOL = {"bf16": 2e-2, "fp16": 5e-3, "fp32": 1e-5}  # gradients, relative to each tensor's largest entry


@pytest.fixture(scope="module")
def group():
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


class _Exchanging(nn.Module):
    """x + W2 silu(exchange(W1 x)), its output exchanged again: two all-to-alls a call, the turn handed over after
    each, as an expert-parallel layer's dispatch and combine."""

    def __init__(self, group, dtype: torch.dtype) -> None:
        super().__init__()
        self.group = group
        self.up = nn.Linear(WIDTH, 2 * WIDTH, dtype=dtype, device="cuda")
        self.down = nn.Linear(2 * WIDTH, WIDTH, dtype=dtype, device="cuda")

    def _exchange(self, rows: torch.Tensor) -> torch.Tensor:
        n = rows.shape[0]
        state = types.SimpleNamespace(stats=CommStats(), rank=0)
        out, _, _ = comm.exchange(rows, None, None, [n], [n], self.group, state)
        exchange_issued()
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self._exchange(self.up(x))
        return self._exchange(x + self.down(F.silu(h)))


def _model(group, dtype: torch.dtype, seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    moe = OccultMoE.from_dense(DenseMoE(WIDTH, 128, 8, 2, dtype=dtype, device="cuda"), group=None)
    return nn.Sequential(_Exchanging(group, dtype), moe, _Exchanging(group, dtype))


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.float().clone() for name, p in model.named_parameters() if p.grad is not None}


@contextlib.contextmanager
def exchange_log() -> Iterator[tuple[list[str], list[int]]]:
    """Inside: (the half, "A" or "B", that issued each `_Exchange` forward; which exchange, by its forward's index,
    each `_Exchange` backward was), in call order."""
    forwards: list[str] = []
    backwards: list[int] = []
    forward, backward = comm._Exchange.forward, comm._Exchange.backward

    def logged_forward(ctx, *args):
        ctx.logged_index = len(forwards)
        forwards.append(threading.current_thread().name[-1])
        return forward(ctx, *args)

    def logged_backward(ctx, *grads):
        backwards.append(ctx.logged_index)
        return backward(ctx, *grads)

    comm._Exchange.forward, comm._Exchange.backward = staticmethod(logged_forward), staticmethod(logged_backward)
    try:
        yield forwards, backwards
    finally:
        comm._Exchange.forward, comm._Exchange.backward = staticmethod(forward), staticmethod(backward)


def worst_gradient_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest error over the gradients, each relative to its tensor's largest entry (same names required)."""
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    return max(float((got[k] - v).abs().max() / v.abs().max().clamp_min(1e-30)) for k, v in want.items())


def step_losses(
    model: nn.Module,
    batches: list[torch.Tensor],
    recorded: bool,
    backward_of: Callable[[Callable[[torch.Tensor], torch.Tensor], torch.Tensor], torch.Tensor],
    autocast: bool = False,
) -> list[float]:
    """Each batch's mean loss through a step whose loss and backward `backward_of(loss_of, x)` runs (returning the
    loss), with AdamW in its recording's mode (on both sides: its fp32 bias corrections on the GPU), recorded by
    `StepGraph` after its warm-up steps, or every step eager. `autocast`: each loss under bf16 autocast, entered
    inside `loss_of` (as occult's trainers do)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    make_capturable(optimizer)

    def loss_of(h: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            return model(h).float().sub(1).square().mean()

    def body(x_TW: torch.Tensor) -> tuple[torch.Tensor]:
        optimizer.zero_grad(set_to_none=True)
        loss = backward_of(loss_of, x_TW)
        optimizer.step()
        return (loss,)

    if not recorded:
        return [float(body(x)[0]) for x in batches]
    graph = StepGraph(optimizer, lambda: 0, CudaRecorder(batches[0].device))
    losses = [float(graph.run(body, x)[0]) for x in batches]
    assert graph.replays == len(batches) - WARMUP_STEPS
    graph.release()
    return losses


def two_batch_losses(
    model: nn.Module, batches: list[torch.Tensor], recorded: bool, autocast: bool = False
) -> list[float]:
    """`step_losses` of two-batch steps (`interleaved_backward` over each batch's halves)."""
    return step_losses(
        model, batches, recorded, lambda loss_of, x: interleaved_backward(model, loss_of, x.chunk(2)), autocast
    )


def two_batch_gradients(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> tuple[float, list, list]:
    """Train `model` on the halves of x (MSE to `target`) as two micro-batches one after the other, then through
    `interleaved_backward`: (the worst relative gradient error between the two, the half that issued each forward
    exchange, the forward index of each backward exchange)."""
    halves, targets = x.chunk(2), target.chunk(2)

    def loss_of(half: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(half).float(), targets[0 if half is halves[0] else 1])

    model.zero_grad(set_to_none=True)
    for half in halves:
        (loss_of(half) / 2).backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    with exchange_log() as (forwards, backwards):
        interleaved_backward(model, loss_of, halves)
    return worst_gradient_error(_grads(model), want), forwards, backwards


@pytest.mark.parametrize("defer", [False, True], ids=["plain", "deferwgrad"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_two_halves_on_two_streams_give_two_micro_batches_gradients_in_reverse_exchange_order(
    group, dtype_name, defer, monkeypatch
):
    """`deferwgrad` (OCCULT_DEFER_WGRAD=1): both halves defer the experts' weight gradients to the one side stream,
    which adds them to `.grad` one after the other."""
    monkeypatch.setenv("OCCULT_DEFER_WGRAD", "1" if defer else "0")
    dtype = DTYPES[dtype_name]
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    x = torch.randn(2 * TOKENS, WIDTH, dtype=dtype, device="cuda")
    err, forwards, backwards = two_batch_gradients(
        _model(group, dtype, seed), x, torch.randn(2 * TOKENS, WIDTH, device="cuda")
    )
    assert err <= TOL[dtype_name], (dtype_name, err, seed)
    assert forwards == ["A", "B"] * 4, forwards  # two blocks, two exchanges each, the halves taking turns
    assert backwards == list(range(7, -1, -1)), backwards


@pytest.mark.parametrize("dtype_name", ["bf16", "fp32"])
def test_a_recorded_two_batch_step_gives_the_eager_steps_losses(group, dtype_name):
    dtype = DTYPES[dtype_name]
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    gen = torch.Generator(device="cuda").manual_seed(seed)
    batches = [torch.randn(2 * TOKENS, WIDTH, dtype=dtype, device="cuda", generator=gen) for _ in range(10)]
    got = two_batch_losses(_model(group, dtype, seed), batches, recorded=True)
    want = two_batch_losses(_model(group, dtype, seed), batches, recorded=False)
    gap = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    assert gap <= (1e-3 if dtype_name == "bf16" else 1e-4), (dtype_name, gap, seed, got, want)


def test_a_recorded_two_batch_step_under_autocast_gives_the_eager_steps_losses(group):
    """fp32 weights, each half's loss under bf16 autocast: the halves take turns inside one autocast region each, and
    autocast's cache of weight casts is one for the process, so before `occult.moe.two_batch` turned it off in a half,
    B used the casts A made on A's stream, which the recorded step may read before A writes them (NaN in
    `occult train --two-batch --captured-step`, session 25)."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    gen = torch.Generator(device="cuda").manual_seed(seed)
    batches = [torch.randn(2 * TOKENS, WIDTH, device="cuda", generator=gen) for _ in range(10)]
    got = two_batch_losses(_model(group, torch.float32, seed), batches, recorded=True, autocast=True)
    want = two_batch_losses(_model(group, torch.float32, seed), batches, recorded=False, autocast=True)
    gap = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    assert gap <= 1e-3, (gap, seed, got, want)
