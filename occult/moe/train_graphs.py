"""A layer's training call (forward and backward) replayed from two CUDA graphs (`ExecConfig(graphs=True)`
under autograd).

Under autograd an eager expert-parallel layer call costs milliseconds of host time forward (route,
plan, pack, all-to-alls, experts, combine: ~100 launches and their Python), more than its GPU work:
in a training step the GPU waits for the host at every MoE layer. Where the layer does not wait for
the GPU (the device transport, the sync-free schedule, one rank), one call is recorded as two graphs,
as `torch.cuda.make_graphed_callables` does: the forward, and the backward of its output with respect
to its input and every parameter that trains. A training call then costs the host a copy in, one
launch and a copy out forward; the same backward.

What differs from the forward-only graphs of `occult.moe.graphs`:

- Each recorded call has a memory pool of its own: the forward's saved activations must live from its
  forward replay until its backward replay while every other layer replays in between. A layer keeps
  at most `occult.moe.graphs.MAX_TRAINING` of them (the least recently used go).
- The parameters' gradients come out of the backward graph into fixed tensors; autograd accumulates
  them into `.grad` as it would an eager call's (one copy per parameter a step).
- A recorded call serves one forward and then one backward at a time: a second forward while the
  first one's output still waits for its backward (activation recomputation, two micro-batches in
  flight) runs eagerly instead, so nothing is overwritten.
- The recording differentiates with respect to stand-ins of the parameters (new leaves on the same
  memory, put in the modules' place while the forward records), not the parameters themselves. The
  autograd engine runs a leaf's gradient on the stream its accumulator was made on, and a parameter's
  accumulator outlives the step that made it wherever that step's graph is still referenced (the
  previous step's loss, in `loss = model(x).loss; loss.backward()`): made on the default stream, it
  would join the default stream into the backward's capture, which CUDA refuses.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from occult.moe import status as pending
from occult.moe.capture_stream import autocast_uncached, capture_stream


@dataclass
class TrainingCall:
    """What a training call records besides its forward: the modules whose parameters train (every
    module whose parameters the forward reads), and how to read the transport's buffer generation (a
    recorded backward runs only on the buffers it recorded)."""

    modules: tuple[torch.nn.Module, ...]
    buffers: Callable[[], Any] = lambda: None
    params: tuple[torch.nn.Parameter, ...] | None = None  # `trainable(*modules)` where not given

    def __post_init__(self) -> None:
        if self.params is None:
            self.params = trainable(*self.modules)


@dataclass
class TrainingCapture:
    """One recorded training call: the forward and backward graphs, their fixed input and output
    tensors, the parameters whose gradients the backward writes, the routing statuses the forward
    writes and what the call left for the caller (`info`, with `snapshot()`)."""

    forward_graph: torch.cuda.CUDAGraph
    backward_graph: torch.cuda.CUDAGraph
    x_TH: torch.Tensor
    y_TH: torch.Tensor
    grad_y_TH: torch.Tensor
    params: tuple[torch.nn.Parameter, ...]
    grads: tuple[torch.Tensor | None, ...]  # the input's, then each parameter's (None: unused)
    statuses: list[torch.Tensor]
    info: Any
    buffers: Callable[[], Any]  # the transport's buffer generation now (the capture's is `generation`)
    generation: Any
    waiting: Any = field(default=None)  # a weak reference to the output whose backward is still due

    def busy(self) -> bool:
        """Whether an earlier forward's output still waits for its backward (a replay would overwrite it)."""
        return self.waiting is not None and self.waiting() is not None

    def replay(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, Any]:
        y_TH = _ReplayTraining.apply(self, x_TH, *self.params)
        self.waiting = weakref.ref(y_TH)
        for status_D in self.statuses:
            pending.queue(status_D)
        return y_TH, self.info.snapshot()


