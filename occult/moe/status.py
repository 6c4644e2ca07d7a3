"""Routing statuses read later, not waited for: the queue behind `check_routing`.

A layer whose dispatch does not wait for the GPU (the one-rank schedule, `occult.moe.local`, and
the device transport, `occult.moe.device_exchange`) cannot read its routing status (ids out of
range, NaN/inf gates; `occult.moe.counts.routing_status`) when it is made. It is copied to pinned
host memory as the GPU reaches it and queued here; `check_routing()` waits for and reads every
queued status, `take_ready()` reads only those the GPU has already reached. A status is a vector
with one entry per rank of the layer's group (one entry on one rank), so the error names the rank
whose input was bad. Under CUDA-graph capture nothing is queued or read; a capture inside
`recording()` keeps the status tensors instead, for its replays to queue. A call traced by
torch.compile queues through the custom op `occult::queue_routing_status` (`queue(status, sink_1)`):
the compiled graph runs it where the eager call would queue, so a traced layer reports bad routing
as an eager one does. The op writes the status into `sink_1` (a buffer of the layer, an input of the
graph): a write to an input is what keeps an op with no output in a compiled graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from occult.moe.counts import raise_on_bad_status

_PENDING: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []  # statuses on their way to the host
_RECORDERS: list[list[torch.Tensor]] = []  # captures that keep what they would queue (innermost last)


def capturing() -> bool:
    """Inside CUDA-graph capture or torch.compile tracing: nothing can be read to the host."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def clear() -> None:
    """Drop every queued status (after an error was raised for them)."""
    _PENDING.clear()


def check_routing() -> None:
    """Read every pending routing status and raise `RoutingError` if one was bad.

    Waits only for the GPU to reach those statuses (each recorded right after its routing)."""
    if capturing():
        return  # no waiting inside a capture or a compiled graph: read after it
    pending = list(_PENDING)
    _PENDING.clear()
    for host, ready in pending:
        if ready is not None:
            ready.synchronize()
        raise_on_bad_status([int(v) for v in host.tolist()])


def queue(status_D: torch.Tensor, sink_1: torch.Tensor | None = None) -> None:
    """Queue a device status vector for `check_routing` / `take_ready` (a CPU one is read at once).
    Traced by torch.compile, it queues at run time through `occult::queue_routing_status` where the
    caller gives `sink_1` ([1] int64 on the status's device; module docstring), else not at all."""
    if torch.compiler.is_compiling():
        if sink_1 is not None:
            torch.ops.occult.queue_routing_status(sink_1, status_D)
        return
    if not status_D.is_cuda:
        raise_on_bad_status([int(v) for v in status_D.reshape(-1).tolist()])
        return
    if capturing():
        if _RECORDERS and not torch.compiler.is_compiling():
            _RECORDERS[-1].append(status_D)
        return
    host = torch.empty(status_D.numel(), dtype=torch.int64, pin_memory=True)
    host.copy_(status_D.reshape(-1), non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    _PENDING.append((host, ready))


def queue_later(status_D: torch.Tensor, sink_1: torch.Tensor | None = None) -> None:
    """`queue`, but a CPU status too waits for `check_routing` (not read at once): for a status made before an
    exchange that every rank must still join (raising there would leave the peers waiting in it)."""
    if status_D.is_cuda or torch.compiler.is_compiling():
        queue(status_D, sink_1)
    else:
        _PENDING.append((status_D.reshape(-1).clone(), None))


@torch.library.custom_op("occult::queue_routing_status", mutates_args=("sink_1",))
def _queue_compiled(sink_1: torch.Tensor, status_D: torch.Tensor) -> None:
    """What a compiled graph runs where an eager one-rank call reads the previous status and queues its
    own (`occult.moe.local`); the status's first entry is left in `sink_1`."""
    check_routing()
    queue(status_D)
    sink_1.copy_(status_D.reshape(-1)[:1])


@_queue_compiled.register_fake
def _(sink_1: torch.Tensor, status_D: torch.Tensor) -> None:
    return None


@contextlib.contextmanager
def recording() -> Iterator[list[torch.Tensor]]:
    """Around a CUDA-graph capture: the statuses queued inside it are kept in the yielded list (the
    tensors the graph rewrites on every replay; queue them after each replay)."""
    kept: list[torch.Tensor] = []
    _RECORDERS.append(kept)
    try:
        yield kept
    finally:
        _RECORDERS.remove(kept)


def take_ready(num_ranks: int, max_pending: int = 8) -> list[int]:
    """The element-wise maximum of the queued statuses the GPU has reached (zeros: none bad),
    removing them; waits for the oldest ones only while more than `max_pending` are queued."""
    seen = [0] * num_ranks
    while _PENDING:
        host, ready = _PENDING[0]
        if ready is not None and not ready.query():
            if len(_PENDING) <= max_pending:
                break
            ready.synchronize()
        _PENDING.pop(0)
        values = host.tolist()
        if len(values) == num_ranks:
            seen = [max(a, int(b)) for a, b in zip(seen, values)]
        elif any(values):  # a one-rank status: this rank's own
            seen = [max(s, int(max(values))) for s in seen]
    return seen


def combined(statuses: list[torch.Tensor]) -> torch.Tensor | None:
    """The element-wise maximum of routing statuses (a one-entry status, a one-rank layer's, counts for every
    rank, as `take_ready` reads it); None for none. Inside a capture: one status a replay rewrites."""
    if not statuses:
        return None
    width = max(s.numel() for s in statuses)
    rows = [s.reshape(-1).expand(width) if s.numel() == 1 else s.reshape(-1) for s in statuses]
    return torch.stack(rows).amax(0)


def raise_ready(kept: list[torch.Tensor]) -> None:
    """After replays of a graph that rewrites the statuses `kept`: raise `RoutingError` for a bad one the GPU has
    reached (waiting only while more than two replays' worth are queued)."""
    if kept:
        bad = take_ready(max(s.numel() for s in kept), max_pending=2 * len(kept))
        if any(bad):
            clear()
            raise_on_bad_status(bad)


class ReplayedStatus:
    """The routing statuses a captured forward makes (a sync-free layer's dropped rows, a one-rank layer's bad
    routing), combined into one the graph rewrites at every replay: `with torch.cuda.graph(g), rs.capture():`
    (this context innermost, so the combination is recorded too), then `rs.replayed()` after each replay."""

    def __init__(self) -> None:
        self.status: torch.Tensor | None = None

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        with recording() as kept:
            yield
            self.status = combined(kept)

    def replayed(self) -> None:
        """Queue this replay's status; raise a bad one of an earlier replay that the GPU has reached."""
        if self.status is not None:
            queue(self.status)
            raise_ready([self.status])
