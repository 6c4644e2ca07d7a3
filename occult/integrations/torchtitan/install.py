"""Switching occult on in a TorchTitan model config: `install`, and the `occult_moe` override.

`install(model_config, dispatcher=..., placement=..., max_devices=..., fused_experts=..., sync_free=...)` replaces, in
every MoE block of a TorchTitan model config (`layers.*.moe`, and DeepSeek-V3's `mtp_layers.*.moe`), the
token dispatcher (`RoutedExperts.Config.token_dispatcher`) by `OccultTokenDispatcher.Config` and
the router by `OccultRouter.Config` (TorchTitan's router, plus `max_devices`); with `fused_experts`
also the grouped experts (`RoutedExperts.Config.inner_experts`) by `OccultGroupedExperts.Config`
(the same parameters, occult's kernels); MoE block i uses layer i of a multi-layer placement. Call it
before `model_config.build()`.

TorchTitan's trainer applies it from its own config through the override mechanism
(`occult.integrations.torchtitan.occult_moe`, docs/integrations.md).
"""

from __future__ import annotations

import copy
from typing import Any

from torchtitan.config.override import derive
from torchtitan.models.common.moe import MoE

from occult.integrations.torchtitan.dispatcher import DISPATCHERS, OccultTokenDispatcher
from occult.integrations.torchtitan.experts import OccultGroupedExperts
from occult.integrations.torchtitan.router import OccultRouter
from occult.moe.config import TRANSPORTS
from occult.placement import Placement, PlacementError


def install(
    model_config: Any,
    *,
    dispatcher: str = "dedup",
    placement: str | Placement | None = None,
    max_devices: int | None = None,
    transport: str = "auto",
    fused_experts: bool = False,
    sync_free: bool = False,
) -> int:
    """Put occult's dispatcher (and router) into every MoE block of `model_config`; returns how many.

    `placement`: a JSON path or `occult.Placement` (None: TorchTitan's contiguous blocks); the
    expert weights must then be in placed order (`to_placed_order`). `max_devices`: limit each
    token to experts on that many EP ranks (collaboration pruning, approximate: fine-tune with it).
    `transport`: how rows travel, as `ExecConfig.transport` ("device": counts kept on the GPU, no
    host wait; NCCL groups of one host, an error elsewhere when the EP group is built).
    `fused_experts`: the experts run by occult's fused kernels on the received rows
    (`OccultGroupedExperts`), no expert-major expansion. `sync_free`: fixed-capacity exchanges whose sizes follow
    from shapes (no host wait; every rank the same token count; unused capacity travels).
    """
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"occult dispatcher must be one of {DISPATCHERS}, got {dispatcher!r}")
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if max_devices is not None and int(max_devices) < 1:
        raise ValueError(f"max_devices must be >= 1 or None, got {max_devices}")
    for name, flag in (("fused_experts", fused_experts), ("sync_free", sync_free)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be True or False, got {flag!r}")
    found = [(parent, attr, cfg) for _, cfg, parent, attr in model_config.traverse(MoE.Config)]
    if not found:
        raise ValueError(f"{type(model_config).__qualname__} has no MoE blocks (MoE.Config) for occult's dispatcher")
    if placement is not None and not isinstance(placement, Placement):
        loaded = Placement.load(placement)  # read now: a bad path or file fails here, not at the first step
        if loaded.num_layers not in (1, len(found)):
            raise PlacementError(
                f"the placement has {loaded.num_layers} layers, but the model has {len(found)} MoE "
                "blocks: give one layer per MoE block, or one layer for all"
            )
    elif placement is not None and placement.num_layers not in (1, len(found)):
        raise PlacementError(
            f"the placement has {placement.num_layers} layers, but the model has {len(found)} MoE "
            "blocks: give one layer per MoE block, or one layer for all"
        )
    for i, (parent, attr, moe) in enumerate(found):
        moe = copy.copy(moe)  # blocks may share one config object; each gets its own layer index
        moe.routed_experts = copy.copy(moe.routed_experts)
        td = moe.routed_experts.token_dispatcher
        moe.routed_experts.token_dispatcher = OccultTokenDispatcher.Config(
            num_experts=td.num_experts,
            top_k=td.top_k,
            dispatcher=dispatcher,
            placement=placement,
            layer_index=i,
            max_devices=max_devices,
            transport=transport,
            fused_experts=fused_experts,
            sync_free=sync_free,
        )
        if fused_experts:
            moe.routed_experts.inner_experts = derive(moe.routed_experts.inner_experts, OccultGroupedExperts.Config)
        moe.router = derive(
            moe.router, OccultRouter.Config, max_devices=max_devices, placement=placement, layer_index=i
        )
        if isinstance(attr, int):
            parent[attr] = moe
        else:
            setattr(parent, attr, moe)
    return len(found)
