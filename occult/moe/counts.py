"""The layer's one host synchronisation: row counts (and every rank's input status) swapped in
one small all-to-all and read once, so bad input on one rank raises the same clear error on
every rank instead of leaving the others waiting in a collective."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


class RoutingError(ValueError):
    """Input or router output that cannot be dispatched; raised on every rank of the group."""


# Status codes exchanged with the counts; 0 = fine.
STATUS_OK = 0
STATUS_MESSAGES = {
    1: "router produced NaN/inf gate weights (check the input activations and router weights for NaN/inf)",
    2: "router returned expert ids out of range",
    3: "input hidden size does not match the layer",
    4: "input dtype does not match the layer's weights (cast the input or the layer)",
    5: "more tokens than the training step's agreement allows (pass every call's token count to agreed_step)",
    6: "a sync-free call dropped token copies past its rows for another rank (its output and gradients are "
    "wrong): raise ExecConfig.sync_free_capacity, or set it to 1.0 (exact at any routing)",
}
STATUS_WRONG_HIDDEN = 3
STATUS_WRONG_DTYPE = 4
STATUS_OVER_STEP = 5
STATUS_OVER_CAPACITY = 6


def clamp_ids(ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Expert ids clamped into [0, E): safe to index with, whatever a router returned (one launch)."""
    return ids_TK.clamp(0, num_experts - 1)


def routing_status(
    weights_TK: torch.Tensor, ids_TK: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids clamped into [0, E), status): 2 ids out of range, else 1 NaN/inf gates, else 0.
    A device tensor (no host sync: the status travels with the counts); few launches."""
    clamped_TK = clamp_ids(ids_TK, num_experts)
    status = torch.where((clamped_TK != ids_TK).any(), 2, (~torch.isfinite(weights_TK)).any().to(torch.int64))
    return clamped_TK, status


def raise_on_bad_status(statuses: list[int]) -> None:
    """Raise `RoutingError` naming every rank that reported bad input (the same text on every rank)."""
    bad = [(r, s) for r, s in enumerate(statuses) if s != STATUS_OK]
    if bad:
        text = "; ".join(f"rank {r}: {STATUS_MESSAGES.get(s, f'status {s}')}" for r, s in bad)
        if all(s == STATUS_OVER_CAPACITY for _, s in bad):  # found after the call, on the rank that dropped them
            raise RoutingError(f"MoE layer call reported after it ran: {text}")
        raise RoutingError(f"MoE dispatch stopped on every rank because of bad input: {text}")


def read_to_host(t: torch.Tensor, while_waiting: Callable[[], None] | None = None) -> list:
    """`t.tolist()`, running `while_waiting` between queuing the device-to-host copy and waiting
    for it: GPU work queued there (e.g. a MoE block's shared experts) runs while the host waits
    and keeps the GPU busy while the host then launches what needed the values."""
    if while_waiting is None:
        return t.tolist()
    if not t.is_cuda:
        while_waiting()
        return t.tolist()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    while_waiting()
    copied.synchronize()
    return host.tolist()


def exchange_counts(
    send_counts_D: torch.Tensor,
    status: torch.Tensor,
    group: Any,
    while_waiting: Callable[[], None] | None = None,
) -> tuple[list[int], list[int]]:
    """Row counts per destination, swapped in one all-to-all and read with one host sync.

    Returns (send splits, receive splits), one count per rank each. Raises `RoutingError` on
    every rank when any rank reports bad input in `status`. `while_waiting` runs while the host
    waits for the counts (`read_to_host`).
    """
    D = send_counts_D.shape[0]
    header_D2 = torch.stack([send_counts_D.to(torch.int64), status.to(torch.int64).expand(D)], dim=1)
    if group is not None:
        recv_D2 = torch.empty_like(header_D2)
        dist.all_to_all_single(recv_D2, header_D2, group=group)
    else:
        recv_D2 = header_D2
    host = read_to_host(torch.cat([header_D2[:, 0], recv_D2.t().reshape(-1)]), while_waiting)
    send, recv, statuses = host[:D], host[D : 2 * D], host[2 * D :]
    raise_on_bad_status(statuses)
    return send, recv
