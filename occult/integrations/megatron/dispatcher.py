"""`OccultTokenDispatcher`: occult's deduplicated all-to-all behind Megatron-Core's `MoETokenDispatcher` seam.

Megatron's `MoELayer` calls, per forward: `dispatch_preprocess(x, routing_map, probs)`,
`token_dispatch`, `dispatch_postprocess` -> (expert-major rows, tokens per local expert, probs per
row) for its experts (`SequentialMLP`, `TEGroupedMLP`, `GroupedMLP`: they apply the probs
themselves), then `combine_preprocess`, `token_combine`, `combine_postprocess` on their output.
Here:

1. preprocess: Megatron's dense `routing_map` / `probs` [T, E] become top-k ids and weights [T, K];
2. dispatch: occult sends every token once per EP rank holding any of its experts (`dedup`; or
   once per expert, `standard`), with the local expert slots and probs it needs there;
3. postprocess: the receiving rank expands each row to one row per (token, local expert),
   expert-major, in (source rank, token) order inside an expert, as Megatron's `alltoall` does;
4. combine: the experts' (already prob-weighted) outputs are summed per received row on the
   expert's rank (pre-reduced) and one row per (token, rank) goes back, summed per token in fp32.

Expert ids are the router's (the model's order); with a placement, local expert j of EP rank r is
`placement.experts_on_device(r)[j]` (occult/integrations/megatron/placement.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from occult.integrations.exchange import OccultExchange
from occult.integrations.expand import expand, reduce
from occult.integrations.megatron.options import OccultOptions
from occult.integrations.megatron.placement import load_placement, moe_layer_index
from occult.moe.pruning import devices_per_token
from occult.placement import Placement, PlacementError


def unsupported_settings(config: Any, tp_size: int) -> str | None:
    """What of Megatron's MoE configuration occult's dispatcher does not run (None: all of it runs)."""
    if tp_size > 1:
        return f"expert tensor parallelism (expert_tensor_parallel_size={tp_size}): use 1"
    if config.moe_expert_capacity_factor is not None or config.moe_pad_expert_input_to_capacity:
        return "token dropping (moe_expert_capacity_factor / moe_pad_expert_input_to_capacity): occult is dropless"
    if getattr(config, "moe_router_padding_for_quantization", False):
        return "moe_router_padding_for_quantization"
    if config.moe_shared_expert_overlap:
        return "moe_shared_expert_overlap (shared experts still run, without the overlap): set it False"
    if getattr(config, "moe_latent_size", None):
        return "moe_latent_size"
    return None


class OccultTokenDispatcher(MoETokenDispatcher):
    """Megatron-Core token dispatcher over occult's deduplicated all-to-all (module docstring)."""

    def __init__(
        self,
        num_local_experts: int,
        local_expert_indices: list[int],
        config: Any,
        pg_collection: Any = None,
        options: OccultOptions | None = None,
    ) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        problem = unsupported_settings(config, self.tp_size)
        if problem is not None:
            raise NotImplementedError(f"occult's Megatron-Core dispatcher does not support {problem}")
        self.options = options if options is not None else OccultOptions()
        self.num_experts, self.num_local_experts = config.num_moe_experts, num_local_experts
        self.local_expert_indices = local_expert_indices
        self.top_k = config.moe_router_topk
        self.layer_index = 0
        self.placement = self.layer_placement(0)  # checked now: a bad placement fails when the model is built
        self.exchange: OccultExchange | None = None
        self.limit_checked = False
        self.last_comm_stats: Any = None
        # one forward's state, from dispatch_preprocess to combine_postprocess
        self.hidden_shape: torch.Size | None = None
        self.ids_TK: torch.Tensor | None = None
        self.slots_RK: torch.Tensor | None = None
        self.handle: Any = None
        self.expansion: Any = None

    def layer_placement(self, layer_index: int) -> Placement:
        """This layer's one-layer placement over the EP group (MoE layer `layer_index` of the model)."""
        placement = load_placement(self.options.loaded_placement, self.num_experts, self.ep_size)
        if placement.num_layers == 1:
            return placement
        if not 0 <= layer_index < placement.num_layers:
            raise PlacementError(
                f"MoE layer {layer_index} is beyond the placement's {placement.num_layers} layers: give one layer "
                "per MoE layer of the model, or one layer for all"
            )
        return placement.layer(layer_index)

    def set_layer_number(self, layer_number: int | None) -> None:
        """Megatron's layer number (1-based, set when the transformer layer is built) -> this layer's placement."""
        self.layer_index = moe_layer_index(self.config, layer_number)
        self.placement, self.exchange = self.layer_placement(self.layer_index), None

    def expert_device_E(self) -> torch.Tensor:
        """[E] the EP rank of each expert (the router's `max_devices` limit counts these)."""
        return self.placement.tensors(0)[0]

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """[S, B, H] tokens, dense [T, E] map and probs -> x_TH and the chosen experts' probs weights_TK."""
        self.hidden_shape = hidden_states.shape
        x_TH = hidden_states.reshape(-1, self.hidden_shape[-1])
        if self.config.overlap_moe_expert_parallel_comm:  # its 1F1B schedule frees this input after the dispatch
            x_TH = x_TH.clone()  # (the router and shared experts keep the norm output x_TH views for backward)
        # each row of a dropless routing map has top_k entries: their columns are the expert ids
        self.ids_TK = torch.topk(routing_map.to(torch.int8), self.top_k, dim=1).indices
        return x_TH, probs.gather(1, self.ids_TK)

    def token_dispatch(self, x_TH: torch.Tensor, weights_TK: torch.Tensor):
        """occult's all-to-all: -> (received rows x_RH, their gate weights gates_RK)."""
        if self.exchange is None:
            self.exchange = OccultExchange(
                self.options.dispatcher, self.ep_group, self.placement, 0, x_TH.device, self.options.transport
            )
        if self.options.max_devices is not None and not self.limit_checked:
            self.check_limit(self.ids_TK)
        received, self.handle = self.exchange.dispatch(x_TH, weights_TK, self.ids_TK)
        self.slots_RK = received.slots_RK
        self.last_comm_stats = self.exchange.stats(self.handle)
        return received.x_RH, received.gates_RK

    def dispatch_postprocess(self, x_RH: torch.Tensor, gates_RK: torch.Tensor):
        """-> (rows x_NH expert-major, tokens per local expert (host tensor, as Megatron's), probs_N)."""
        x_NH, _, self.expansion = expand(x_RH, self.slots_RK, gates_RK, self.num_local_experts)
        self.slots_RK = None
        return x_NH, self.expansion.counts_host_e, self.expansion.gate_N

    def combine_preprocess(self, y_NH: torch.Tensor) -> torch.Tensor:
        """Sum the experts' prob-weighted outputs per received row (fp32): one row per (token, rank) goes back."""
        return reduce(y_NH, self.expansion, weighted=False)

    def token_combine(self, y_RH: torch.Tensor) -> torch.Tensor:
        """Each received row's result back to its source rank, summed per token in fp32 -> y_TH."""
        y_TH = self.exchange.combine(y_RH, self.handle)
        self.handle = self.expansion = None
        return y_TH.to(y_RH.dtype)

    def combine_postprocess(self, y_TH: torch.Tensor) -> torch.Tensor:
        """[T, H] -> the input's [S, B, H]."""
        return y_TH.view(self.hidden_shape)

    def set_shared_experts(self, shared_experts: Any) -> None:
        raise NotImplementedError(
            "occult's Megatron-Core dispatcher does not overlap shared experts with its all-to-all: set "
            "moe_shared_expert_overlap=False (the shared experts still run)"
        )

    def check_limit(self, ids_TK: torch.Tensor) -> None:
        """Once, on every rank: `max_devices` is a routing rule, so the router must have applied it."""
        spread = devices_per_token(ids_TK, self.expert_device_E().to(ids_TK.device))
        worst = torch.stack([spread.max() if spread.numel() else spread.new_zeros(())]).to(torch.int64)
        if self.ep_size > 1:
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=self.ep_group)
        if int(worst) > self.options.max_devices:
            raise ValueError(
                f"occult's Megatron dispatcher has max_devices={self.options.max_devices}, but the router sent a token "
                f"to experts on {int(worst)} EP ranks: the limit is applied by occult's router "
                "(occult.integrations.megatron.install(spec, max_devices=...) puts it in)"
            )
        self.limit_checked = True