class _ReplayTraining(torch.autograd.Function):
    """The recorded forward as one autograd node; its backward replays the recorded backward."""

    @staticmethod
    def forward(ctx, capture: TrainingCapture, x_TH: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.capture = capture
        capture.x_TH.copy_(x_TH)
        capture.forward_graph.replay()
        return capture.y_TH.clone()

    @staticmethod
    def backward(ctx, grad_y_TH: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        capture: TrainingCapture = ctx.capture
        if capture.buffers() != capture.generation:
            raise RuntimeError(
                "the device transport's buffers were replaced between this MoE layer call's forward and its "
                "backward (a later call needed more room), so its recorded backward cannot run: run one "
                "step at the largest token count before training with ExecConfig(graphs=True), or set "
                "graphs=False"
            )
        capture.grad_y_TH.copy_(grad_y_TH)
        capture.backward_graph.replay()
        capture.waiting = None
        grad_x_TH, *grad_params = capture.grads
        return (None, None if grad_x_TH is None else grad_x_TH.clone(), *grad_params)


def trainable(*modules: torch.nn.Module) -> tuple[torch.nn.Parameter, ...]:
    """The parameters of `modules` that train (require a gradient), in a fixed order, each once."""
    seen: dict[int, torch.nn.Parameter] = {}
    for module in modules:
        for p in module.parameters():
            if p.requires_grad:
                seen.setdefault(id(p), p)
    return tuple(seen.values())


def capture_training(
    x_TH: torch.Tensor,
    call: TrainingCall,
    forward: Callable[[torch.Tensor], torch.Tensor],
    info: Callable[[], Any],
) -> TrainingCapture:
    """Record `forward` on a copy of `x_TH` and the backward of its output (with respect to that copy
    where `x_TH` requires a gradient, and to `call.params`), into a memory pool of their own. Nothing runs:
    the caller replays the forward for this call (`TrainingCapture.replay`)."""
    params = call.params
    static_x = x_TH.detach().clone().requires_grad_(x_TH.requires_grad)
    mempool = torch.cuda.graph_pool_handle()
    stream = capture_stream(x_TH.device)  # its BLAS workspaces outside every pool (occult.moe.capture_stream)
    forward_graph, backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with stand_ins(call.modules) as stand_in, autocast_uncached():  # (autocast's cache: occult.moe.capture_stream)
        with pending.recording() as statuses, torch.cuda.graph(forward_graph, pool=mempool, stream=stream):
            static_y = forward(static_x)
    check_reaches_no_parameter(static_y, params)
    wrt = ([static_x] if x_TH.requires_grad else []) + [stand_in[id(p)] for p in params]
    static_grad_y = torch.empty_like(static_y)
    with autocast_uncached(), torch.cuda.graph(backward_graph, pool=mempool, stream=stream):
        found = torch.autograd.grad(static_y, wrt, grad_outputs=static_grad_y, allow_unused=True)
    grads = ((found[0],) if x_TH.requires_grad else (None,)) + tuple(found[len(wrt) - len(params) :])
    return TrainingCapture(
        forward_graph,
        backward_graph,
        static_x,
        static_y.detach(),
        static_grad_y,
        params,
        grads,
        statuses,
        info(),
        call.buffers,
        call.buffers(),
    )


@contextlib.contextmanager
def stand_ins(modules: tuple[torch.nn.Module, ...]) -> Iterator[dict[int, torch.nn.Parameter]]:
    """Every trained parameter of `modules` replaced, where each module holds it, by a new leaf on the
    same memory (one per parameter, however often it is held); the originals back on exit. Yields the
    stand-in of each parameter, by `id` of the original."""
    stand_in: dict[int, torch.nn.Parameter] = {}
    replaced: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []
    try:
        for module in modules:
            for owner in module.modules():
                for name, p in list(owner.named_parameters(recurse=False)):
                    if p.requires_grad:
                        new = stand_in.setdefault(id(p), torch.nn.Parameter(p.detach(), requires_grad=True))
                        setattr(owner, name, new)
                        replaced.append((owner, name, p))
        yield stand_in
    finally:
        for owner, name, p in reversed(replaced):
            setattr(owner, name, p)


def check_reaches_no_parameter(y: torch.Tensor, params: tuple[torch.nn.Parameter, ...]) -> None:
    """Raise where the recorded forward read a trained parameter itself rather than its stand-in (a
    reference held outside the modules): its gradient would be lost from the recorded backward."""
    originals = {id(p) for p in params}
    seen, todo = set(), [y.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if id(getattr(node, "variable", None)) in originals:
            raise RuntimeError(
                "a recorded MoE training call read a parameter that its modules do not hold (a reference "
                "kept elsewhere), so its recorded backward would leave that gradient out: set "
                "ExecConfig(train_graphs=False)"
            )
        todo.extend(next_node for next_node, _ in node.next_functions)
