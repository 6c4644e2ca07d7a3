"""Routing: scores, top-k experts and gate weights for every token.

A router is any module whose forward maps `x_TH` to `(weights_TK, ids_TK)`; `OccultMoE` accepts
any such module, so other models' routers (sigmoid scoring, score-correction bias, group-limited
top-k, ...) plug in. `TopKRouter` is the common one: softmax over a linear gate, top-k,
optionally renormalised, optionally limited to `max_devices` devices and/or `max_nodes` nodes
per token (collaboration pruning, see `occult.moe.pruning`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from occult.moe.config import PRUNE_METHODS


def softmax_topk(
    logits_TE: torch.Tensor, top_k: int, norm_topk_prob: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax scores in fp32, top-k ids and gate weights (renormalised to sum 1 if asked)."""
    scores_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32).to(
        torch.promote_types(logits_TE.dtype, torch.float32)
    )
    weights_TK, ids_TK = torch.topk(scores_TE, top_k, dim=-1)
    if norm_topk_prob:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    return weights_TK, ids_TK


class TopKRouter(nn.Module):
    """Linear gate (no bias), softmax scores, top-k; optionally device-limited.

    `max_devices=N` limits every token to experts on at most N devices of `expert_device_E`
    (set by the layer from its placement). `prune_method` is "score" (walk experts by score,
    collect N devices, take the top-k inside them) or "similarity" (replace out-of-set experts by
    their most similar allowed expert, needs `similarity_EE`). Gate weights are always the
    router's probabilities of the finally chosen experts, renormalised only if `norm_topk_prob`.

    `max_nodes=N` (DeepSeek-V3 style) limits every token to experts on at most N nodes, the node of
    device d being `d // devices_per_node` (node-major ids, as `occult place --nodes` writes them);
    it combines with `max_devices` (`occult.moe.pruning.device_limited_topk`).
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool = False,
        max_devices: int | None = None,
        prune_method: str = "score",
        similarity_EE: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        max_nodes: int | None = None,
        devices_per_node: int | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        if max_devices is not None and max_devices < 1:
            raise ValueError(f"max_devices must be >= 1 or None, got {max_devices}")
        if max_nodes is not None and max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1 or None, got {max_nodes}")
        if max_nodes is not None and not (devices_per_node and devices_per_node >= 1):
            raise ValueError("max_nodes needs devices_per_node (GPUs per node; the node of device d is d // it)")
        if prune_method not in PRUNE_METHODS:
            raise ValueError(f"prune_method must be one of {', '.join(PRUNE_METHODS)}, got {prune_method!r}")
        if prune_method == "similarity" and (max_devices, max_nodes) != (None, None) and similarity_EE is None:
            raise ValueError("prune_method='similarity' needs similarity_EE (see occult.moe.pruning.expert_similarity)")
        self.gate = nn.Linear(hidden_size, num_experts, bias=False, dtype=dtype, device=device)
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.max_devices = max_devices
        self.max_nodes = max_nodes
        self.devices_per_node = devices_per_node
        self._node_cache: tuple[torch.Tensor, tuple[int, int], torch.Tensor] | None = None
        self.prune_method = prune_method
        self.register_buffer("similarity_EE", similarity_EE, persistent=False)
        self.register_buffer("expert_device_E", None, persistent=False)

    @classmethod
    def from_config(cls, config: Any, routing: Any, device: torch.device | str | None = None) -> TopKRouter:
        """The router of a `MoEConfig` with the rule of a `RoutingConfig` (`occult.moe.config`)."""
        return cls(
            config.hidden_size,
            config.num_experts,
            config.top_k,
            routing.norm_topk_prob,
            max_devices=routing.max_devices,
            prune_method=routing.prune_method,
            similarity_EE=routing.similarity_EE,
            max_nodes=routing.max_nodes,
            devices_per_node=routing.devices_per_node,
            dtype=config.dtype,
            device=device,
        )

    @property
    def weight(self) -> torch.Tensor:
        return self.gate.weight

    def set_expert_device(self, expert_device_E: torch.Tensor, devices_per_node: int | None = None) -> None:
        """Tell the router where experts live (needed for device- and node-limited routing)."""
        self.expert_device_E = expert_device_E.to(device=self.gate.weight.device, dtype=torch.int64)
        if devices_per_node is not None:
            self.devices_per_node = int(devices_per_node)

    def expert_node(self) -> torch.Tensor:
        """[E] node of every expert, `expert_device_E // devices_per_node` (cached per map)."""
        dev, per = self.expert_device_E, int(self.devices_per_node)
        c = self._node_cache
        if c is None or c[0] is not dev or c[1] != (dev._version, per):
            c = self._node_cache = (dev, (dev._version, per), dev // per)
        return c[2]

    def forward(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.route_logits(self.gate(x_TH))

    def route_logits(self, logits_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights_TK, ids_TK) of the gate's logits: the forward after the gate, for a caller that needs
        the logits as well (a load-balancing loss) without a second gate product."""
        max_nodes = getattr(self, "max_nodes", None)
        if self.max_devices is None and max_nodes is None:
            return softmax_topk(logits_TE, self.top_k, self.norm_topk_prob)
        from occult.moe import pruning

        if self.expert_device_E is None:
            raise RuntimeError("device-limited routing needs the expert placement: call set_expert_device first")
        scores_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32).to(
            torch.promote_types(logits_TE.dtype, torch.float32)
        )
        return pruning.device_limited_topk(
            scores_TE,
            self.top_k,
            self.expert_device_E,
            self.max_devices,
            method=self.prune_method,
            similarity_EE=self.similarity_EE,
            norm_topk_prob=self.norm_topk_prob,
            max_nodes=max_nodes,
            expert_node_E=None if max_nodes is None else self.expert_node(),
        )
