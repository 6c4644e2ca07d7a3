"""Training calls replayed from recorded graphs (`occult.moe.train_graphs`) on CPU: the autograd node
around the replays, with the two CUDA graphs stood in by functions that compute into the recorded
tensors as a replay would. Its gradients are those of the function (input and parameters), they
accumulate over backward passes instead of aliasing the recorded ones, a forward while the last output
waits for its backward runs eagerly, a backward on replaced transport buffers raises; the backward
recorded at the first backward call, and the life of the pool a step's recordings share; `has_hooks`.
(The CUDA graphs themselves: tests/gpu/test_collective_train_graphs.py.)"""

from __future__ import annotations

import pytest
import torch

from occult import CommStats
from occult.moe import train_graphs
from occult.moe.graphs import GraphCache, has_hooks
from occult.moe.train_graphs import (
    SharedPool,
    TrainingCall,
    TrainingCapture,
    check_reaches_no_parameter,
    stand_ins,
)


def holding(w: torch.nn.Parameter) -> torch.nn.Module:
    """A module whose one parameter is `w`."""
    module = torch.nn.Module()
    module.w = w
    return module


class Replays:
    """A stand-in graph: `replay()` runs `fn`."""

    def __init__(self, fn) -> None:
        self.fn, self.count = fn, 0

    def replay(self) -> None:
        self.count += 1
        self.fn()


def stood_in_capture(
    x_TH: torch.Tensor, w_HH: torch.nn.Parameter, generation=lambda: 0, pool: SharedPool | None = None
) -> TrainingCapture:
    """y = tanh(x @ w), recorded: forward and backward write the fixed tensors, as replays do. With `pool`,
    recorded as `capture_training` records: the backward at the first backward call, in `pool`."""
    static_x, static_y, grad_y = torch.zeros_like(x_TH), torch.zeros_like(x_TH), torch.zeros_like(x_TH)
    grad_x, grad_w = torch.zeros_like(x_TH), torch.zeros_like(w_HH)

    def forward():
        static_y.copy_(torch.tanh(static_x @ w_HH.detach()))

    def backward():
        pre = grad_y * (1 - static_y**2)
        grad_x.copy_(pre @ w_HH.detach().T)
        grad_w.copy_(static_x.T @ pre)

    if pool is None:
        return TrainingCapture(
            Replays(forward),
            Replays(backward),
            static_x,
            static_y,
            grad_y,
            (w_HH,),
            (grad_x, grad_w),
            [],
            CommStats(),
            generation,
            generation(),
        )
    pool.pending += 1
    recorded = []

    def record():
        recorded.append(pool.open)  # whether this backward went into the shared pool
        return Replays(backward), grad_y, (grad_x, grad_w)

    capture = deferred_capture(forward, static_x, static_y, w_HH, record, pool, generation)
    capture.recorded = recorded
    return capture


def deferred_capture(forward, static_x, static_y, w, record, pool, generation=lambda: 0) -> TrainingCapture:
    """A recording whose backward `record()` makes at its first backward call, as `capture_training`'s."""
    return TrainingCapture(
        Replays(forward), None, static_x, static_y, None, (w,), (), [], CommStats(), generation, generation(),
        pool=pool, record_backward=record,
    )  # fmt: skip


def reference(x_TH, w_HH, grad_y):
    x = x_TH.clone().requires_grad_(True)
    w = w_HH.detach().clone().requires_grad_(True)
    torch.tanh(x @ w).backward(grad_y)
    return x.grad, w.grad


