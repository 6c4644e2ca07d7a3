"""occult inside TorchTitan (0.3.0): a token dispatcher switched on by config.

- `OccultTokenDispatcher` (a TorchTitan `BaseEPTokenDispatcher`): occult's deduplicated
  all-to-all (one row per token and EP rank), expanded to expert-major rows for TorchTitan's
  own `GroupedExperts`, pre-reduced per (token, rank) before the combine's all-to-all.
- `OccultGroupedExperts`: TorchTitan's grouped experts (same parameters) run by occult's fused
  expert kernels on the received rows as they arrive (`fused_experts=True`: no expansion).
- `OccultRouter`: TorchTitan's router with occult's collaboration pruning (`max_devices`).
- `install(model_config, ...)`: both into every MoE block of a model config; `occult_moe` is the
  same as a TorchTitan override for its trainer (`--override.imports`).
- `to_placed_order` / `to_model_order`: expert weights of a state dict for a placement.

Import it explicitly (it imports TorchTitan); docs/integrations.md has the recipe.
"""

from typing import Any

from torchtitan.config.override import override
from torchtitan.models.common.decoder import Decoder

from occult.integrations.torchtitan.dispatcher import OccultDispatchMetadata, OccultTokenDispatcher
from occult.integrations.torchtitan.experts import OccultGroupedExperts
from occult.integrations.torchtitan.install import install
from occult.integrations.torchtitan.placement import load_placement, to_model_order, to_placed_order
from occult.integrations.torchtitan.router import OccultRouter

__all__ = [
    "OccultTokenDispatcher",
    "OccultDispatchMetadata",
    "OccultGroupedExperts",
    "OccultRouter",
    "install",
    "occult_moe",
    "load_placement",
    "to_placed_order",
    "to_model_order",
]


@override(
    target=Decoder.Config,
    description="occult: deduplicated all-to-all token dispatch (one row per token and EP rank), expert "
    "placement, collaboration pruning, fused expert kernels",
)
def occult_moe(
    cfg: Any,
    *,
    dispatcher: str = "dedup",
    placement: str | None = None,
    max_devices: int | None = None,
    transport: str = "auto",
    fused_experts: bool = False,
    sync_free: bool = False,
) -> Any:
    """TorchTitan override: `--override.imports 'occult.integrations.torchtitan.occult_moe={"placement": "p.json"}'`
    (keys: dispatcher, placement, max_devices, transport, fused_experts, sync_free) runs `install` on the model
    config."""
    install(
        cfg,
        dispatcher=dispatcher,
        placement=placement,
        max_devices=max_devices,
        transport=transport,
        fused_experts=fused_experts,
        sync_free=sync_free,
    )
    return cfg
