"""The converted block: `OccultMoeBlock` (the model's gate, `OccultMoE` experts, shared experts),
finding a model's MoE blocks (`moe_blocks`), and the gradient sync of a converted model
(`sync_gradients`: replicated parameters all-reduced, expert-parallel ones already complete).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from occult.integrations.hf.families import Family, UnsupportedModelError, group_size, model_family
from occult.moe.layer import OccultMoE
from occult.training.grads import all_reduce_grads


def moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, block) of every MoE block in forward order, converted or not.

    The position in this list is the block's MoE layer index (traces and placements count MoE
    layers only: DeepSeek-V3's first dense layers and Qwen's `mlp_only_layers` are skipped).
    """
    family = model_family(model)
    found = [
        (name, m)
        for name, m in model.named_modules()
        if type(m).__name__ == family.block_class or isinstance(m, OccultMoeBlock)
    ]
    if not found:
        raise UnsupportedModelError(f"no {family.block_class} blocks found in this {family.model_type} model")
    return found


class OccultMoeBlock(nn.Module):
    """Drop-in for a transformers MoE block: the model's gate, `OccultMoE` experts, shared experts.

    forward(hidden_states [B, S, H]) -> [B, S, H], like every supported block in transformers
    5.x. Routed experts go through `experts` (an `OccultMoE`, a collective over its group);
    `shared_expert` (times `sigmoid(shared_expert_gate(x))`, Qwen2-MoE) and `shared_experts`
    (DeepSeek-V3) run locally, launched while the host waits for the routed experts' row counts
    (`OccultMoE.forward(while_waiting=...)`): the GPU computes them instead of idling while the host
    launches the all-to-alls. Mixtral's router jitter is applied in training as the model does.
    """

    def __init__(self, block: nn.Module, experts: OccultMoE, family: Family) -> None:
        super().__init__()
        self.gate = block.gate
        self.experts = experts
        for name in ("shared_expert", "shared_expert_gate", "shared_experts"):
            setattr(self, name, getattr(block, name, None) if name in family.shared else None)
        self.jitter_noise = float(getattr(block, "jitter_noise", 0.0) or 0.0)
        self.hf_block_class = type(block)
        # called with (router_logits_TE, ids_TK) of every forward where set (the aux loss's RouterTaps)
        self.routing_tap: Callable[[torch.Tensor, torch.Tensor], None] | None = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        if self.training and self.jitter_noise > 0:
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
                1.0 - self.jitter_noise, 1.0 + self.jitter_noise
            )
        x_TH = hidden_states.reshape(-1, shape[-1])
        if self.routing_tap is not None:
            self.routing_tap(*self.routing_of(x_TH))
        if self.shared_expert is None and self.shared_experts is None:
            return self.experts(x_TH).reshape(shape)
        shared: list[torch.Tensor] = []

        def shared_experts() -> None:  # queued while the host waits for the routed experts' row counts
            if self.shared_expert is not None:
                shared.append(F.sigmoid(self.shared_expert_gate(x_TH)) * self.shared_expert(x_TH))
            else:
                shared.append(self.shared_experts(x_TH))

        y_TH = self.experts(x_TH, while_waiting=shared_experts)
        return (y_TH + shared[0]).reshape(shape)

    def routing_of(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(router_logits_TE, ids_TK) the experts' router makes of `x_TH`, made beside the experts: the experts' call
        may be a replay of its CUDA graphs (`occult.moe.graphs`), which runs no Python a hook could read them in."""
        gate_out = self.gate(x_TH)
        return gate_out[0], self.experts.router.routed(gate_out)[1]

    def to_hf(self, config: Any, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> nn.Module:
        """The model's own block class holding this block's gate, shared experts and the given full experts."""
        with torch.device("meta"):
            block = self.hf_block_class(config)
        block.gate = self.gate
        for name in ("shared_expert", "shared_expert_gate", "shared_experts"):
            if getattr(self, name) is not None:
                setattr(block, name, getattr(self, name))
        block.experts.gate_up_proj = nn.Parameter(gate_up_proj, requires_grad=self.experts.gate_up_proj.requires_grad)
        block.experts.down_proj = nn.Parameter(down_proj, requires_grad=self.experts.down_proj.requires_grad)
        left = [n for n, t in [*block.named_parameters(), *block.named_buffers()] if t.is_meta]
        if left:
            raise RuntimeError(f"rebuilding {self.hf_block_class.__name__} left tensors uninitialised: {left}")
        return block


def is_converted(model: nn.Module) -> bool:
    """Whether `model` already holds `OccultMoeBlock`s (converted)."""
    return any(isinstance(m, OccultMoeBlock) for m in model.modules())


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The expert-parallel parameters (each rank holds different experts)."""
    return [
        p
        for b in model.modules()
        if isinstance(b, OccultMoeBlock)
        for p in (b.experts.gate_up_proj, b.experts.down_proj)
    ]


def replicated_parameters(model: nn.Module, complete: Iterable[nn.Parameter] = ()) -> list[nn.Parameter]:
    """The trained parameters every rank holds whole and whose gradients hold only this rank's tokens: all but the
    experts and `complete` (replicated parameters whose backward already summed every rank's tokens), in the
    model's order, the same on every rank (what a gradient sync all-reduces)."""
    skip = {id(p) for p in (*expert_parameters(model), *complete)}
    return [p for p in model.parameters() if p.requires_grad and id(p) not in skip]


@torch.no_grad()
def sync_gradients(
    model: nn.Module, group: Any = None, average: bool = True, complete: Iterable[nn.Parameter] = ()
) -> None:
    """Make every rank's gradients those of the loss summed (or averaged) over all ranks' tokens.

    Replicated parameters (embeddings, attention, norms, gates, shared experts, head) hold only
    this rank's contribution: they are all-reduced (summed). Expert gradients already hold
    every rank's tokens (the all-to-all carried them). With `average=True` both are divided by
    the group size: with each rank's loss a mean over its own tokens (equal counts per rank),
    the result is the gradient of the mean over all ranks' tokens, as in data parallelism. Dividing
    is a pass over every gradient (GBs of expert gradients at OLMoE's shape): scale each rank's loss
    by 1/size before its backward and pass `average=False` for the same gradients without it (the
    same bits where the size is a power of two). `complete`: replicated parameters whose backward
    already summed every rank's tokens into their gradients (as the experts'): left out of the
    all-reduce, divided with the experts.
    """
    size, _ = group_size(group)
    if size == 1:
        return
    if group is None:
        group = dist.group.WORLD
    complete = list(complete)
    all_reduce_grads(replicated_parameters(model, complete), group, size if average else 1, reduce=True)
    if average:  # (the all-reduce summed missing gradients as zeros)
        for p in (*expert_parameters(model), *complete):
            if p.grad is not None:
                p.grad /= size
