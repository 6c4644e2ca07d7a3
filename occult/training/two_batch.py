"""A training step's forward and backward as two interleaved micro-batches (issue 53; docs/overlap.md).

`interleaved_backward(model, loss_of, halves)` runs the two halves' forwards through
`occult.moe.two_batch.run_interleaved` (two threads passing a turn at every expert-parallel
exchange, each half on a stream of its own), then one backward of their mean loss. The backward
issues the exchanges in the reverse of the forward's interleaved order on every rank (the chain of
`occult.moe.two_batch`), each half's work on its forward's stream, so one half's all-to-all is on
the wire while the other half computes, forward and backward. The gradients are those of the two
halves' losses averaged: what two accumulated micro-batches give (the same as the whole batch where
the loss is a mean over equal halves and nothing couples the halves' tokens, e.g. no load-balancing
loss over the batch).

It pays where nothing waits for the host: the whole step recorded as one CUDA graph
(`occult.training.step_graph`; e2e.py's `/stepgraph/twobatch`). Sync-free expert-parallel layers
only (`occult.set_sync_free`): two exchanges of one device transport in flight would share its
buffers. With `OCCULT_DEFER_WGRAD` both halves defer their expert weight gradients to the one side stream
(`occult.kernels.deferred_wgrad`), which adds them to `.grad` one after the other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn as nn

from occult.moe.model_layers import exchanging_with_buffers
from occult.moe.two_batch import run_interleaved

_STREAMS: dict[int, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}


def check_two_batch(model: nn.Module, batch: int) -> None:
    """A `ValueError` unless two interleaved halves of a batch of `batch` rows can train `model`: an even
    batch, every expert-parallel MoE layer sync-free."""
    if batch < 2 or batch % 2:
        raise ValueError(f"two interleaved micro-batches split the batch in halves: give an even batch (got {batch})")
    waiting = exchanging_with_buffers(model)
    if waiting:
        raise ValueError(
            f"two interleaved micro-batches need sync-free MoE layers (two exchanges of one device transport in "
            f"flight would share its buffers): {', '.join(waiting[:3])}{' ...' if len(waiting) > 3 else ''} are "
            "not; call occult.set_sync_free(model) (or convert with ExecConfig(sync_free=True)) first"
        )


def interleaved_backward(
    model: nn.Module, loss_of: Callable[[torch.Tensor], torch.Tensor], halves: Sequence[torch.Tensor]
) -> torch.Tensor:
    """Back-propagate the mean of `loss_of(halves[0])` and `loss_of(halves[1])`, the two interleaved forward and
    backward (module docstring); returns that mean loss, detached. Every rank must call it with halves of the
    same shapes. `model`: checked with `check_two_batch` first."""
    if len(halves) != 2 or halves[0].shape != halves[1].shape:
        raise ValueError(f"two halves of one shape, got {[tuple(h.shape) for h in halves]}")
    check_two_batch(model, 2 * halves[0].shape[0])
    losses = forward_halves(lambda i: (loss_of(halves[i]),), halves[0].device)
    loss = (losses[0][0] + losses[1][0]) / 2
    backward_halves(loss)
    return loss.detach()


def forward_halves(
    forward_of: Callable[[int], Sequence[torch.Tensor | None]], device: torch.device
) -> list[tuple[torch.Tensor | None, ...]]:
    """`[forward_of(0), forward_of(1)]`, the two halves' forwards interleaved at every expert-parallel exchange
    (`run_interleaved`), each on a stream of its own on a GPU; the tensors they return (e.g. a loss and what is
    logged of it) are ready on the caller's stream. Back-propagate what is made of them with `backward_halves`.
    The model's layers must pass `check_two_batch`."""
    if device.type != "cuda":
        return [tuple(out) for out in run_interleaved(forward_of)]
    main, streams = torch.cuda.current_stream(device), micro_batch_streams(device)
    for stream in streams:
        stream.wait_stream(main)
    outs = [tuple(out) for out in run_interleaved(forward_of, streams)]
    join_streams(main, streams, (t for out in outs for t in out))
    return outs


def backward_halves(loss: torch.Tensor) -> None:
    """`loss.backward()` for a loss made of `forward_halves`' outputs: each half's nodes on its forward's stream,
    the exchanges in the reverse of the forward's order; the halves' streams joined to the caller's after (a
    capture ends on it)."""
    loss.backward()
    if loss.device.type == "cuda":
        join_streams(torch.cuda.current_stream(loss.device), micro_batch_streams(loss.device))


def join_streams(
    main: torch.cuda.Stream, streams: Sequence[torch.cuda.Stream], made: Iterable[torch.Tensor | None] = ()
) -> None:
    """The caller's stream `main` waits for every side stream, and the tensors `made` on them are marked used on
    `main` (not inside a capture: it keeps its memory), so the caching allocator does not hand them out early."""
    for stream in streams:
        main.wait_stream(stream)
    if not torch.cuda.is_current_stream_capturing():
        for tensor in made:
            if tensor is not None:
                tensor.record_stream(main)


def micro_batch_streams(device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    """Two side streams on `device` for micro-batches (the two halves; paired micro-batches, even and odd), made
    once."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _STREAMS:
        _STREAMS[index] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
    return _STREAMS[index]
