"""Two-batch overlap: a batch in two halves through the same model, interleaved at the MoE
layers' all-to-alls, so that one half's exchange runs under the other half's compute.

`two_batch_overlap(fn, *inputs)` splits every positional tensor input in two along dim 0 and
runs `fn` on each half in a thread of its own (two long-lived worker threads per process). The threads pass a baton, so exactly one runs at
a time, and hand it over at the pause points of every `OccultMoE` layer: right after starting
the dispatch all-to-all and right after starting the combine all-to-all
(`occult.moe.comm.exchange(pause=...)`). Per layer, on every rank, the order is therefore fixed:

    A  attention, route, plan, count exchange, start dispatch(A)   pause
    B  attention, ..., start dispatch(B)                           pause   runs under dispatch(A)
    A  wait dispatch(A), experts(A), start combine(A)              pause   under dispatch(B)
    B  wait dispatch(B), experts(B), start combine(B)              pause   under combine(A)
    A  wait combine(A), the next layer's attention, ...                    under combine(B)

Every rank issues its collectives in the same order, and on NCCL each all-to-all runs on the
communicator's stream while the one compute stream runs the other half's kernels (a wait only
orders the compute stream after the exchange; no second compute stream is needed). In
backward each paused exchange is two autograd nodes: the finish node starts the gradient
all-to-all and the start node waits for it, and autograd, which runs ready nodes latest-created
first, interleaves the halves in the mirror order. The result is the same function as
`fn(*inputs)`: outputs concatenated along dim 0, gradients summed over the halves (tests).

The caller's grad mode, inference mode, autocast and CUDA device and stream carry into the
threads. If any rank of `group` has fewer than 2 rows, every rank runs `fn` unsplit (one
all-reduce decides, so the ranks never disagree). Not for CUDA-graph capture or torch.compile
(threads): decode uses sync-free dispatch instead. Not with activation checkpointing of the MoE
layers: a layer recomputed in backward would exchange outside the chain, in an order autograd
picks per rank (`OccultMoE` raises a clear error instead, on every rank).
"""

from __future__ import annotations

import queue
import threading
from contextlib import ExitStack
from typing import Any, Callable

import torch
import torch.distributed as dist

_local = threading.local()
_AUTOCAST_DEVICES = ("cuda", "cpu")
_FRESH_THREADS = False  # True: two new threads per call (slower: per-thread CUDA/cuBLAS/OpenMP state is rebuilt)


class _Worker:
    """A long-lived thread that runs the jobs it is given, one at a time (one per half)."""

    def __init__(self, index: int) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=f"occult-two-batch-{'AB'[index]}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            self.jobs.get()()


_workers: list[_Worker] = []
_call_lock = threading.Lock()  # one two-batch call at a time per process: the workers are shared


