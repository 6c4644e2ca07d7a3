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

- The recordings of one training step share a memory pool (`SharedPool`), as `make_graphed_callables`'
  graphs do: each forward is recorded at its call and its backward at its backward call, so they are
  recorded in the order they replay (layer 0 to N-1, then N-1 to 0), and the pool reuses memory as an
  eager step does: a forward's saved activations stay theirs from its forward to its backward, and the
  memory each call only needs while it runs (the expert kernels' capacity-sized intermediates) is one
  layer's, not one per layer (with a pool per recording, a 4-GPU OLMoE step held 88 GiB of such
  memory). A recording made after the step (a new signature later, a layer evicted and recorded again)
  cannot know where its replays will fall among the others', so it gets a pool of its own: the shared
  pool closes at the second replay of any of its forwards, or once every backward in it is recorded. (What
  this assumes: recordings made together replay together, in that order, as a model's steps do; two models
  whose steps interleave, one of them holding a recorded forward whose backward never ran, are not.) A
  layer keeps at most `occult.moe.graphs.MAX_TRAINING` recordings (the least recently used go).
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
import functools
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
class SharedPool:
    """A memory pool the training recordings of one step share (module docstring), open to new
    recordings until it closes."""

    handle: Any
    open: bool = True
    pending: int = 0  # forwards recorded in it whose backward is not yet

    def backward_recorded(self) -> None:
        self.pending -= 1
        if self.pending <= 0:
            self.open = False


_SHARED: dict[int, SharedPool] = {}  # device index -> the pool its next training recording joins


def shared_pool(device: torch.device) -> SharedPool:
    """The open shared pool of `device`, a new one where none is open."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    pool = _SHARED.get(index)
    if pool is None or not pool.open:
        pool = _SHARED[index] = SharedPool(torch.cuda.graph_pool_handle())
    return pool


@dataclass
class TrainingCapture:
    """One recorded training call: the forward and backward graphs (the backward recorded at its first
    backward call, `record_backward`), their fixed input and output tensors, the parameters whose gradients
    the backward writes, the routing statuses the forward writes and what the call left for the caller
    (`info`, with `snapshot()`)."""

    forward_graph: torch.cuda.CUDAGraph
    backward_graph: torch.cuda.CUDAGraph | None  # None until `record_backward` has run
    x_TH: torch.Tensor
    y_TH: torch.Tensor
    grad_y_TH: torch.Tensor | None
    params: tuple[torch.nn.Parameter, ...]
    grads: tuple[torch.Tensor | None, ...]  # the input's, then each parameter's (None: unused)
    statuses: list[torch.Tensor]
    info: Any
    buffers: Callable[[], Any]  # the transport's buffer generation now (the capture's is `generation`)
    generation: Any
    waiting: Any = field(default=None)  # a weak reference to the output whose backward is still due
    pool: SharedPool | None = None  # the pool shared with the step's other recordings
    record_backward: Callable[[], tuple[torch.cuda.CUDAGraph, torch.Tensor, tuple]] | None = None
    replays: int = 0  # forward replays so far

    def busy(self) -> bool:
        """Whether an earlier forward's output still waits for its backward (a replay would overwrite it)."""
        return self.waiting is not None and self.waiting() is not None

    def replay(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, Any]:
        self.replays += 1
        if self.replays > 1 and self.pool is not None:  # a later step: the recording step is over
            self.pool.open = False
        y_TH = _ReplayTraining.apply(self, x_TH, *self.params)
        self.waiting = weakref.ref(y_TH)
        for status_D in self.statuses:
            pending.queue(status_D)
        return y_TH, self.info.snapshot()

    def ensure_backward(self) -> None:
        """Record the backward graph where it is not yet (its first backward call)."""
        if self.backward_graph is None:
            assert self.record_backward is not None, "a training recording without a backward or a way to record it"
            self.backward_graph, self.grad_y_TH, self.grads = self.record_backward()
            self.record_backward = None  # (frees the forward's autograd graph: its saved tensors are the pool's)
            if self.pool is not None:
                self.pool.backward_recorded()


class _ReplayTraining(torch.autograd.Function):
    """The recorded forward as one autograd node; its backward replays the recorded backward."""

    @staticmethod
    def forward(ctx, capture: TrainingCapture, x_TH: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.capture = capture
        # through `.data`: the copy must not count as a change of the recorded forward's input, which its
        # autograd graph saved and checks when the backward is recorded (`TrainingCapture.ensure_backward`)
        capture.x_TH.data.copy_(x_TH)
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
        capture.ensure_backward()
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
    """Record `forward` on a copy of `x_TH` into the step's shared pool (module docstring); the backward of
    its output (with respect to that copy where `x_TH` requires a gradient, and to `call.params`) is
    recorded at its first backward call. Nothing runs: the caller replays the forward for this call
    (`TrainingCapture.replay`)."""
    params = call.params
    static_x = x_TH.detach().clone().requires_grad_(x_TH.requires_grad)
    pool = shared_pool(x_TH.device)
    stream = capture_stream(x_TH.device)  # its BLAS workspaces outside every pool (occult.moe.capture_stream)
    forward_graph = torch.cuda.CUDAGraph()
    with stand_ins(call.modules) as stand_in, autocast_uncached():  # (autocast's cache: occult.moe.capture_stream)
        with pending.recording() as statuses, torch.cuda.graph(forward_graph, pool=pool.handle, stream=stream):
            static_y = forward(static_x)
    pool.pending += 1
    check_reaches_no_parameter(static_y, params)
    wrt = ([static_x] if x_TH.requires_grad else []) + [stand_in[id(p)] for p in params]
    return TrainingCapture(
        forward_graph,
        None,
        static_x,
        static_y.detach(),
        None,
        params,
        (),
        statuses,
        info(),
        call.buffers,
        call.buffers(),
        pool=pool,
        record_backward=functools.partial(
            record_backward, static_y, wrt, len(params), x_TH.requires_grad, pool, stream
        ),
    )


def record_backward(
    static_y: torch.Tensor,
    wrt: list[torch.Tensor],
    num_params: int,
    input_grad: bool,
    pool: SharedPool,
    stream: torch.cuda.Stream,
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, tuple[torch.Tensor | None, ...]]:
    """The backward of a recorded forward's output `static_y` with respect to `wrt` (the input's copy where
    `input_grad`, then the parameters' stand-ins) as a graph, in the shared pool while it is open, else in a
    pool of its own: (graph, its fixed output-gradient input, the gradients it writes: the input's, then
    each parameter's). Runs on the autograd engine's thread at the call's first backward."""
    graph = torch.cuda.CUDAGraph()
    static_grad_y = torch.empty_like(static_y)
    handle = pool.handle if pool.open else torch.cuda.graph_pool_handle()
    with autocast_uncached(), torch.cuda.graph(graph, pool=handle, stream=stream):
        found = torch.autograd.grad(static_y, wrt, grad_outputs=static_grad_y, allow_unused=True)
    grads = ((found[0],) if input_grad else (None,)) + tuple(found[len(wrt) - num_params :])
    return graph, static_grad_y, grads


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
