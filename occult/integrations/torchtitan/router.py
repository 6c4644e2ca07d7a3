"""`OccultRouter`: TorchTitan's top-k router with occult's collaboration pruning (`max_devices`).

The router limits every token to experts on at most `max_devices` EP ranks (occult's
router-score variant, `occult.moe.pruning.device_limited_topk`: walk the experts by score,
collect ranks until N distinct ones, take the top-k among the experts on them). Everything else
is TorchTitan's `TokenChoiceTopKRouter`: the gate in fp32, softmax or sigmoid scores, the
load-balancing bias for the choice only, node-limited groups (DeepSeek-V3), `route_norm`,
`route_scale`. Without `max_devices` it is TorchTitan's router unchanged. It also refuses what
the occult dispatcher does not support yet (tensor parallelism), when the model is parallelised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torchtitan.models.common.moe import TokenChoiceTopKRouter

from occult.integrations.torchtitan.placement import load_placement
from occult.moe.pruning import device_limited_topk


class OccultRouter(TokenChoiceTopKRouter):
    """TorchTitan's `TokenChoiceTopKRouter`, optionally device-limited (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(TokenChoiceTopKRouter.Config):
        max_devices: int | None = None  # at most this many EP ranks per token (None: plain top-k)
        placement: Any = None  # JSON path or occult.Placement (None: contiguous over the EP ranks)
        layer_index: int = 0

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        if config.max_devices is not None and int(config.max_devices) < 1:
            raise ValueError(f"OccultRouter: max_devices must be >= 1 or None, got {config.max_devices}")
        if config.max_devices is not None and config._debug_force_load_balance:
            raise ValueError("OccultRouter: max_devices and _debug_force_load_balance cannot be combined")
        self.max_devices = config.max_devices
        self.placement_spec, self.layer_index = config.placement, config.layer_index
        self.expert_device_E: torch.Tensor | None = None
        self.set_num_devices(1)

    def set_num_devices(self, num_devices: int) -> None:
        """Where the experts live: the placement's layer, or contiguous blocks over `num_devices` ranks."""
        placement = load_placement(self.placement_spec, self.num_experts, num_devices)
        self.expert_device_E = placement.tensors(self.layer_index if placement.num_layers > 1 else 0)[0]
        room = None if self.max_devices is None else self.max_devices * placement.experts_per_device
        if room is not None and placement.num_devices > 1 and room < self.top_k:
            raise ValueError(
                f"OccultRouter: max_devices={self.max_devices} EP ranks hold only {room} experts, fewer "
                f"than top_k={self.top_k}: raise max_devices to at least "
                f"{-(-self.top_k // placement.experts_per_device)}"
            )

    def parallelize(self, parallel_dims: Any) -> None:
        if getattr(parallel_dims, "tp", 1) > 1:
            raise NotImplementedError(
                f"occult's TorchTitan dispatcher does not support tensor parallelism yet (tensor_parallel_degree="
                f"{parallel_dims.tp}); use expert, data, context or pipeline parallelism, or switch occult off"
            )
        super().parallelize(parallel_dims)
        if getattr(parallel_dims, "ep", 1) > 1:
            self.set_num_devices(parallel_dims.ep)

    def forward(self, x_BLD: torch.Tensor, expert_bias_E: torch.Tensor | None = None):
        if self.max_devices is None:
            return super().forward(x_BLD, expert_bias_E)
        with torch.autocast(device_type=x_BLD.device.type, dtype=torch.float32):
            scores_BLE = self.gate(x_BLD)
        if self.score_func == "sigmoid":
            scores_BLE = torch.sigmoid(scores_BLE)
        elif self.score_func == "softmax":
            scores_BLE = F.softmax(scores_BLE, dim=-1)
        else:
            raise NotImplementedError(f"Unknown score function {self.score_func}")
        choice_BLE = scores_BLE if expert_bias_E is None else scores_BLE + expert_bias_E
        if self.num_expert_groups is not None:
            choice_BLE = self._get_node_limited_routing_scores(choice_BLE)
        E = self.num_experts
        if self.expert_device_E.device != scores_BLE.device:
            self.expert_device_E = self.expert_device_E.to(scores_BLE.device)
        _, ids_TK = device_limited_topk(
            choice_BLE.detach().reshape(-1, E), self.top_k, self.expert_device_E, self.max_devices
        )
        topk_expert_ids_BLK = ids_TK.view(*scores_BLE.shape[:-1], self.top_k)
        topk_scores_BLK = scores_BLE.gather(dim=-1, index=topk_expert_ids_BLK)
        if self.route_norm:
            topk_scores_BLK = topk_scores_BLK / (topk_scores_BLK.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_scores_BLK * self.route_scale, topk_expert_ids_BLK, scores_BLE
