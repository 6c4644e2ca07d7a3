"""`OccultRouter`: Megatron-Core's `TopKRouter` with occult's collaboration pruning (`max_devices`).

The router limits every token to experts on at most `max_devices` EP ranks (occult's
router-score variant: walk the experts by score, collect ranks until N distinct ones, take the
top-k among the experts on them; `occult.moe.pruning.allowed_devices`). Everything else is
Megatron's: the gating in `moe_router_dtype`, softmax (pre- or post-top-k) or sigmoid scores,
the expert bias for the choice only, group-limited routing, the scaling factor, every aux loss
(computed on the unpruned scores, as Megatron computes them).

The limit goes in through the one hook Megatron's `topk_routing_with_score_function` offers around
its top-k (the `router_replay` object, 0.16 and 0.19): the scores of experts on other ranks are
set to -inf before Megatron's own top-k runs, so the probabilities of the chosen experts are
Megatron's. Without `max_devices` it is Megatron's `TopKRouter` unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from megatron.core.transformer.moe.router import TopKRouter

from occult.moe.pruning import allowed_devices


class DeviceLimitedTopK:
    """Stands in for Megatron's `RouterReplay` inside its routing: top-k within each token's first N ranks."""

    def __init__(self, expert_device_E: torch.Tensor, max_devices: int) -> None:
        self.expert_device_E, self.max_devices = expert_device_E, max_devices

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Callable | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Megatron's top-k (`default_compute_topk`) on the scores of the allowed experts only."""
        if self.expert_device_E.device != scores.device:
            self.expert_device_E = self.expert_device_E.to(scores.device)
        allowed_TE = allowed_devices(scores.detach().float(), self.expert_device_E, self.max_devices)
        limited = scores.masked_fill(~allowed_TE, float("-inf"))
        return default_compute_topk(limited, topk, num_groups=num_groups, group_topk=group_topk)


class OccultRouter(TopKRouter):
    """Megatron's `TopKRouter`, optionally device-limited (module docstring); built by Megatron as its own."""

    def set_device_limit(self, max_devices: int | None, expert_device_E: torch.Tensor) -> None:
        """Limit each token to experts on `max_devices` EP ranks, expert e living on rank `expert_device_E[e]`."""
        if max_devices is None:
            if isinstance(self.router_replay, DeviceLimitedTopK):
                self.router_replay = None
            return
        config = self.config
        for setting, why in (
            ("moe_enable_routing_replay", "it uses the same hook"),
            ("moe_router_fusion", "the fused top-k has no hook for the limit"),
        ):
            if getattr(config, setting, False):
                raise ValueError(f"occult max_devices cannot be combined with {setting}=True ({why}): set it False")
        if self.routing_type in ("sinkhorn", "quantile_balancing"):  # their routing bypasses the top-k hook
            raise ValueError(
                f"occult max_devices needs top-k routing, not moe_router_load_balancing_type={self.routing_type!r}"
            )
        num_devices = int(expert_device_E.max()) + 1
        per_device = expert_device_E.numel() // num_devices
        if num_devices > 1 and max_devices * per_device < self.topk:
            raise ValueError(
                f"occult max_devices={max_devices} EP ranks hold only {max_devices * per_device} experts, fewer than "
                f"moe_router_topk={self.topk}: raise max_devices to at least {-(-self.topk // per_device)}"
            )
        self.router_replay = DeviceLimitedTopK(expert_device_E, int(max_devices))
