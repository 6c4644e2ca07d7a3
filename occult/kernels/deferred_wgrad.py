"""Weight gradients computed off the backward's critical path (`OCCULT_DEFER_WGRAD=1`, docs/overlap.md).

In an expert-parallel layer's backward the dispatch's all-to-all sends the experts' *input* gradient
back to the tokens' ranks; the experts' *weight* gradients are needed only by the optimizer. When the
expert op (`occult.kernels.op`) has its input gradient, it hands the weight-gradient GEMMs to
`defer`: on a GPU they run on a side stream that forks from the backward's stream there, so the
all-to-all (next on the backward's stream) and the GEMMs run at once (Megatron-Core's
`--delay-wgrad-compute`). The op returns no gradient for those weights; at the next deferral, or when
the backward ends (`queue_callback`), the backward's stream waits for the side stream and each gradient
is added to its leaf's `.grad` as autograd's accumulator would: set where `.grad` is None, added in place otherwise,
in the leaf's dtype (a weight cast for autocast gets the cast back, as `ToCopyBackward` gives it).

Only where that is what autograd would do (`deferrable`): every weight a plain leaf tensor (not a
DTensor) with no hooks, whose accumulator this backward runs (`loss.backward()`, not
`torch.autograd.grad`, not `backward(inputs=...)` without it: a recorded training call's backward,
`occult.moe.train_graphs`, differentiates with `autograd.grad` and keeps the usual order).

The gradients are added on the side stream, one after another in the order they were deferred, and only then does
the backward's stream wait for it: in a two-batch step's backward (`occult.training.two_batch`) the two halves run
on two streams and defer one weight's gradients twice, and the two additions to its `.grad` must not race.

Everything the side stream reads stays referenced until it is joined, so the allocator cannot hand
its memory to the backward's stream before the GEMMs have read it; the gradients it writes are
recorded on the backward's stream before they become `.grad`. A deferral joins the one before it
(the backward's stream waits for the earlier GEMMs, which have had the all-to-all and the rest of
that layer's backward to run under, adds their gradients and lets go of what they read), so at
most one layer's backward buffers outlive their op. On the CPU there is no stream: the GEMMs run at
once and only the accumulation waits (what the CPU tests check).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.autograd.graph import get_gradient_edge

_STREAMS: dict[int, torch.cuda.Stream] = {}
# the jobs of the backward running now: the ops run on autograd's device thread, the callback that joins
# them where the engine finishes the backward (possibly another thread), so the list is not per thread
_JOBS: list = []
_LOCK = threading.Lock()


@dataclass
class _Job:
    """One op's deferred weight gradients: (gradient, leaf) pairs, the streams to join and what to keep alive."""

    grads: list[tuple[torch.Tensor, torch.Tensor]]
    main: torch.cuda.Stream | None
    side: torch.cuda.Stream | None
    keep: tuple


def deferrable(leaves: Sequence[torch.Tensor | None]) -> bool:
    """Whether the weights `leaves` (None: not trained) may get their gradients from `defer`: plain
    leaf tensors without hooks whose gradient accumulators the running backward executes."""
    trained = [leaf for leaf in leaves if leaf is not None]
    if not trained:
        return False
    for leaf in trained:
        if not leaf.is_leaf or not leaf.requires_grad or type(leaf) not in (torch.Tensor, torch.nn.Parameter):
            return False
        if leaf._backward_hooks or getattr(leaf, "_post_accumulate_grad_hooks", None):
            return False
        try:
            if not torch._C._will_engine_execute_node(get_gradient_edge(leaf).node):
                return False
        except RuntimeError:  # inside torch.autograd.grad: it returns gradients, it accumulates none
            return False
    return True


def defer(
    compute: Callable[[], Sequence[torch.Tensor | None]],
    leaves: Sequence[torch.Tensor | None],
    keep: tuple,
    device: torch.device,
) -> None:
    """Run `compute()` (the weight gradients, one per entry of `leaves`, None where a leaf is None) on the
    side stream of `device`; each is added to its leaf's `.grad` at the next deferral or when the running
    backward ends. `keep`: every tensor `compute` reads (held until then). Call only where
    `deferrable(leaves)`."""
    _settle()  # the earlier deferral joined: its buffers go before this one's are held
    main = side = None
    if device.type == "cuda":
        main, side = torch.cuda.current_stream(device), side_stream(device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            grads = compute()
    else:
        grads = compute()
    pairs = [(g, leaf) for g, leaf in zip(grads, leaves) if leaf is not None and g is not None]
    torch.autograd.Variable._execution_engine.queue_callback(_settle)  # (once a job: later ones find none)
    with _LOCK:
        _JOBS.append(_Job(pairs, main, side, keep))


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream deferred weight gradients run on, one per device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _STREAMS.get(index)
    if stream is None:
        stream = _STREAMS[index] = torch.cuda.Stream(torch.device("cuda", index))
    return stream


def _settle() -> None:
    """Join every deferral made so far: their gradients are added to their leaves' `.grad` on the side stream (in
    the order they were deferred), the backward's stream then waits for it, what they read is let go."""
    with _LOCK:
        jobs = _JOBS[:]
        _JOBS.clear()
    with torch.no_grad():
        for job in jobs:
            with torch.cuda.stream(job.side) if job.side is not None else contextlib.nullcontext():
                for grad, leaf in job.grads:
                    _accumulate(leaf, grad, job.main)
            if job.main is not None:
                job.main.wait_stream(job.side)


def _accumulate(leaf: torch.Tensor, grad: torch.Tensor, reader: torch.cuda.Stream | None) -> None:
    """`leaf.grad` as autograd's accumulator leaves it after `grad` arrives (cast to the leaf's dtype), on the
    current stream; a gradient that becomes `.grad` is marked as used on `reader` (the backward's stream, where it
    is read and later freed)."""
    grad = grad.to(leaf.dtype)
    if leaf.grad is None:
        if reader is not None:
            grad.record_stream(reader)  # (made on the side stream)
        leaf.grad = grad.detach()
    else:
        leaf.grad.add_(grad)
