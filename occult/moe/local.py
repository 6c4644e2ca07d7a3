"""The one-rank schedule of the flat dispatchers: nothing to send, nothing to wait for.

On a group of one rank every expert is local, so a dispatch is an identity: the received rows
are the tokens themselves, each with the local slots of its k experts and its k gate weights
(`slot_E[ids_TK]`, `weights_TK`), and `combine` returns the experts' pre-reduced output as it
is. This is exactly the dedup plan for one device (row t = token t, column j = its j-th expert);
it skips the plan, the gathers, the copies of a self-exchange and the per-token sums (about 30
launches a layer) and, above all, the host wait for the counts: the host runs ahead of the GPU
as in a plain model (one GPU and every replicated/data-parallel layer of occult take it).

Bad input is still reported, without stalling the GPU: a layer's routing status (ids out of
range, NaN/inf gates) is copied to pinned host memory as the GPU reaches it, and read when the
next one-rank dispatch starts (by then the GPU is past it; the host runs at most one layer
ahead) or when `check_routing()` is called (`hf.convert` calls it at the end of every forward
of a converted model); it raises `RoutingError` there, naming the layer call it came from.
Under CUDA-graph capture nothing is read (as for sync-free dispatch); a call traced by torch.compile
queues its status at run time as an eager one does, where the layer gives the schedule its status sink.

`CommStats` report what a self-exchange would count (rows to itself are rows sent; see
`occult.moe.comm`): dedup T rows, standard T*k, forward at dispatch, backward when it runs (a call
traced by torch.compile books its backward's rows with its forward: its backward runs no Python).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from occult.moe.comm import CommStats, metadata_bytes
from occult.moe.contract import Handle, Received, Schedule
from occult.moe.expert_map import ExpertMap
from occult.moe.status import check_routing, queue


@dataclass
class LocalHandle(Handle):
    """What `combine` needs from a one-rank dispatch: only the bookkeeping."""

    rows: int  # rows a self-exchange would send each way
    row_bytes: int
    meta_bytes: int  # gates + slots out with the dispatch
    gate_grad_bytes: int  # the gate gradients back with its backward
    differentiable: bool  # whether a self-exchange would carry gradients back (rows or gates need them)
    stats: CommStats = field(default_factory=CommStats)


def _check_later(status: torch.Tensor, sink_1: torch.Tensor | None) -> None:
    """Queue `status` for `check_routing` (a CPU status is read at once: no wait to avoid); traced by
    torch.compile, through `sink_1` (`occult.moe.status`)."""
    check_routing()  # the previous one-rank call's: its routing ran before this call's attention
    queue(status.reshape(1), sink_1)


def dispatch_local(
    x_TH: torch.Tensor,
    weights_TK: torch.Tensor,
    ids_TK: torch.Tensor,
    expert_map: ExpertMap,
    schedule: Schedule,
    status: torch.Tensor | None,
    deduplicated: bool,
    slots_TK: torch.Tensor | None = None,
) -> tuple[Received, LocalHandle]:
    """The one-rank dispatch (module docstring); `ids_TK` already clamped into [0, E), or their local
    slots given (`slots_TK`, `occult.moe.plan.routed_slots`)."""
    if status is not None and not schedule.sync_free:
        _check_later(status, schedule.status_sink_1)
    schedule.run_while_waiting()
    num_tokens, top_k = ids_TK.shape
    rows = num_tokens if deduplicated else num_tokens * top_k
    handle = LocalHandle(
        rows,
        rows * x_TH.shape[1] * x_TH.element_size(),
        metadata_bytes(weights_TK),
        weights_TK.numel() * weights_TK.element_size(),
        torch.is_grad_enabled() and (x_TH.requires_grad or weights_TK.requires_grad),
        CommStats(),
    )
    _count(handle.stats, "forward", handle.rows, handle.row_bytes, handle.meta_bytes)
    handle.stats.dispatch_rows = rows
    slots = expert_map.slot_E[ids_TK] if slots_TK is None else slots_TK  # every expert is local: no padding
    return Received(x_TH, slots, weights_TK, dense=True), handle


def combine_local(y_TH: torch.Tensor, handle: LocalHandle) -> torch.Tensor:
    """The experts' output is already one row per token: count the return trip, hand it back."""
    handle.stats.combine_rows = handle.rows
    _count(handle.stats, "forward", handle.rows, handle.row_bytes, 0)
    if handle.differentiable and y_TH.requires_grad:  # backward: the combine's and dispatch's rows

        def count_backward(grad: torch.Tensor | None = None) -> None:
            _count(handle.stats, "backward", 2 * handle.rows, 2 * handle.row_bytes, handle.gate_grad_bytes)

        if torch.compiler.is_compiling():  # a compiled graph's backward cannot run a hook on Python state:
            count_backward()  # booked with the forward
        else:
            y_TH.register_hook(count_backward)
    return y_TH


def _count(stats: CommStats, direction: str, rows: int, row_bytes: int, meta_bytes: int) -> None:
    """Add rows sent (all to this rank itself) to `stats`, as `comm.record_sent` counts them."""
    for name, value in (("rows", rows), ("bytes", row_bytes), ("metadata_bytes", meta_bytes)):
        setattr(stats, f"{direction}_{name}", getattr(stats, f"{direction}_{name}") + value)
