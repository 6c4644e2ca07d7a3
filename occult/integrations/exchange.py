"""The one place where the framework integrations (TorchTitan, Megatron-Core) call occult's dispatcher
(`occult.moe`).

`OccultExchange` wraps a `Dispatcher` behind two calls, so a change of occult's dispatcher
contract is a change of this file only:

    received, handle = exchange.dispatch(x_TH, weights_TK, ids_TK)   # rows x_RH, slots_RK, gates_RK
    y_TH = exchange.combine(y_RH, handle)                           # one result row per received row
"""

from __future__ import annotations

from typing import Any

import torch

from occult.moe.contract import Received, Schedule
from occult.moe.expert_map import ExpertMap
from occult.moe.registry import make_dispatcher
from occult.placement import Placement


class OccultExchange:
    """occult's dispatch and combine over one process group, for one layer's placement."""

    def __init__(
        self,
        dispatcher: str,
        group: Any,
        placement: Placement,
        layer: int,
        device: torch.device,
        transport: str = "auto",
        sync_free: bool = False,
    ) -> None:
        """`sync_free`: fixed-capacity exchanges whose sizes follow from shapes (`Schedule.sync_free`: no host wait,
        every rank the same token count, bad input raised on its rank only)."""
        self.dispatcher = make_dispatcher(dispatcher, group, placement=placement, transport=transport)
        self.expert_map = ExpertMap(*placement.tensors(layer, device=device))
        self.schedule = Schedule(sync_free=sync_free)

    def to(self, device: torch.device) -> OccultExchange:
        if self.expert_map.device_E.device != device:
            self.expert_map = ExpertMap(self.expert_map.device_E.to(device), self.expert_map.slot_E.to(device))
        return self

    def dispatch(self, x_TH: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor) -> tuple[Received, Any]:
        """Send every token once per device holding any of its experts (standard: once per expert).

        `Received` holds one row per (token, this rank) pair (dedup) or per (token, expert) pair
        (standard), the local expert slot of each of the row's entries (-1: padding) and their gate
        weights. Bad input (ids out of range, NaN/inf gate weights) raises `occult.RoutingError` on
        every rank of the group, not only where it happened (the status travels with the row counts)."""
        self.to(x_TH.device)
        return self.dispatcher.dispatch(x_TH, weights_TK, ids_TK, self.expert_map, self.schedule)

    def combine(self, y_RH: torch.Tensor, handle: Any) -> torch.Tensor:
        """Each received row's result back to its source rank, summed per token in fp32 -> y_TH."""
        return self.dispatcher.combine(y_RH, handle)

    @staticmethod
    def stats(handle: Any) -> Any:
        """The `occult.CommStats` of the exchange behind `handle` (rows and bytes sent; the combine's
        and backward's rows are added as they run)."""
        return handle.stats
