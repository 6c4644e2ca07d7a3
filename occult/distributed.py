"""Process groups with bounded timeouts, and CPU rank spawning for tests and the demo.

`init_distributed` joins a group started by torchrun (NCCL on GPUs, gloo on CPU).
`run_ranks` starts `world_size` local processes with gloo (or NCCL, one GPU each), runs a
function on each, and returns every rank's result; a rank that fails or dies, or a run past its
deadline, ends in an exception on the caller within a bounded time, never a hang.

Ctrl-C belongs to the caller: the ranks start with SIGINT blocked (the mask is inherited, so a
rank still importing torch never prints a KeyboardInterrupt traceback; forked from the optional
fork server, `rank_context`, ignored), and an interrupted caller terminates them before the
KeyboardInterrupt goes on.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import pickle
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing import connection as mp_connection
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from occult import settings
from occult.teardown import release_buffers, release_captured

DEFAULT_TIMEOUT_S = 120.0


class RankFailure(RuntimeError):
    """One or more spawned ranks raised, died, or ran past the deadline."""


def pick_backend(backend: str = "auto") -> str:
    """'auto' -> NCCL when CUDA GPUs are present, else gloo."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    return backend


def init_distributed(backend: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, int]:
    """Join the process group described by torchrun's environment; return (rank, world_size).

    The timeout bounds every collective: if a peer dies, the others raise instead of hanging.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    backend = pick_backend(backend)
    if "RANK" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        kwargs["device_id"] = torch.device("cuda", local_rank)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return dist.get_rank(), dist.get_world_size()


def finish_distributed(ok: bool = True) -> None:
    """Leave the process groups: on success wait for every rank (a barrier), then destroy them all.

    Why the barrier: a gloo worker thread can still be dropping the last collective's tensors
    when a rank with nothing left to do returns; if its interpreter is already finalizing when
    that thread needs the GIL, the process aborts ("terminate called without an active
    exception"). Holding every rank until the slowest is done closes that window, and
    `gc.collect()` first frees reference cycles (modules, DDP) that keep groups alive past the
    destroy. After a failure no barrier (a peer may never come): the groups are destroyed at once.
    """
    if not dist.is_initialized():
        return
    release_captured()  # graphs holding collectives first (occult.teardown)
    release_buffers(strict=False)  # then buffers mapped into the peers (the device transport's)
    gc.collect()
    try:
        if ok:
            dist.barrier()
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_context(backend: str) -> Any:
    """Where `run_ranks` starts its processes: spawned afresh (each imports torch), or, with
    `OCCULT_RANK_START=forkserver` (the CPU test suite sets it), gloo ranks forked from a fork server
    that loaded torch once (`occult._rank_preload`; POSIX): ~0.2 s a call instead of ~1.8 s on 2
    cores. The fork server is started with Ctrl-C unblocked, so an interrupt during its first
    import prints a traceback: hence not the default. NCCL ranks are always spawned."""
    if (
        backend != "gloo"
        or settings.current().rank_start != "forkserver"
        or "forkserver" not in mp.get_all_start_methods()
    ):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["occult._rank_preload"])  # (no effect once its server runs)
    return ctx


def _worker(
    rank: int, world_size: int, port: int, backend: str, timeout_s: float, fn, args, results, environ: dict[str, str]
) -> None:
    # the caller's environment as it is now (a forked rank has its fork server's, from when that started)
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    _thread_lock_for_tqdm()
    try:
        init_distributed(backend, timeout_s)
        out = fn(rank, world_size, *args)
        payload = ("ok", out)
    except BaseException as exc:  # report every failure to the parent, then exit
        payload = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    try:  # by value, with plain pickle: torch's own pickler would share a tensor's memory through a file
        data = pickle.dumps(payload)  # descriptor served by this process, which may be gone when the parent reads
    except Exception as exc:
        payload = ("error", f"rank {rank} returned an unpicklable result: {exc}")
        data = pickle.dumps(payload)
    results.send_bytes(data)
    results.close()
    try:
        finish_distributed(ok=payload[0] == "ok")
    except Exception:
        pass  # the result is reported; a peer that failed may break the closing barrier


def _thread_lock_for_tqdm() -> None:
    """tqdm's default lock holds a multiprocessing semaphore; a rank terminated on Ctrl-C cannot
    release it, and the resource tracker then prints a leak warning on the terminal. A rank's bars
    never share a lock with another process: a thread lock does."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """SIGINT blocked in this thread meanwhile: processes started inside inherit the mask (through
    fork and exec), so they never see a Ctrl-C; the caller gets a pending one when it is unblocked."""
    if not hasattr(signal, "pthread_sigmask"):  # not POSIX
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _collect(procs: list, readers: list, timeout_s: float) -> dict[int, tuple[str, Any]]:
    """Every rank's ("ok" | "error", payload): its report (one message on its pipe), or why none
    came (died, deadline)."""
    world_size = len(procs)
    outcome: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    while len(outcome) < world_size:
        waiting = [readers[r] for r in range(world_size) if r not in outcome]
        for conn in mp_connection.wait(waiting, timeout=0.2):
            rank = readers.index(conn)
            try:
                outcome[rank] = pickle.loads(conn.recv_bytes())
            except EOFError:  # the pipe closed without a report: the rank died
                outcome[rank] = (
                    "error",
                    f"rank {rank} died (exit code {procs[rank].join(5) or procs[rank].exitcode}) without reporting",
                )
        if time.monotonic() > deadline:
            for r in range(world_size):
                outcome.setdefault(r, ("error", f"rank {r} did not finish within {timeout_s:.0f} s"))
            break
    return outcome


def _end(procs: list, wait_s: float) -> None:
    """Wait up to `wait_s` for each started rank, then kill what is left."""
    for p in procs:
        if p.pid is None:  # never started
            continue
        p.join(timeout=wait_s)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    collective_timeout_s: float | None = None,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` fresh processes; return their results.

    `fn` must be importable (module level). Raises `RankFailure` with every failing rank's
    traceback if any rank raises or dies, or if the run exceeds `timeout_s`. The ranks ignore
    Ctrl-C; on a KeyboardInterrupt (or any exception) here they are terminated at once.
    """
    backend = pick_backend(backend)
    ctx = rank_context(backend)
    port = free_port()
    coll_timeout = collective_timeout_s if collective_timeout_s is not None else timeout_s
    # one pipe per rank for its report (no queue: its semaphores, left behind by an interrupted
    # run, made the resource tracker print a leak warning on the terminal)
    pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, backend, coll_timeout, fn, args, pipes[r][1], dict(os.environ)),
            daemon=True,
            name=f"occult-rank-{r}",
        )  # the name occult._rank_signals ignores Ctrl-C in
        for r in range(world_size)
    ]
    wait_s = 5.0
    try:
        with _sigint_blocked():
            for p in procs:
                p.start()
        for _, writer in pipes:
            writer.close()  # the ranks hold the write ends: a dead rank's pipe reads EOF
        outcome = _collect(procs, [reader for reader, _ in pipes], timeout_s)
    except BaseException:
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                p.terminate()
        wait_s = 1.0
        raise
    finally:
        _end(procs, wait_s)
        for reader, _ in pipes:
            reader.close()
    errors = {r: msg for r, (kind, msg) in sorted(outcome.items()) if kind == "error"}
    if errors:
        text = "\n".join(f"--- rank {r} ---\n{msg}" for r, msg in errors.items())
        raise RankFailure(f"{len(errors)} of {world_size} rank(s) failed:\n{text}")
    return [outcome[r][1] for r in range(world_size)]
