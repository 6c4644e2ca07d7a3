"""`OccultTokenDispatcher`: occult's deduplicated all-to-all behind TorchTitan's dispatcher seam.

TorchTitan 0.3.0's `RoutedExperts` calls `dispatch(x_TD, topk_scores_TK, topk_expert_ids_TK,
num_local_tokens_per_expert_E)`, runs its own `GroupedExperts` on the expert-major rows it gets
back (one count per local expert) and calls `combine(routed_output_RD, metadata, x_TD)`. Here:

1. dispatch: occult sends every token once per EP rank holding any of its experts (`dedup`; or
   once per expert, `standard`), with the local expert slots and gate weights it needs there;
2. the receiving rank expands each row to one row per (token, local expert), expert-major;
3. combine: the experts' outputs are gate-weighted and summed per received row on the expert's
   rank (pre-reduced), and one row per (token, rank) goes back, summed per token in fp32.

With `fused_experts=True` step 2 and the reduction go: `dispatch` hands the received rows as they are
(`occult.moe.contract.Received`: rows, local expert slots, gate weights) to `OccultGroupedExperts`
(`occult.integrations.torchtitan.experts`), which runs occult's fused expert kernels on them and returns
one gate-weighted, pre-reduced row per received row; `combine` sends them back. The pair is switched on
together (`install(..., fused_experts=True)`): TorchTitan's own `GroupedExperts` cannot read those rows.

Expert ids are the router's (the model's expert order). With a `placement`, expert `e` lives on
rank `placement.expert_device(layer)[e]` at local slot `placement.expert_slot(layer)[e]`, so the
expert weight tensors hold experts in *placed order* (`Placement.apply`): TorchTitan's EP still
cuts them into contiguous blocks, and block r is rank r's experts. Router columns, the
load-balancing bias and `tokens_per_expert_E` stay in the model's order (docs/integrations.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.models.common.token_dispatcher import BaseEPTokenDispatcher, LocalTokenDispatcher

from occult.integrations.exchange import OccultExchange
from occult.integrations.expand import Expansion, expand, reduce
from occult.integrations.torchtitan.placement import load_placement
from occult.moe.contract import Received
from occult.moe.pruning import devices_per_token
from occult.placement import PlacementError

DISPATCHERS = ("dedup", "standard")


@dataclass(frozen=True)
class OccultDispatchMetadata:
    """What `combine` needs: occult's dispatch handle (None on one rank) and where each expert-major row came
    from (None with fused experts: their rows are the received rows, already summed per row)."""

    handle: Any
    expansion: Expansion | None


class OccultTokenDispatcher(BaseEPTokenDispatcher):
    """TorchTitan token dispatcher over occult's deduplicated all-to-all (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseEPTokenDispatcher.Config):
        dispatcher: str = "dedup"  # "dedup": one row per (token, rank); "standard": per (token, expert)
        placement: Any = None  # JSON path or occult.Placement (None: contiguous blocks, TorchTitan's own)
        layer_index: int = 0  # which layer of a multi-layer placement this MoE layer is
        max_devices: int | None = None  # the router limits each token to this many EP ranks (OccultRouter)
        transport: str = "auto"  # how rows travel: ExecConfig.transport ("device": counts stay on the GPU)
        fused_experts: bool = False  # hand the received rows to OccultGroupedExperts (occult's kernels), no expansion
        sync_free: bool = False  # fixed-capacity exchanges, no host wait (every rank the same token count)

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        if config.dispatcher not in DISPATCHERS:
            raise ValueError(
                f"OccultTokenDispatcher: dispatcher must be one of {DISPATCHERS}, got {config.dispatcher!r}"
            )
        if config.max_devices is not None and int(config.max_devices) < 1:
            raise ValueError(f"OccultTokenDispatcher: max_devices must be >= 1 or None, got {config.max_devices}")
        self.dispatcher_name = config.dispatcher
        self.placement_spec, self.layer_index = config.placement, config.layer_index
        self.max_devices, self.transport = config.max_devices, config.transport
        self.fused_experts, self.sync_free = config.fused_experts, config.sync_free
        self.exchange: OccultExchange | None = None
        self.physical_E: torch.Tensor | None = None
        self.limit_checked = False
        self.last_comm_stats: Any = None

    def init_buffer(self) -> None:
        """Build occult's dispatcher over the EP mesh's process group (no buffers to allocate)."""
        num_ranks = 1 if self.ep_mesh is None else self.ep_mesh.size()
        placement = load_placement(self.placement_spec, self.num_experts, num_ranks)
        layer = self.layer_index if placement.num_layers > 1 else 0
        if not 0 <= layer < placement.num_layers:
            raise PlacementError(
                f"MoE layer {self.layer_index} is beyond the placement's {placement.num_layers} layers"
            )
        if self.ep_mesh is None:  # EP = 1: local reordering, experts in the placement's order
            device_E, slot_E = placement.tensors(layer)
            self.physical_E = device_E * placement.experts_per_device + slot_E
            return
        if placement.num_devices != num_ranks:
            raise PlacementError(
                f"the placement is for {placement.num_devices} devices, but TorchTitan's EP mesh has "
                f"{num_ranks} ranks: make one with `occult place --devices {num_ranks}`"
            )
        device = torch.device(self.ep_mesh.device_type)
        self.exchange = OccultExchange(
            self.dispatcher_name,
            self.ep_mesh.get_group(),
            placement.layer(layer),
            0,
            device,
            self.transport,
            sync_free=self.sync_free,
        )

    def dispatch(
        self,
        x_TD: torch.Tensor,
        topk_scores_TK: torch.Tensor,
        topk_expert_ids_TK: torch.Tensor,
        num_local_tokens_per_expert_E: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | Received, Any]:
        """-> (rows x_ND expert-major, rows per local expert counts_e, metadata for `combine`); with fused experts
        (received rows x_RD, the `Received` rows with their slots and gates, metadata)."""
        if self.exchange is None:  # EP = 1 (wire_meshes gave no mesh, or the model was never parallelised)
            return self._local_dispatch(x_TD, topk_scores_TK, topk_expert_ids_TK)
        if self.max_devices is not None and not self.limit_checked:
            self._check_limit(topk_expert_ids_TK)
        received, handle = self.exchange.dispatch(x_TD, topk_scores_TK, topk_expert_ids_TK)
        if self.fused_experts:
            self.last_comm_stats = self.exchange.stats(handle)
            return received.x_RH, received, OccultDispatchMetadata(handle, None)
        local_experts = self.num_experts // self.ep_mesh.size()
        x_ND, counts_e, expansion = expand(received.x_RH, received.slots_RK, received.gates_RK, local_experts)
        self.last_comm_stats = self.exchange.stats(handle)
        return x_ND, counts_e, OccultDispatchMetadata(handle, expansion)

    def combine(self, routed_output_RD: torch.Tensor, metadata: Any, x_TD: torch.Tensor) -> torch.Tensor:
        """Gate-weight and pre-reduce per received row, send one row back per row received, sum per token."""
        if not isinstance(metadata, OccultDispatchMetadata):
            return LocalTokenDispatcher.combine(self, routed_output_RD, metadata, x_TD)
        if metadata.handle is None:  # fused experts on one rank: one row per token, already summed
            return routed_output_RD.to(x_TD.dtype)
        y_RD = routed_output_RD if metadata.expansion is None else reduce(routed_output_RD, metadata.expansion)
        return self.exchange.combine(y_RD, metadata.handle).to(x_TD.dtype)

    def _local_dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK):
        """EP = 1: TorchTitan's local reordering, expert ids turned into placed-order positions."""
        if self.physical_E is None:
            self.init_buffer()
        if self.physical_E.device != topk_expert_ids_TK.device:
            self.physical_E = self.physical_E.to(topk_expert_ids_TK.device)
        ids_TK = self.physical_E[topk_expert_ids_TK]
        if self.fused_experts:  # every expert local: the tokens are the rows, their placed positions the slots
            rows = Received(x_TD, ids_TK, topk_scores_TK, dense=True)
            return x_TD, rows, OccultDispatchMetadata(None, None)
        counts_E = torch.zeros(self.num_experts, dtype=torch.int64, device=ids_TK.device)
        counts_E.index_add_(0, ids_TK.reshape(-1), torch.ones_like(ids_TK.reshape(-1)))
        return LocalTokenDispatcher.dispatch(self, x_TD, topk_scores_TK, ids_TK, counts_E)

    def _check_limit(self, ids_TK: torch.Tensor) -> None:
        """Once, on every rank: `max_devices` is a routing rule, so the router must have applied it."""
        spread = devices_per_token(ids_TK, self.exchange.expert_map.device_E.to(ids_TK.device))
        worst = torch.stack([spread.max() if spread.numel() else spread.new_zeros(())]).to(torch.int64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=self.ep_mesh.get_group())
        if int(worst) > self.max_devices:
            raise ValueError(
                f"OccultTokenDispatcher has max_devices={self.max_devices}, but the router sent a token to experts on "
                f"{int(worst)} EP ranks: the limit is applied by occult's router. Switch it on with "
                "occult.integrations.torchtitan.install(model_config, max_devices=...) or the occult_moe override, "
                "which replace the router too"
            )
        self.limit_checked = True