def test_a_replayed_training_call_has_the_functions_gradients_and_they_accumulate():
    H = 6
    w = torch.nn.Parameter(torch.randn(H, H, dtype=torch.float64))
    x0 = torch.randn(5, H, dtype=torch.float64)
    capture = stood_in_capture(x0, w)
    expected_w = torch.zeros_like(w)
    for _ in range(2):  # two backward passes without zeroing: .grad is their sum, not the last one
        x = torch.randn(5, H, dtype=torch.float64, requires_grad=True)
        grad_y = torch.randn(5, H, dtype=torch.float64)
        y, _ = capture.replay(x)
        torch.testing.assert_close(y, torch.tanh(x.detach() @ w.detach()))
        y.backward(grad_y)
        ref_x, ref_w = reference(x.detach(), w, grad_y)
        torch.testing.assert_close(x.grad, ref_x)
        expected_w += ref_w
        torch.testing.assert_close(w.grad, expected_w)
    assert w.grad.data_ptr() != capture.grads[1].data_ptr()  # never the recorded tensor itself


def test_the_output_is_a_copy_and_busy_until_its_backward():
    w = torch.nn.Parameter(torch.randn(4, 4))
    capture = stood_in_capture(torch.zeros(3, 4), w)
    y, _ = capture.replay(torch.randn(3, 4, requires_grad=True))
    assert y.data_ptr() != capture.y_TH.data_ptr() and capture.busy()
    y.sum().backward()
    assert not capture.busy()
    y2, _ = capture.replay(torch.randn(3, 4, requires_grad=True))
    assert capture.busy()
    del y2  # dropped without a backward: nothing waits for it any more
    assert not capture.busy()


def test_a_busy_recording_makes_the_next_call_of_its_signature_eager():
    w = torch.nn.Parameter(torch.randn(4, 4))

    class Cache(GraphCache):
        def _capture_training(self, x_TH, training, forward, info):
            return stood_in_capture(x_TH, training.params[0])

    cache, eager_calls = Cache(eager_calls=0), []

    def forward(x):
        eager_calls.append(1)
        return torch.tanh(x @ w)

    call = TrainingCall((holding(w),))
    x1, x2 = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    y1, _ = cache.run("k", 0, x1, forward, CommStats, call)  # recorded, replayed
    y2, _ = cache.run("k", 0, x2, forward, CommStats, call)  # y1 still waits: eager
    assert len(eager_calls) == 1 and len(cache) == 1
    (y1.sum() + y2.sum()).backward()
    ref1, ref_w1 = reference(x1.detach(), w, torch.ones(3, 4))
    ref2, ref_w2 = reference(x2.detach(), w, torch.ones(3, 4))
    torch.testing.assert_close(x1.grad, ref1)
    torch.testing.assert_close(x2.grad, ref2)
    torch.testing.assert_close(w.grad, ref_w1 + ref_w2)


def test_a_backward_after_the_transport_buffers_were_replaced_raises():
    w = torch.nn.Parameter(torch.randn(4, 4))
    generation = [0]
    capture = stood_in_capture(torch.zeros(2, 4), w, lambda: generation[0])
    y, _ = capture.replay(torch.randn(2, 4, requires_grad=True))
    generation[0] = 1  # a later call grew the transport
    with pytest.raises(RuntimeError, match="buffers were replaced between this MoE layer call's forward"):
        y.sum().backward()


def test_has_hooks_sees_hooks_on_any_submodule():
    block = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert not has_hooks(block)
    handle = block[1][0].register_forward_hook(lambda m, i, o: None)
    assert has_hooks(block)
    handle.remove()
    handle = block.register_forward_pre_hook(lambda m, i: None)
    assert has_hooks(block)
    handle.remove()
    assert not has_hooks(block)


def test_a_layer_keeps_at_most_max_training_recordings():
    """Each training recording holds a memory pool: past MAX_TRAINING signatures the least recently used go."""
    from occult.moe.graphs import MAX_TRAINING

    w = torch.nn.Parameter(torch.randn(4, 4))

    class Cache(GraphCache):
        def _capture_training(self, x_TH, training, forward, info):
            return stood_in_capture(x_TH, training.params[0])

    cache = Cache(eager_calls=0)
    for tokens in range(1, MAX_TRAINING + 3):
        y, _ = cache.run(
            tokens, 0, torch.randn(tokens, 4, requires_grad=True), torch.tanh, CommStats, TrainingCall((holding(w),))
        )
        y.sum().backward()
    assert list(cache._graphs) == list(range(3, MAX_TRAINING + 3))