def _run_halves(run: Callable[[int], None]) -> None:
    """run(0) and run(1) on the two workers (started lazily, again after a fork); wait for both."""
    global _workers
    if _FRESH_THREADS:
        threads = [threading.Thread(target=run, args=(i,), name=f"occult-two-batch-{'AB'[i]}", daemon=True) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return
    if len(_workers) != 2 or not all(w.thread.is_alive() for w in _workers):
        _workers = [_Worker(0), _Worker(1)]
    done = [threading.Event(), threading.Event()]

    def job(i: int) -> Callable[[], None]:
        def go() -> None:
            try:
                run(i)
            finally:
                done[i].set()
        return go
    for i, worker in enumerate(_workers):
        worker.jobs.put(job(i))
    for event in done:
        event.wait()


def pause_point() -> Callable[[], None] | None:
    """The pause of the two-batch half running in this thread; None outside `two_batch_overlap`."""
    return getattr(_local, "pause", None)


class _Baton:
    """Two threads, one runs at a time; `hand_over` gives the turn away and waits for it back.
    A finished thread (`release`) never takes the turn again, so the other runs on alone."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._turn = 0
        self._done = [False, False]

    def _wait(self, me: int) -> None:
        while self._turn != me and not self._done[1 - me]:
            self._cond.wait()

    def take(self, me: int) -> None:
        with self._cond:
            self._wait(me)

    def hand_over(self, me: int) -> None:
        with self._cond:
            self._turn = 1 - me
            self._cond.notify_all()
            self._wait(me)

    def release(self, me: int) -> None:
        with self._cond:
            self._done[me] = True
            self._turn = 1 - me
            self._cond.notify_all()


class _Chain:
    """The token that threads every paused exchange of one two-batch call into one autograd chain
    (`occult.moe.comm._StartExchange`): backward then issues their collectives in the reverse of
    the forward order on every rank, whatever order autograd picks for the rest."""

    def __init__(self) -> None:
        self._token: torch.Tensor | None = None

    def __bool__(self) -> bool:
        return True

    def take(self) -> torch.Tensor:
        if self._token is None:
            self._token = torch.empty(0, requires_grad=True)
        return self._token

    def put(self, token: torch.Tensor) -> None:
        self._token = token


class _Pause:
    """What `pause_point` returns inside a half: calling it hands the turn to the other half."""

    def __init__(self, baton: _Baton, me: int, chain: _Chain) -> None:
        self.baton, self.me, self.chain = baton, me, chain

    def __call__(self) -> None:
        self.baton.hand_over(self.me)


def _caller_state() -> Callable[[ExitStack], None]:
    """What the calling thread has set that a new thread would not inherit; returns its re-entry."""
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    autocast = [(d, torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES if torch.is_autocast_enabled(d)]
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    device = torch.cuda.current_device() if cuda else None
    stream = torch.cuda.current_stream() if cuda else None

    def enter(stack: ExitStack) -> None:
        if device is not None:
            torch.cuda.set_device(device)
            stack.enter_context(torch.cuda.stream(stream))
        stack.enter_context(torch.inference_mode(inference))
        stack.enter_context(torch.set_grad_enabled(grad))
        for device_type, dtype in autocast:
            stack.enter_context(torch.autocast(device_type, dtype=dtype))

    return enter


def _halves(args: tuple, rows: int) -> tuple[tuple, tuple]:
    cut = (rows + 1) // 2
    first = tuple(a[:cut] if isinstance(a, torch.Tensor) else a for a in args)
    second = tuple(a[cut:] if isinstance(a, torch.Tensor) else a for a in args)
    return first, second


def _concat(a: Any, b: Any) -> Any:
    """Join the halves' outputs: tensors along dim 0, containers member by member."""
    if isinstance(a, torch.Tensor):
        if a.dim() == 0:
            raise ValueError("two_batch_overlap: fn returned a 0-dim tensor (e.g. a loss); return per-row "
                             "outputs (logits) and reduce them after the call")
        return torch.cat([a, b])
    if isinstance(a, dict):
        return type(a)(**{k: _concat(v, b[k]) for k, v in a.items()})
    if isinstance(a, (tuple, list)):
        return type(a)(_concat(x, y) for x, y in zip(a, b))
    return a


def _min_rows(rows: int, device: torch.device, group: Any) -> int:
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return rows
    backend = dist.get_backend(group)
    on = device if (backend != "gloo" or device.type == "cpu") else torch.device("cpu")
    t = torch.tensor([rows], dtype=torch.int64, device=on)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


def two_batch_overlap(fn: Callable[..., Any], *args: Any, group: Any = None, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` computed as two interleaved halves (module docstring).

    Tensors among `args` are split along dim 0 (all must have the same dim-0 size: the batch);
    other args and all `kwargs` go to both halves unchanged. `fn` must return tensors with the
    batch in dim 0 (or tuples / dicts of them). Every rank of `group` (default: the world)
    must call it; all ranks need at least 2 rows for the split, else all run unsplit.
    """
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors:
        raise ValueError("two_batch_overlap needs at least one tensor argument to split (the batch)")
    rows = tensors[0].shape[0] if tensors[0].dim() else -1
    if rows < 0 or any(t.dim() == 0 or t.shape[0] != rows for t in tensors):
        raise ValueError("two_batch_overlap: every tensor argument must have the batch in dim 0, the same size "
                         f"for all (got {[tuple(t.shape) for t in tensors]}); pass others as keyword arguments")
    if torch.compiler.is_compiling() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        raise RuntimeError("two_batch_overlap runs two threads: not under torch.compile or CUDA-graph capture")
    if pause_point() is not None:
        raise RuntimeError("two_batch_overlap cannot be nested")
    if _min_rows(rows, tensors[0].device, group) < 2:
        return fn(*args, **kwargs)
    halves = _halves(args, rows)
    baton, chain, enter = _Baton(), _Chain(), _caller_state()
    results: list[Any] = [None, None]
    errors: list[BaseException | None] = [None, None]

    def run(me: int) -> None:
        _local.pause = _Pause(baton, me, chain)
        try:
            with ExitStack() as stack:
                enter(stack)
                baton.take(me)
                results[me] = fn(*halves[me], **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors[me] = exc
        finally:
            _local.pause = None
            baton.release(me)

    with _call_lock:
        _run_halves(run)
    if errors[0] is not None or errors[1] is not None:
        first, second = errors if errors[0] is not None else (errors[1], None)
        if second is not None:
            first.add_note(f"the other half failed too: {type(second).__name__}: {second}")
        raise first
    return _concat(results[0], results[1])
