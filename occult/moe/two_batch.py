"""Two-batch overlap: two halves of a batch through one model, interleaved at the MoE layers'
exchanges, so that one half's all-to-all is on the wire while the other half computes.

`run_interleaved(run, streams)` runs `run(0)` and `run(1)` in two threads that pass a turn: exactly
one runs at a time, and an expert-parallel `OccultMoE` hands the turn over right after it issues a
dispatch and right after it issues a combine (`exchange_issued`). Per layer, on every rank, the host
therefore issues

    A  attention, route, dispatch(A)       | turn to B
    B  attention, route, dispatch(B)       | turn to A    (B's compute can run under dispatch(A))
    A  experts(A), combine(A)              | turn to B    (under dispatch(B))
    B  experts(B), combine(B)              | turn to A    (under combine(A))
    A  the next layer's attention, ...                     (under combine(B))

With k streams (`run_interleaved(run, streams)`, len(streams) = k > 2) the batch goes as k micro-batches and
the turn passes round them in index order: per layer every micro-batch's dispatch, then every one's combine,
each under the compute of the micro-batches after it (more compute under each exchange, at GEMMs of 1/k the
rows; docs/overlap.md).

Each half issues onto a stream of its own (`streams[i]`), so a half's wait for its exchange orders
only its own stream; the exchanges (NCCL, one process group) run on the group's stream in exactly
that order on every rank. Nothing here waits for the GPU: it pays where the whole forward is
captured in one CUDA graph (`occult.integrations.hf.GraphedForward(micro_batches=2)`), whose replay
keeps the order and costs the host one launch. Two free-running halves on two streams without the
turn advance in step and hide nothing (docs/overlap.md).

Under autograd (a training step, `occult.training.two_batch`) the two halves' graphs are one backward's:
the autograd engine runs it on one thread, its nodes in an order that nothing ties to the forward's
turns, yet every rank must issue the backward's collectives in one order. So the exchanges a call
issues are chained in the order the host issued them (`chain_inputs` / `chain_outputs`, called by
`occult.moe.comm.exchange` around its node): exchange k's backward cannot start before exchange k+1's
has been issued, and the backward issues them in exactly the reverse of the forward's interleaved order
on every rank, each half's on the stream its forward ran on: A's combine gradient on the wire while B's
experts run backward, and so on. The chain is a data dependency of empty tensors (no kernel, no bytes).

`run_paired(forward, backward, stream)` pairs one micro-batch's forward with another's backward (combined 1F1B,
`occult.training.accumulation`): the forward in a thread of its own hands the turn over at its exchanges as a
half does, the backward's exchanges at theirs (`backward_exchange_issued`, called by `occult.moe.comm`'s exchange
node after it issues its all-to-alls). Those nodes run on autograd's device thread on a GPU, the calling thread
on the CPU, never the forward's, so the pairing is module state, found by thread: every thread but the
forward's is the backward. The forward goes first; each side's own order is fixed (the model's forward; the
backward's by its data dependencies), so every rank issues the same alternation.

Sync-free layers only (`ExecConfig(sync_free=True)`): the device transport's receive buffers and
barrier signals are per group, and two exchanges of one group in flight at once would share them.
The threads carry the caller's grad and inference mode.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any, TypeVar

import torch

T = TypeVar("T")
_local = threading.local()


def exchange_issued() -> None:
    """Called by a layer right after it issues a dispatch or a combine: inside `run_interleaved`, the
    other half takes its turn (this half continues when the turn comes back); elsewhere nothing."""
    turn = getattr(_local, "hand_over", None)
    if turn is not None:
        turn()


def chain_inputs(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """`tensors` (an exchange's differentiable inputs) as they are, the first that requires grad tied to the
    previous exchange of this `run_interleaved` call, so that its backward waits for this exchange's (module
    docstring); unchanged outside such a call or without grad."""
    chain = getattr(_local, "chain", None)
    if chain is None or chain.token is None:
        return tensors
    index = next((i for i, t in enumerate(tensors) if t is not None and t.requires_grad), None)
    if index is None:
        return tensors
    tied = _Tied.apply(tensors[index], chain.token)
    return (*tensors[:index], tied, *tensors[index + 1 :])


def chain_outputs(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """`tensors` (an exchange's outputs) as they are, the first that requires grad made the chain's next link:
    its gradient reaches the exchange only once the next exchange's backward is issued (module docstring);
    unchanged outside a `run_interleaved` call or without grad."""
    chain = getattr(_local, "chain", None)
    if chain is None:
        return tensors
    index = next((i for i, t in enumerate(tensors) if t is not None and t.requires_grad), None)
    if index is None:
        return tensors
    linked, chain.token = _Link.apply(tensors[index])
    return (*tensors[:index], linked, *tensors[index + 1 :])


class _Chain:
    """The newest link of one `run_interleaved` call's exchanges (shared by its two threads, which take
    turns, so never touched by both at once)."""

    def __init__(self) -> None:
        self.token: torch.Tensor | None = None


class _Link(torch.autograd.Function):
    """An exchange's output as it is, plus an empty token for the next exchange: the backward passes the
    output's gradient on only once the token's (the next exchange's backward) has come."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.view_as(x), x.new_empty(0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _token_grad: torch.Tensor) -> torch.Tensor:
        return grad


class _Tied(torch.autograd.Function):
    """An exchange's input as it is, tied to the previous exchange's token: its backward (which runs after
    this exchange's) releases the previous exchange's gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def backward_exchange_issued() -> None:
    """Called by an exchange's backward right after it issues its all-to-alls: inside `run_paired`, on the backward's
    side (any thread but the forward's), the forward takes its turn; elsewhere nothing."""
    paired = _PAIRED[0] if _PAIRED else None
    if paired is not None and threading.get_ident() != paired[1]:
        paired[0].hand_over(1)


def interleaving() -> bool:
    """Whether this thread runs one micro-batch of `run_interleaved`."""
    return getattr(_local, "hand_over", None) is not None


class _Turn:
    """`parts` threads, one runs at a time; `hand_over` gives the turn to the next unfinished thread (in index
    order, round the circle) and waits for it back. A finished thread (`release`) never takes the turn again,
    so the others go on without it (the last runs on alone)."""

    def __init__(self, parts: int) -> None:
        self._cond = threading.Condition()
        self._turn = 0
        self._done = [False] * parts

    def _next(self, me: int) -> int:
        parts = len(self._done)
        return next((j % parts for j in range(me + 1, me + parts + 1) if not self._done[j % parts]), me)

    def _wait(self, me: int) -> None:
        while self._turn != me:
            self._cond.wait()

    def take(self, me: int) -> None:
        with self._cond:
            self._wait(me)

    def hand_over(self, me: int) -> None:
        with self._cond:
            self._turn = self._next(me)
            self._cond.notify_all()
            self._wait(me)

    def release(self, me: int) -> None:
        with self._cond:
            self._done[me] = True
            self._turn = self._next(me)
            self._cond.notify_all()


def _caller_state() -> Callable[[ExitStack, Any], None]:
    """What this thread has set that a new thread would not inherit (grad and inference mode, the CUDA
    device, autocast); returns how a half's thread enters it, on its own stream. Autocast's cache of weight casts
    is one for the process while its switch is per thread: a half reading the other half's cast would read a
    tensor made on the other stream (in a recorded step, perhaps before it is written), so in a half the cache
    is off, for the caller's autocast and for any the half enters itself without naming `cache_enabled`."""
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    autocast = [(kind, torch.get_autocast_dtype(kind)) for kind in ("cuda", "cpu") if torch.is_autocast_enabled(kind)]

    def enter(stack: ExitStack, stream: Any) -> None:
        if device is not None:
            torch.cuda.set_device(device)
        if stream is not None:
            stack.enter_context(torch.cuda.stream(stream))
        stack.enter_context(torch.inference_mode(inference))
        stack.enter_context(torch.set_grad_enabled(grad))
        torch.set_autocast_cache_enabled(False)  # (this thread's switch; the thread ends with its half)
        for kind, dtype in autocast:
            stack.enter_context(torch.autocast(kind, dtype=dtype, cache_enabled=False))

    return enter


MAX_PARTS = 16  # micro-batches (threads) of one run_interleaved call
# the run_paired call in progress: (its turn, the forward thread's ident); module state, not per thread, as the
# backward's exchanges run on autograd's device thread on a GPU
_PAIRED: list[tuple[_Turn, int | None]] = []


def run_interleaved(run: Callable[[int], T], streams: Sequence[Any] = (None, None)) -> list[T]:
    """[run(0), ..., run(k - 1)] for k = len(streams) micro-batches (2 by default: two halves), interleaved at
    every expert-parallel layer's exchanges (module docstring), micro-batch i on `streams[i]` (None: the thread's
    current stream). Every rank must call it with the same model, k and micro-batches of the same shapes. An
    error in any is raised here after every thread ended (the others', if any, noted)."""
    if interleaving():
        raise RuntimeError("two-batch overlap cannot be nested")
    parts = len(streams)
    if not 2 <= parts <= MAX_PARTS:
        raise ValueError(f"interleave 2 to {MAX_PARTS} micro-batches (one stream each), got {parts}")
    turn, enter = _Turn(parts), _caller_state()
    chain = _Chain() if torch.is_grad_enabled() and not torch.is_inference_mode_enabled() else None
    results: list[Any] = [None] * parts
    errors: list[BaseException | None] = [None] * parts

    def part(me: int) -> None:
        _local.hand_over = lambda: turn.hand_over(me)
        _local.chain = chain
        try:
            with ExitStack() as stack:
                enter(stack, streams[me])
                turn.take(me)
                results[me] = run(me)
        except BaseException as exc:  # noqa: BLE001 - raised in the caller
            errors[me] = exc
        finally:
            _local.hand_over = _local.chain = None
            turn.release(me)

    threads = [
        threading.Thread(target=part, args=(i,), name=f"occult-two-batch-{chr(ord('A') + i)}") for i in range(parts)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failed = [e for e in errors if e is not None]
    if failed:
        for other in failed[1:]:
            failed[0].add_note(f"another micro-batch failed too: {type(other).__name__}: {other}")
        raise failed[0]
    return results


def run_paired(forward: Callable[[], T], backward: Callable[[], None], stream: Any = None) -> T:
    """`forward()` in a thread of its own (on `stream`; None: that thread's current stream) while `backward()` (a
    `loss.backward()` of another micro-batch) runs here, the two passing one turn at every expert-parallel exchange
    (module docstring); returns what `forward` returned. Every rank must call it with the same model and
    micro-batches of the same shapes. An error on either side is raised here once both ended (the other's noted);
    the side left runs on alone."""
    if interleaving() or _PAIRED:
        raise RuntimeError("two-batch overlap cannot be nested")
    turn, enter = _Turn(2), _caller_state()
    result: list[Any] = [None]
    errors: list[BaseException | None] = [None, None]

    def run_forward() -> None:
        _local.hand_over, _local.chain = (lambda: turn.hand_over(0)), None
        try:
            with ExitStack() as stack:
                enter(stack, stream)
                turn.take(0)
                result[0] = forward()
        except BaseException as exc:  # noqa: BLE001 - raised in the caller
            errors[0] = exc
        finally:
            _local.hand_over = None
            turn.release(0)

    thread = threading.Thread(target=run_forward, name="occult-1f1b-forward")
    _PAIRED.append((turn, None))
    try:
        thread.start()
        _PAIRED[0] = (turn, thread.ident)
        turn.take(1)
        backward()
    except BaseException as exc:  # noqa: BLE001 - raised below, after the forward ended
        errors[1] = exc
    finally:
        turn.release(1)
        thread.join()
        _PAIRED.clear()
    failed = [e for e in errors if e is not None]
    if failed:
        if len(failed) == 2:
            failed[0].add_note(f"the backward failed too: {type(failed[1]).__name__}: {failed[1]}")
        raise failed[0]
    return result[0]
