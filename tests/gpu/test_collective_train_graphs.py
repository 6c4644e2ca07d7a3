"""`ExecConfig(graphs=True, train_graphs=True)` under autograd on every GPU over NCCL
(`occult.moe.train_graphs`): a layer's training calls, forward and backward, replayed from its CUDA
graphs give the outputs and the gradients (input, router, experts) of the same layer run eagerly over
the count exchange, step after step with the weights updated in place between steps, in fp32, bf16 and
fp16; a second forward before the first one's backward runs eagerly (both gradients right); gradients
accumulate over steps; hooks on the layer turn its replays off; frozen experts get no gradient."""

from __future__ import annotations

import pytest
import torch
from test_collective_layer import DTYPES, HIDDEN, _rel
from test_collective_layer_graphs import _layers as layer_pair
from test_kernels_real_shapes import _poison_free_memory

from occult import OccultMoE
from occult.moe.graphs import EAGER_CALLS

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}  # relative L2, output and gradients


def _layers(ranks, transport: str, dtype: torch.dtype, salt: int, dispatcher: str = "dedup"):
    """(the layer replaying training calls over `transport`, the same weights eager over the count exchange)."""
    return layer_pair(ranks, transport, dtype, salt, dispatcher, train_graphs=True)


def _step(
    layer: OccultMoE, x: torch.Tensor, w: torch.Tensor, poison: bool = False
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One training call: output, and the gradients of sum(y * w) for the input and every parameter
    (`poison`: the allocator's free memory set to NaN before the forward and before the backward)."""
    x = x.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    if poison:
        _poison_free_memory(x.device)
    y = layer(x)
    if poison:
        _poison_free_memory(x.device)
    (y.float() * w).sum().backward()
    grads = {name: p.grad for name, p in layer.named_parameters() if p.grad is not None}
    return y.detach(), {"x": x.grad, **grads}


def _worst(ranks, graphed, eager, x, w, poison: bool = False) -> float:
    y, grads = _step(graphed, x, w, poison)
    y_ref, grads_ref = _step(eager, x, w)
    assert grads.keys() == grads_ref.keys(), (sorted(grads), sorted(grads_ref))
    return max([_rel(y, y_ref)] + [_rel(grads[k], grads_ref[k]) for k in grads_ref])


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("dispatcher", ["standard", "dedup"])
@pytest.mark.parametrize("transport", ["device", "sync_free"])
def test_replayed_training_calls_match_the_eager_layer(ranks, transport, dispatcher, dtype_name):
    dtype = DTYPES[dtype_name]
    graphed, eager = _layers(ranks, transport, dtype, 31, dispatcher)
    tokens = 96 if transport == "sync_free" else 96 + 13 * ranks.rank  # sync-free: the same count everywhere
    gen = torch.Generator(device=ranks.device).manual_seed(ranks.seed * 17 + ranks.rank)
    worst = 0.0
    for step in range(EAGER_CALLS + 4):
        x = torch.randn(tokens, HIDDEN, dtype=dtype, device=ranks.device, generator=gen)
        w = torch.randn(tokens, HIDDEN, device=ranks.device, generator=gen)
        worst = max(worst, _worst(ranks, graphed, eager, x, w))
        assert len(graphed.graphs) == (0 if step < EAGER_CALLS else 1), (step, len(graphed.graphs))
        with torch.no_grad():  # an optimizer's in-place update, the same on both layers
            for a, b in zip(graphed.parameters(), eager.parameters()):
                a.mul_(0.9)
                b.mul_(0.9)
    assert ranks.all_max(worst) <= TOL[dtype], (transport, dispatcher, dtype_name, worst)


@pytest.mark.parametrize("transport", ["device", "sync_free"])
def test_replayed_training_calls_never_read_memory_they_did_not_write(ranks, transport):
    """As above (bf16, dedup) with NaN in every free block of the allocator before each forward (the
    recording's included) and each backward: a training step after other models trained in the process
    went NaN in e2e.py (docs/training.md, "Layer graphs in training")."""
    graphed, eager = _layers(ranks, transport, torch.bfloat16, 37)
    tokens = 96 if transport == "sync_free" else 96 + 13 * ranks.rank
    gen = torch.Generator(device=ranks.device).manual_seed(ranks.seed * 19 + ranks.rank)
    worst = 0.0
    for _ in range(EAGER_CALLS + 3):
        x = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16, device=ranks.device, generator=gen)
        w = torch.randn(tokens, HIDDEN, device=ranks.device, generator=gen)
        worst = max(worst, _worst(ranks, graphed, eager, x, w, poison=True))
    assert ranks.all_max(worst) <= TOL[torch.bfloat16], (transport, worst)


def test_a_second_forward_before_the_first_backward_runs_eagerly(ranks):
    graphed, eager = _layers(ranks, "device", torch.float32, 32)
    gen = torch.Generator(device=ranks.device).manual_seed(ranks.seed * 19 + ranks.rank)

    def batch():
        return torch.randn(80 + 7 * ranks.rank, HIDDEN, device=ranks.device, generator=gen)

    for _ in range(EAGER_CALLS + 1):  # the signature is recorded
        _step(graphed, batch(), batch())
    worst = 0.0
    x1, x2, w1, w2 = batch(), batch(), batch(), batch()
    grads = {}
    for layer in (graphed, eager):
        a, b = x1.clone().requires_grad_(True), x2.clone().requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        y1, y2 = layer(a), layer(b)  # two micro-batches in flight: the second may not overwrite the first
        ((y1 * w1).sum() + (y2 * w2).sum()).backward()
        grads[id(layer)] = [a.grad, b.grad, *(p.grad for p in layer.parameters())]
    for g, g_ref in zip(grads[id(graphed)], grads[id(eager)]):
        worst = max(worst, _rel(g, g_ref))
    assert ranks.all_max(worst) <= TOL[torch.float32], worst


def test_hooks_turn_replays_off(ranks):
    graphed, eager = _layers(ranks, "device", torch.bfloat16, 33)
    seen = []
    graphed.router.register_forward_hook(lambda m, i, out: seen.append(out[1]))
    gen = torch.Generator(device=ranks.device).manual_seed(ranks.seed * 23 + ranks.rank)
    worst = 0.0
    for _ in range(EAGER_CALLS + 2):
        x = torch.randn(64, HIDDEN, dtype=torch.bfloat16, device=ranks.device, generator=gen)
        worst = max(worst, _worst(ranks, graphed, eager, x, torch.randn_like(x, dtype=torch.float32)))
    assert len(seen) == EAGER_CALLS + 2 and len(graphed.graphs) == 0
    assert ranks.all_max(worst) <= TOL[torch.bfloat16], worst


def test_frozen_experts_get_no_gradient(ranks):
    graphed, eager = _layers(ranks, "device", torch.float32, 34)
    for layer in (graphed, eager):
        layer.gate_up_proj.requires_grad_(False)
        layer.down_proj.requires_grad_(False)
    gen = torch.Generator(device=ranks.device).manual_seed(ranks.seed * 29 + ranks.rank)
    worst = 0.0
    for _ in range(EAGER_CALLS + 2):
        x = torch.randn(72, HIDDEN, device=ranks.device, generator=gen)
        worst = max(worst, _worst(ranks, graphed, eager, x, torch.randn_like(x)))
        assert graphed.gate_up_proj.grad is None and graphed.down_proj.grad is None
    assert len(graphed.graphs) == 1
    assert ranks.all_max(worst) <= TOL[torch.float32], worst


def test_gradients_accumulate_over_two_replayed_steps(ranks):
    """Two backward passes without zeroing (gradient accumulation): each parameter's gradient is the sum,
    not the last replay's (the recorded gradients are copied into `.grad`, never handed over)."""
    graphed, eager = _layers(ranks, "device", torch.float32, 35)
    gen = torch.Generator(device=ranks.device).manual_seed(ranks.seed * 31 + ranks.rank)

    def batch():
        return torch.randn(88 + 5 * ranks.rank, HIDDEN, device=ranks.device, generator=gen)

    for _ in range(EAGER_CALLS + 1):
        _step(graphed, batch(), batch())
    xs = [(batch(), batch()) for _ in range(2)]
    grads = {}
    for layer in (graphed, eager):
        layer.zero_grad(set_to_none=True)
        for x, w in xs:
            (layer(x.clone().requires_grad_(True)) * w).sum().backward()
        grads[id(layer)] = [p.grad.clone() for p in layer.parameters()]
    worst = max(_rel(g, g_ref) for g, g_ref in zip(grads[id(graphed)], grads[id(eager)]))
    assert len(graphed.graphs) == 1
    assert ranks.all_max(worst) <= TOL[torch.float32], worst


def test_a_step_records_while_the_previous_steps_loss_is_still_referenced(ranks):
    """`loss = f(x); loss.backward()` in a loop: when a call is recorded, the previous step's graph (and
    the parameters' gradient accumulators it made on the default stream) is still alive; the recorded
    backward must not join the default stream (the whole-model failure of session 10) and its gradients
    must stay right."""
    graphed, eager = _layers(ranks, "device", torch.bfloat16, 36)
    gen = torch.Generator(device=ranks.device).manual_seed(ranks.seed * 37 + ranks.rank)
    losses, worst = {}, 0.0
    for _ in range(EAGER_CALLS + 3):
        x = torch.randn(64 + 3 * ranks.rank, HIDDEN, dtype=torch.bfloat16, device=ranks.device, generator=gen)
        w = torch.randn(x.shape, device=ranks.device, generator=gen)
        grads = {}
        for layer in (graphed, eager):
            layer.zero_grad(set_to_none=True)
            a = x.clone().requires_grad_(True)
            losses[id(layer)] = loss = (layer(a).float() * w).sum()  # kept until the next step's forward
            loss.backward()
            grads[id(layer)] = [a.grad, *(p.grad for p in layer.parameters())]
        worst = max(worst, *(_rel(g, r) for g, r in zip(grads[id(graphed)], grads[id(eager)])))
    assert len(graphed.graphs) == 1
    assert ranks.all_max(worst) <= TOL[torch.bfloat16], worst
