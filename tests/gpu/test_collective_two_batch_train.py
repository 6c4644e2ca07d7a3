"""Two interleaved micro-batches in training (`occult.training.two_batch`, issue 53) over NCCL: two sync-free
expert-parallel layers (dedup over a random placement, and standard) between dense layers train the batch's two
halves in two threads on two streams; the eager step gives every gradient of two micro-batches one after the other
(fp32, bf16, fp16), every rank issues the backward's exchanges in the reverse of the forward's interleaved order,
and the step recorded as one CUDA graph (`StepGraph`) gives the eager steps' losses. (The same on CPU gloo ranks:
tests/training/test_two_batch_step.py; one GPU with one-rank exchanges: test_two_batch_train_one_gpu.py.)"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_collective_layer import DTYPES, FFN, HIDDEN, _placement

from occult import DenseMoE, OccultMoE
from occult.moe import comm
from occult.training.step_graph import WARMUP_STEPS, CudaRecorder, StepGraph, make_capturable
from occult.training.two_batch import interleaved_backward

TOL = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 5e-3}  # gradients, relative to each tensor's largest entry
TOKENS = 96


def _model(ranks, dispatcher: str, dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(ranks.seed + 59)
    E = 4 * ranks.world_size
    blocks: list[nn.Module] = []
    for i in range(2):
        blocks.append(nn.Linear(HIDDEN, HIDDEN, dtype=dtype, device=ranks.device))
        dense = DenseMoE(HIDDEN, FFN, E, 4, dtype=dtype, device=ranks.device)
        placement = _placement("random", E, ranks.world_size, ranks.seed + i)
        blocks.append(OccultMoE.from_dense(dense, placement=placement, dispatcher=dispatcher, sync_free=True))
    return nn.Sequential(*blocks)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.float().clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("dispatcher", ["dedup", "standard"])
def test_two_interleaved_halves_give_two_micro_batches_gradients(ranks, dispatcher, dtype_name):
    dtype = DTYPES[dtype_name]
    model = _model(ranks, dispatcher, dtype)
    gen = torch.Generator(device=ranks.device).manual_seed(ranks.seed * 31 + ranks.rank)
    x = torch.randn(2 * TOKENS, HIDDEN, dtype=dtype, device=ranks.device, generator=gen)
    target = torch.randn(2 * TOKENS, HIDDEN, device=ranks.device, generator=gen)
    halves = x.chunk(2)

    def loss_of(half: torch.Tensor) -> torch.Tensor:
        i = 0 if half is halves[0] else 1
        return F.mse_loss(model(half).float(), target.chunk(2)[i])

    for half in halves:
        (loss_of(half) / 2).backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    forwards: list[str] = []
    backwards: list[int] = []
    forward, backward = comm._Exchange.forward, comm._Exchange.backward

    def logged_forward(ctx, *args):
        ctx.index = len(forwards)
        forwards.append(threading.current_thread().name[-1])
        return forward(ctx, *args)

    def logged_backward(ctx, *grads):
        backwards.append(ctx.index)
        return backward(ctx, *grads)

    comm._Exchange.forward, comm._Exchange.backward = staticmethod(logged_forward), staticmethod(logged_backward)
    try:
        interleaved_backward(model, loss_of, halves)
    finally:
        comm._Exchange.forward, comm._Exchange.backward = staticmethod(forward), staticmethod(backward)
    got = _grads(model)
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    worst = max(float((got[k] - v).abs().max() / v.abs().max().clamp_min(1e-30)) for k, v in want.items())
    assert ranks.all_max(worst) <= TOL[dtype_name], (dispatcher, dtype_name, worst, ranks.seed)
    assert forwards == ["A", "B"] * 4, forwards  # two layers: A's dispatch, B's, A's combine, B's, ...
    assert backwards == list(range(len(forwards) - 1, -1, -1)), backwards


@pytest.mark.parametrize("dtype_name", ["bf16", "fp32"])
def test_a_recorded_two_batch_step_gives_the_eager_steps_losses(ranks, dtype_name):
    if ranks.backend != "nccl":
        pytest.skip("a CUDA graph cannot hold gloo's collectives: NCCL ranks only")
    dtype = DTYPES[dtype_name]
    gen = torch.Generator(device=ranks.device).manual_seed(ranks.seed * 37 + ranks.rank)
    batches = [torch.randn(2 * TOKENS, HIDDEN, dtype=dtype, device=ranks.device, generator=gen) for _ in range(9)]
    losses = {}
    for recorded in (True, False):
        model = _model(ranks, "dedup", dtype)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        make_capturable(optimizer)  # both sides: the recording's AdamW (its fp32 bias corrections on the GPU)

        def body(x_TH: torch.Tensor, model=model, optimizer=optimizer) -> tuple[torch.Tensor]:
            optimizer.zero_grad(set_to_none=True)
            loss = interleaved_backward(model, lambda h: model(h).float().sub(1).square().mean(), x_TH.chunk(2))
            optimizer.step()
            return (loss,)

        if recorded:
            graph = StepGraph(optimizer, lambda: 0, CudaRecorder(ranks.device))
            losses[recorded] = [float(graph.run(body, x)[0]) for x in batches]
            assert graph.replays == len(batches) - WARMUP_STEPS
            graph.release()
        else:
            losses[recorded] = [float(body(x)[0]) for x in batches]
    gap = max(abs(a - b) / abs(b) for a, b in zip(losses[True], losses[False]))
    assert ranks.all_max(gap) <= (1e-3 if dtype_name == "bf16" else 1e-4), (dtype_name, gap, ranks.seed)
