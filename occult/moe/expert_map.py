"""Where a layer's experts live: the device and the local slot of every global expert id."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertMap:
    """`device_E[e]`: the rank (of the layer's group) holding expert `e`; `slot_E[e]`: its slot
    among that rank's experts (slots in ascending global-id order, as `Placement` gives them).

    Both are int64 tensors on the layer's device. The map is a view of the layer's buffers:
    re-placing experts (`occult.lm.migrate`) updates those in place, and the next map sees it.
    """

    device_E: torch.Tensor
    slot_E: torch.Tensor

    @property
    def num_experts(self) -> int:
        return int(self.device_E.shape[0])

    def experts_per_device(self, num_devices: int) -> int:
        """E / D (a balanced placement: every device holds as many experts)."""
        return self.num_experts // num_devices

    def coarsen(self, devices_per_group: int, experts_per_device: int) -> ExpertMap:
        """The same experts seen by groups of G = `devices_per_group` consecutive devices (e.g.
        nodes): device d -> d // G, slot -> (d % G) * S + slot, S = `experts_per_device` (a code
        unique inside the group). No host sync."""
        G = devices_per_group
        return ExpertMap(self.device_E // G, (self.device_E % G) * experts_per_device + self.slot_E)
