"""Captured collectives are freed before a process group is destroyed (issue 37's hang at exit).

A CUDA graph that captured NCCL collectives keeps a reference on their communicator; while such a
graph is alive, `dist.destroy_process_group()` waits inside NCCL's shutdown for it, forever. Seen on
2 and 4 GPUs: `hf.generate(cuda_graph=True)` keeps its decoder (and graph) on the model for the
next call, and after `compile_layers` a plain `destroy_process_group()` with the model still alive
hung every rank; freeing that one graph first (`StaticDecoder.release`) let the same run end at once
(`scripts/exit_probe.py`; docs/results/twogpu/exit_probe/).

So whatever captures collectives registers here (`hold_collectives`), and the first registration
wraps `torch.distributed.destroy_process_group` once: the wrapper releases every registered holder,
then destroys as before. A released holder re-captures on its next use. `release_captured` does the
same by hand (`occult.distributed.finish_distributed` calls it). A name bound before the first
capture (`from torch.distributed import destroy_process_group`) still calls the unwrapped function:
call `release_captured()` first there.

Device buffers mapped into every peer (the device transport's symmetric memory) register too
(`hold_buffers`): the wrapper and `finish_distributed` free them after the graphs
(`release_buffers`), so a process leaves no such memory behind its groups.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_holders: weakref.WeakSet[Any] = weakref.WeakSet()
_buffer_holders: weakref.WeakSet[Any] = weakref.WeakSet()
_lock = threading.Lock()


class CollectiveHolder(Protocol):
    def release(self) -> None:
        """Free whatever captured collectives this object holds (idempotent)."""


def hold_collectives(holder: CollectiveHolder) -> None:
    """Register `holder` (kept weakly): it is released before any process group is destroyed."""
    with _lock:
        _holders.add(holder)
    _wrap_destroy()


def release_captured() -> int:
    """Release every registered holder now; returns how many were alive."""
    with _lock:
        holders = list(_holders)
        _holders.clear()
    for holder in holders:
        holder.release()
    return len(holders)


class BufferHolder(Protocol):
    def release(self) -> int:
        """Free the device buffers this object holds (idempotent); returns the bytes freed."""


def hold_buffers(holder: BufferHolder) -> None:
    """Register `holder` (kept weakly): its buffers are freed before any process group is destroyed."""
    with _lock:
        _buffer_holders.add(holder)
    _wrap_destroy()


def release_buffers(strict: bool = True) -> int:
    """Free every registered holder's buffers now (they grow again on use); returns the bytes freed.
    `strict=False` (teardown after a failure): a holder that cannot free (e.g. a GPU in an error
    state) is skipped, so the groups are still destroyed."""
    with _lock:
        holders = list(_buffer_holders)
    freed = 0
    for holder in holders:
        try:
            freed += holder.release()
        except Exception:
            if strict:
                raise
    return freed


def _wrap_destroy() -> None:
    """Wrap `destroy_process_group` (the `torch.distributed` and `distributed_c10d` names) once."""
    original = dist.destroy_process_group
    if getattr(original, "releases_captured", False):
        return
    wrapped = _releasing(original)
    dist.destroy_process_group = wrapped
    c10d.destroy_process_group = wrapped


def _releasing(destroy: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(destroy)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        release_captured()
        release_buffers(strict=False)
        return destroy(*args, **kwargs)

    destroy_process_group.releases_captured = True  # type: ignore[attr-defined]
    return destroy_process_group
