"""Gradient accumulation over micro-batches, in turn or paired (combined 1F1B; issue 53, docs/overlap.md).

`accumulate_backward(model, loss_of, micro_batches, paired)` back-propagates the mean of `loss_of(m)` over the
micro-batches, each's gradients added to `.grad` (what one step over their union gives where the loss is a mean
over equal micro-batches and nothing couples their tokens). In turn: forward and backward of one micro-batch,
then the next. Paired (Megatron-Core's `combined_1f1b_schedule_for_no_pipelining`): the first forward alone,
then micro-batch i+1's forward with micro-batch i's backward (`occult.moe.two_batch.run_paired`: one turn passed
at every expert-parallel exchange, the forward on a stream of its own), then the last backward alone. A forward
is light on compute and heavy on wire (a whole batch's dispatch and combine), a backward the other way round, so
in the pairs each side's all-to-alls run under the other's compute; only the first forward's stay in series.

It pays where nothing waits for the host (the step recorded as one CUDA graph) and on a link slow enough for the
exchanges to matter, with several micro-batches (the first forward's wire is paid once a step). Sync-free
expert-parallel layers only, as for two interleaved halves (two exchanges in flight would share the device
transport's buffers). The dense gradients are then reduced once: after the last backward, or during it (every
earlier backward inside the caller's `unsynced`, e.g. `BucketedSync.held`), which runs alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn

from occult.moe.model_layers import exchanging_with_buffers
from occult.moe.two_batch import run_paired
from occult.training.two_batch import join_streams, micro_batch_streams


def check_paired(model: nn.Module, micro_batches: int) -> None:
    """A `ValueError` unless `micro_batches` micro-batches can train `model` paired: two or more, every
    expert-parallel MoE layer sync-free."""
    if micro_batches < 2:
        raise ValueError(f"pairing a forward with a backward needs two or more micro-batches, got {micro_batches}")
    waiting = exchanging_with_buffers(model)
    if waiting:
        raise ValueError(
            f"paired micro-batches need sync-free MoE layers (two exchanges of one device transport in flight would "
            f"share its buffers): {', '.join(waiting[:3])}{' ...' if len(waiting) > 3 else ''} are not; call "
            "occult.set_sync_free(model) (or convert with ExecConfig(sync_free=True)) first"
        )


def accumulate_backward(
    model: nn.Module,
    loss_of: Callable[[torch.Tensor], torch.Tensor],
    micro_batches: Sequence[torch.Tensor],
    paired: bool = False,
    unsynced: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> torch.Tensor:
    """Back-propagate the mean of `loss_of(m)` over `micro_batches`, in turn or `paired` (module docstring); returns
    that mean, detached. Every rank must call it with micro-batches of the same shapes. `paired`: `model` is checked
    with `check_paired` first. `unsynced`: as `backward_accumulated`'s."""
    count = len(micro_batches)
    if count < 1 or any(m.shape != micro_batches[0].shape for m in micro_batches):
        raise ValueError(f"micro-batches of one shape, got {[tuple(m.shape) for m in micro_batches]}")
    if paired and count > 1:
        check_paired(model, count)
    outs = backward_accumulated(
        lambda i: (loss_of(micro_batches[i]) / count,), count, micro_batches[0].device, paired and count > 1, unsynced
    )
    return torch.stack([out[0] for out in outs]).sum()


def backward_accumulated(
    forward_of: Callable[[int], Sequence[torch.Tensor | None]],
    count: int,
    device: torch.device,
    paired: bool,
    unsynced: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> list[tuple[torch.Tensor | None, ...]]:
    """`forward_of(i)` for the `count` micro-batches, each's first output back-propagated (gradients added to
    `.grad`), in turn or `paired` (module docstring; the model's layers must pass `check_paired`); returns every
    forward's outputs (e.g. its loss, already scaled by the caller, and what is logged of it), detached, ready on
    the caller's stream. Every rank must call it with the same `count` and micro-batches of the same shapes.
    Every backward but the last runs inside `unsynced()` (in turn, with its forward: e.g. DDP's `no_sync`; paired,
    the pairs and the first forward: e.g. `BucketedSync.held`), so data-parallel hooks reduce the sum once, in the
    last backward, which runs alone either way."""
    if count < 1 or (paired and count < 2):
        raise ValueError(f"accumulating needs one or more micro-batches (two or more paired), got {count}")
    if not paired:
        outs = []
        for i in range(count):
            with unsynced() if i < count - 1 else contextlib.nullcontext():
                out = tuple(forward_of(i))
                out[0].backward()
            outs.append(_detached(out))
        return outs
    streams = micro_batch_streams(device) if device.type == "cuda" else (None, None)
    main = torch.cuda.current_stream(device) if device.type == "cuda" else None
    for stream in streams:
        if stream is not None:
            stream.wait_stream(main)
    with unsynced():  # (every backward but the last: that one runs alone, after the pairs)
        with _on(streams[0]):
            out = tuple(forward_of(0))
        outs = [_detached(out)]
        for i in range(1, count):
            out = run_paired(lambda i=i: tuple(forward_of(i)), out[0].backward, streams[i % 2])
            outs.append(_detached(out))
    out[0].backward()
    if main is not None:
        join_streams(main, streams, (t for o in outs for t in o))
    return outs


def _detached(out: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
    return tuple(None if t is None else t.detach() for t in out)


def _on(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
    """`torch.cuda.stream(stream)`, or nothing on the CPU."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
