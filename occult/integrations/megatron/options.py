"""`OccultOptions`: what occult's Megatron-Core dispatcher runs (checked when made, before any model is built)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from occult.moe.config import TRANSPORTS
from occult.placement import Placement

DISPATCHERS = ("dedup", "standard")


@dataclass(frozen=True)
class OccultOptions:
    """`dispatcher`: "dedup" (one row per (token, EP rank)) or "standard" (per (token, expert));
    `placement`: a JSON path (`occult place`) or `occult.Placement` (None: Megatron's contiguous
    blocks), one layer for every MoE layer or one per MoE layer; `max_devices`: the router limits
    each token to experts on this many EP ranks; `transport`: how rows travel (`ExecConfig.transport`:
    "auto", "device" (counts kept on the GPU; NCCL GPUs of one host), "counts", "host" (through shared pinned
    host memory: NCCL GPUs of one host without peer-to-peer))."""

    dispatcher: str = "dedup"
    placement: str | Placement | None = None
    max_devices: int | None = None
    transport: str = "auto"
    loaded_placement: Placement | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(f"occult dispatcher must be one of {DISPATCHERS}, got {self.dispatcher!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"occult transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.max_devices is not None and (isinstance(self.max_devices, bool) or int(self.max_devices) < 1):
            raise ValueError(f"occult max_devices must be an integer >= 1 or None, got {self.max_devices!r}")
        placement = self.placement
        if placement is not None and not isinstance(placement, Placement):
            placement = Placement.load(placement)  # read now, once: a bad path or file fails here
        object.__setattr__(self, "loaded_placement", placement)

    def describe(self) -> dict[str, Any]:
        """The options as plain values (for run records)."""
        placement = self.placement if self.placement is None or isinstance(self.placement, str) else "Placement"
        return {
            "dispatcher": self.dispatcher,
            "placement": str(placement) if placement is not None else None,
            "max_devices": self.max_devices,
            "transport": self.transport,
        }
