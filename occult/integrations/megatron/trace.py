"""`RoutingTrace`: a Megatron-Core model's routing, recorded for `occult place`.

A placement is solved from a routing trace (which experts each token chose, per MoE layer). For a
Megatron model the trace comes from its own routers: `RoutingTrace(model)` puts a forward hook on the
router of every `MoELayer` (Megatron's, or occult's `OccultMoELayer`), in the model's layer order, and
records each token's chosen experts from the router's dense routing map (rows without `top_k` experts,
padding, are left out). Run forwards as usual (training steps or `torch.no_grad()` batches), then
`save(path)`: every rank's tokens are gathered (a collective over `group`, default the default group) and
rank 0 writes one trace in occult's format, atomically, which `occult place --trace path --devices N`
reads. The routing is the model's as it runs: with a placement or `max_devices` already installed, the
trace shows the limited routing.

    with RoutingTrace(model) as trace:
        for batch in batches:
            model(*batch)
    trace.save("megatron_trace.safetensors")
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_layer import MoELayer

from occult.placement.trace import Trace, TraceRecorder, write_trace


class RoutingTrace:
    """Every MoE layer's top-k expert ids of a Megatron model's forwards (module docstring)."""

    def __init__(self, model: torch.nn.Module, metadata: dict[str, Any] | None = None) -> None:
        layers = [m for m in model.modules() if isinstance(m, MoELayer)]
        if not layers:
            raise ValueError(
                f"{type(model).__qualname__} has no Megatron MoELayer to trace: build it with num_moe_experts set"
            )
        config = layers[0].config
        self.num_experts, self.top_k = config.num_moe_experts, config.moe_router_topk
        self.num_layers = len(layers)
        info = {"source": "megatron", "moe_layers": self.num_layers, **(metadata or {})}
        self.recorder = TraceRecorder(self.num_experts, self.top_k, info)
        self.recorded: set[int] = set()  # the MoE layers with at least one batch
        self.hooks = [layer.router.register_forward_hook(self.hook(i)) for i, layer in enumerate(layers)]

    def hook(self, layer: int) -> Any:
        """The forward hook of MoE layer `layer`'s router: its output is (probs [T, E], routing_map [T, E])."""

        def record(module: Any, args: Any, output: Any) -> None:
            routing_map = output[1].detach()
            full_T = routing_map.sum(dim=1) == self.top_k  # a token with top_k experts (not padding)
            ids_TK = torch.topk(routing_map[full_T].to(torch.int8), self.top_k, dim=1).indices
            self.recorder.add(layer, ids_TK.sort(dim=1).values.cpu())
            self.recorded.add(layer)

        return record

    def close(self) -> None:
        """Remove the hooks (what was recorded stays)."""
        for h in self.hooks:
            h.remove()
        self.hooks = []

    def __enter__(self) -> RoutingTrace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def gathered(self, group: Any = None) -> Trace:
        """Every rank's recorded tokens, rank by rank, in one `Trace`: a collective over `group` when
        torch.distributed is initialised (call it on every rank); a MoE layer no rank recorded raises on all."""
        mine = self.recorder.to_trace().topk_ids if len(self.recorded) == self.num_layers else None
        parts = [mine]
        if dist.is_available() and dist.is_initialized():
            parts = [None] * dist.get_world_size(group)
            dist.all_gather_object(parts, mine, group=group)
        idle = [rank for rank, p in enumerate(parts) if p is None]
        if idle:
            raise ValueError(
                f"rank(s) {idle} recorded no forward of some MoE layer ({self.num_layers} MoE layers): run the "
                "model on every rank before saving the trace"
            )
        ids = [np.concatenate([p[i] for p in parts]) for i in range(self.num_layers)]
        return Trace(ids, self.num_experts, self.top_k, None, dict(self.recorder.metadata))

    def save(self, path: str | os.PathLike, group: Any = None) -> Trace:
        """Gather every rank's tokens and write the trace at `path` on rank 0 (atomically); -> the trace."""
        trace = self.gathered(group)
        if not (dist.is_available() and dist.is_initialized()) or dist.get_rank(group) == 0:
            write_trace(path, trace)
        return trace
