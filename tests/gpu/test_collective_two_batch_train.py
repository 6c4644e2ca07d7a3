"""Two interleaved micro-batches in training (`occult.training.two_batch`, issue 53) over NCCL: two sync-free
expert-parallel layers (dedup over a random placement, and standard) between dense layers train the batch's two
halves in two threads on two streams; the eager step gives every gradient of two micro-batches one after the other
(fp32, bf16, fp16), every rank issues the backward's exchanges in the reverse of the forward's interleaved order,
and the step recorded as one CUDA graph (`StepGraph`) gives the eager steps' losses. Three micro-batches accumulated
paired (combined 1F1B, `occult.training.accumulation`) give the gradients of the three in turn, the exchanges in the
paired order on every rank. (The same on CPU gloo ranks: tests/training/test_two_batch_step.py and
test_accumulation.py; one GPU with one-rank exchanges: test_two_batch_train_one_gpu.py,
test_paired_accumulation_one_gpu.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from micro_batch_helpers import exchange_events, paired_order
from test_collective_layer import DTYPES, FFN, HIDDEN, _placement
from test_two_batch_train_one_gpu import _grads, two_batch_gradients, two_batch_losses, worst_gradient_error

from occult import DenseMoE, OccultMoE
from occult.training.accumulation import accumulate_backward

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


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("dispatcher", ["dedup", "standard"])
def test_two_interleaved_halves_give_two_micro_batches_gradients(ranks, dispatcher, dtype_name):
    dtype = DTYPES[dtype_name]
    gen = torch.Generator(device=ranks.device).manual_seed(ranks.seed * 31 + ranks.rank)
    x = torch.randn(2 * TOKENS, HIDDEN, dtype=dtype, device=ranks.device, generator=gen)
    target = torch.randn(2 * TOKENS, HIDDEN, device=ranks.device, generator=gen)
    worst, forwards, backwards = two_batch_gradients(_model(ranks, dispatcher, dtype), x, target)
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
    got = two_batch_losses(_model(ranks, "dedup", dtype), batches, recorded=True)
    want = two_batch_losses(_model(ranks, "dedup", dtype), batches, recorded=False)
    gap = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    assert ranks.all_max(gap) <= (1e-3 if dtype_name == "bf16" else 1e-4), (dtype_name, gap, ranks.seed)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("dispatcher", ["dedup", "standard"])
def test_paired_micro_batches_give_the_accumulated_gradients(ranks, dispatcher, dtype_name):
    dtype, count = DTYPES[dtype_name], 3
    model = _model(ranks, dispatcher, dtype)
    gen = torch.Generator(device=ranks.device).manual_seed(ranks.seed * 41 + ranks.rank)
    micro = torch.randn(count * TOKENS, HIDDEN, dtype=dtype, device=ranks.device, generator=gen).chunk(count)
    targets = torch.randn(count * TOKENS, HIDDEN, device=ranks.device, generator=gen).chunk(count)

    def loss_of(m: torch.Tensor) -> torch.Tensor:
        target = targets[next(i for i, part in enumerate(micro) if part is m)]
        return (model(m).float() - target).square().mean()

    accumulate_backward(model, loss_of, micro)
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    with exchange_events() as events:
        accumulate_backward(model, loss_of, micro, paired=True)
    worst = worst_gradient_error(_grads(model), want)
    assert ranks.all_max(worst) <= TOL[dtype_name], (dispatcher, dtype_name, worst, ranks.seed)
    assert events == paired_order(count, 4), events  # two layers, a dispatch and a combine each