def test_stand_ins_replace_every_hold_of_a_parameter_on_its_memory_and_put_the_originals_back():
    shared = torch.nn.Linear(3, 3)
    frozen = torch.nn.Linear(3, 3).requires_grad_(False)
    outer = torch.nn.Sequential(shared, frozen)
    gate = torch.nn.Module()
    gate.weight = shared.weight  # the same parameter held by a second module (a tied weight)
    weight, bias, frozen_weight = shared.weight, shared.bias, frozen.weight
    with pytest.raises(ValueError, match="inside"):
        with stand_ins((outer, gate)) as stand_in:
            assert set(stand_in) == {id(weight), id(bias)}  # frozen parameters stay
            assert shared.weight is gate.weight is stand_in[id(weight)]  # one stand-in however often held
            assert shared.bias is stand_in[id(bias)] and frozen.weight is frozen_weight
            for original, new in ((weight, shared.weight), (bias, shared.bias)):
                assert new is not original and new.data_ptr() == original.data_ptr()  # the same memory
                assert new.requires_grad and new.grad_fn is None
            raise ValueError("inside")  # an error while recording: the originals are back all the same
    assert shared.weight is weight and gate.weight is weight and shared.bias is bias


def test_gradients_through_stand_ins_are_the_parameters_and_reach_no_earlier_accumulator():
    """The previous step's graph (its loss still referenced) holds the parameter's gradient accumulator;
    a forward recorded on stand-ins never reaches it, and has the parameter's gradients."""
    layer = torch.nn.Linear(4, 4, dtype=torch.float64)
    x = torch.randn(5, 4, dtype=torch.float64)
    previous_loss = layer(x).sum()
    previous_loss.backward()  # its nodes, and the parameters' accumulators, live on with previous_loss
    params = tuple(layer.parameters())
    with stand_ins((layer,)) as stand_in:
        y = torch.tanh(layer(x))
    check_reaches_no_parameter(y, params)
    grads = torch.autograd.grad(y.sum(), [stand_in[id(p)] for p in params])
    reference = [p.detach().clone().requires_grad_(True) for p in params]
    expected = torch.autograd.grad(torch.tanh(torch.nn.functional.linear(x, *reference)).sum(), reference)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)
    assert previous_loss.grad_fn is not None


def test_a_recorded_forward_that_reads_a_parameter_around_its_modules_raises():
    layer = torch.nn.Linear(4, 4)
    kept = layer.weight  # a reference held outside the module: the stand-in does not replace it
    with stand_ins((layer,)):
        y = torch.nn.functional.linear(torch.randn(2, 4), kept) + layer.bias
    with pytest.raises(RuntimeError, match="read a parameter that its modules do not hold"):
        check_reaches_no_parameter(y, tuple(layer.parameters()))


def test_the_backward_is_recorded_once_at_the_first_backward_call_and_gives_the_gradients():
    H = 5
    w = torch.nn.Parameter(torch.randn(H, H, dtype=torch.float64))
    pool = SharedPool(handle=None)
    capture = stood_in_capture(torch.zeros(3, H, dtype=torch.float64), w, pool=pool)
    for step in range(3):
        w.grad = None
        x = torch.randn(3, H, dtype=torch.float64, requires_grad=True)
        grad_y = torch.randn(3, H, dtype=torch.float64)
        y, _ = capture.replay(x)
        assert capture.backward_graph is None if step == 0 else capture.backward_graph.count == step
        y.backward(grad_y)
        ref_x, ref_w = reference(x.detach(), w, grad_y)
        torch.testing.assert_close(x.grad, ref_x)
        torch.testing.assert_close(w.grad, ref_w)
    assert capture.recorded == [True] and capture.record_backward is None and capture.backward_graph.count == 3


def test_a_steps_recordings_share_the_pool_until_every_backward_is_recorded():
    """Forwards of layers 0..2 recorded in order, then their backwards 2..0: all in the shared pool, which
    then closes (a recording after the step cannot know where its replays fall)."""
    pool = SharedPool(handle=None)
    weights = [torch.nn.Parameter(torch.randn(4, 4, dtype=torch.float64)) for _ in range(3)]
    captures = [stood_in_capture(torch.zeros(2, 4, dtype=torch.float64), w, pool=pool) for w in weights]
    y = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    for capture in captures:
        y, _ = capture.replay(y)
    assert pool.open and pool.pending == 3
    y.sum().backward()
    assert [c.recorded for c in captures] == [[True]] * 3  # the last one recorded while the pool was still open
    assert not pool.open and pool.pending == 0


def test_the_shared_pool_closes_at_a_second_forward_replay_and_a_late_backward_gets_its_own():
    pool = SharedPool(handle=None)
    w = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
    first, second = (stood_in_capture(torch.zeros(2, 4, dtype=torch.float64), w, pool=pool) for _ in range(2))
    y1, _ = first.replay(torch.randn(2, 4, dtype=torch.float64, requires_grad=True))
    y1.sum().backward()
    assert pool.open  # `second` still waits for its backward
    y1, _ = first.replay(torch.randn(2, 4, dtype=torch.float64, requires_grad=True))  # the next step
    assert not pool.open
    y2, _ = second.replay(torch.randn(2, 4, dtype=torch.float64, requires_grad=True))
    y2.sum().backward()
    assert first.recorded == [True] and second.recorded == [False]


def test_a_recording_joins_the_open_pool_and_a_closed_one_is_replaced(monkeypatch):
    handles = iter(range(100))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (next(handles), 0))
    monkeypatch.setattr(train_graphs, "_SHARED", {})
    device = torch.device("cuda", 0)
    a = train_graphs.shared_pool(device)
    assert train_graphs.shared_pool(device) is a
    a.open = False
    b = train_graphs.shared_pool(device)
    assert b is not a and b.open and b.handle != a.handle
    assert train_graphs.shared_pool(torch.device("cuda", 1)) is not b  # one per device


def test_a_replays_copy_into_the_recorded_input_leaves_its_saved_graph_usable_for_the_backward_recording():
    """The forward's autograd graph saved the input copy (a view of it); the replays write into that copy before
    the backward is recorded from the graph, which must not see it as modified in place."""
    w = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
    static_x = torch.zeros(3, 4, dtype=torch.float64, requires_grad=True)
    graph_y = torch.tanh(static_x.view(3, 4) @ w)  # saves a view of static_x, as the recorded layers do
    static_y, grad_y = graph_y.detach().clone(), torch.zeros(3, 4, dtype=torch.float64)
    grad_x, grad_w = torch.zeros(3, 4, dtype=torch.float64), torch.zeros(4, 4, dtype=torch.float64)

    def forward():
        static_y.copy_(torch.tanh(static_x.detach() @ w.detach()))

    def record():
        torch.autograd.grad(graph_y, [static_x, w], grad_outputs=grad_y)  # raises if the input counts as modified

        def backward():
            pre = grad_y * (1 - static_y**2)
            grad_x.copy_(pre @ w.detach().T)
            grad_w.copy_(static_x.detach().T @ pre)

        return Replays(backward), grad_y, (grad_x, grad_w)

    capture = deferred_capture(forward, static_x, static_y, w, record, SharedPool(handle=None, pending=1))
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    y, _ = capture.replay(x)
    y.sum().backward()
    ref_x, ref_w = reference(x.detach(), w, torch.ones(3, 4, dtype=torch.float64))
    torch.testing.assert_close(x.grad, ref_x)
    torch.testing.assert_close(w.grad, ref_w)
