"""Routers that put a transformers model's own gate in front of `OccultMoE`.

A transformers 5.x MoE gate maps hidden states to `(router_logits, top_k_weights, top_k_index)`;
an occult router maps `x_TH` to `(weights_TK, ids_TK)`. `HFGateRouter` adapts the one to the
other by *calling the model's gate module*: its scoring (softmax or sigmoid, `norm_topk_prob`,
DeepSeek-V3's score-correction bias, group-limited top-k, routed scaling factor), its dtype
rules and the output-recording hooks transformers hangs on it (`output_router_logits=True`)
all stay the model's own.

Collaboration pruning (`max_devices=N`) needs a different top-k, so there the router re-derives
the choice from the gate's router logits with the same scoring, limited to experts on at most N
devices (`occult.moe.pruning.device_limited_topk`). One subclass per scoring family:

- `SoftmaxGateRouter`: OLMoE, Qwen2-MoE, Qwen3-MoE (softmax, optional `norm_topk_prob`) and
  Mixtral (softmax, always renormalised, fp32 gate weights);
- `SigmoidGroupGateRouter`: DeepSeek-V3 (sigmoid scores; choice on scores plus
  `e_score_correction_bias`, restricted to the `topk_group` best of `n_group` expert groups;
  gate weights are the unbiased scores, renormalised if `norm_topk_prob`, times
  `routed_scaling_factor`). The device limit applies inside the allowed groups.

The gate is *referenced, not owned*: it stays registered where the model keeps it
(`<block>.gate`), so parameter names, `.to()`, and hooks are the model's.
"""

from __future__ import annotations

import torch
import torch.nn as nn

# A finite stand-in for "not allowed" in choice scores: device-limited top-k only orders
# scores, and a finite value keeps any arithmetic it does on them NaN-free.
_MASKED = -1e30


class HFGateRouter(nn.Module):
    """Base adapter: `x_TH -> (weights_TK, ids_TK)` through a transformers gate module."""

    def __init__(
        self,
        gate: nn.Module,
        *,
        max_devices: int | None = None,
        prune_method: str = "score",
        similarity_EE: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        object.__setattr__(self, "_gate", gate)  # not a submodule: the model's block owns it
        self.top_k = int(gate.top_k)
        self.num_experts = int(gate.num_experts)
        if max_devices is not None and max_devices < 1:
            raise ValueError(f"max_devices must be >= 1 or None, got {max_devices}")
        from occult.moe.pruning import METHODS

        if prune_method not in METHODS:
            raise ValueError(f"prune_method must be one of {', '.join(METHODS)}, got {prune_method!r}")
        if max_devices is not None:
            if prune_method == "similarity" and similarity_EE is None:
                raise ValueError("prune_method='similarity' needs similarity_EE (see occult.moe.pruning)")
        self.max_devices = max_devices
        self.prune_method = prune_method
        self.register_buffer("similarity_EE", similarity_EE, persistent=False)
        self.register_buffer("expert_device_E", None, persistent=False)

    @property
    def gate(self) -> nn.Module:
        """The model's gate module (also `OccultMoE.to_dense` reads `router.gate.weight`)."""
        return self._gate

    def set_expert_device(self, expert_device_E: torch.Tensor) -> None:
        """Called by `OccultMoE` with the placement (needed for device-limited routing)."""
        self.expert_device_E = expert_device_E.to(torch.int64)

    def forward(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.routed(self._gate(x_TH))

    def routed(self, gate_out: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights_TK, ids_TK) of the gate's output `(router_logits_TE, weights_TK, ids_TK)`: the forward after
        the gate, for a caller that has the gate's output already (the aux loss's taps)."""
        router_logits_TE, weights_TK, ids_TK = gate_out
        if self.max_devices is None:
            return weights_TK, ids_TK
        if self.expert_device_E is None:
            raise RuntimeError("device-limited routing needs the placement: call set_expert_device first")
        return self.limited_topk(router_logits_TE)

    # ------------------------------------------------------- per scoring family
    def scores(self, router_logits_TE: torch.Tensor) -> torch.Tensor:
        """[T, E] per-expert scores (probabilities) the gate ranks experts by, fp32."""
        raise NotImplementedError

    def limited_topk(self, router_logits_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gate's top-k, limited to experts on at most `max_devices` devices."""
        raise NotImplementedError

    def _device_limited(self, scores_TE: torch.Tensor, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
        from occult.moe.pruning import device_limited_topk

        return device_limited_topk(
            scores_TE,
            self.top_k,
            self.expert_device_E,
            self.max_devices,
            method=self.prune_method,
            similarity_EE=self.similarity_EE,
            norm_topk_prob=norm_topk_prob,
        )

    def extra_repr(self) -> str:
        limit = f", max_devices={self.max_devices} ({self.prune_method})" if self.max_devices else ""
        return f"gate={type(self._gate).__name__}, experts={self.num_experts}, top_k={self.top_k}{limit}"


class SoftmaxGateRouter(HFGateRouter):
    """OLMoE, Qwen2-MoE, Qwen3-MoE, Mixtral: softmax over experts, top-k, optional renormalisation.

    Mixtral's gate has no `norm_topk_prob` and always renormalises, keeping the gate weights in
    fp32; the others cast them to the logits' dtype.
    """

    def __init__(self, gate: nn.Module, **kwargs) -> None:
        super().__init__(gate, **kwargs)
        self.always_normalized = not hasattr(gate, "norm_topk_prob")
        self.norm_topk_prob = bool(getattr(gate, "norm_topk_prob", True))

    def scores(self, router_logits_TE: torch.Tensor) -> torch.Tensor:
        return torch.softmax(router_logits_TE.float(), dim=-1)

    def limited_topk(self, router_logits_TE):
        weights_TK, ids_TK = self._device_limited(self.scores(router_logits_TE), self.norm_topk_prob)
        if not self.always_normalized:
            weights_TK = weights_TK.to(router_logits_TE.dtype)
        return weights_TK, ids_TK


class SigmoidGroupGateRouter(HFGateRouter):
    """DeepSeek-V3: sigmoid scores, bias-corrected group-limited choice, scaled gate weights."""

    def __init__(self, gate: nn.Module, **kwargs) -> None:
        super().__init__(gate, **kwargs)
        self.num_group = int(gate.num_group)
        self.topk_group = int(gate.topk_group)
        self.norm_topk_prob = bool(gate.norm_topk_prob)
        self.routed_scaling_factor = float(gate.routed_scaling_factor)
        if self.num_experts % self.num_group:
            raise ValueError(f"{self.num_experts} experts do not split into n_group={self.num_group} groups")

    def scores(self, router_logits_TE: torch.Tensor) -> torch.Tensor:
        return router_logits_TE.float().sigmoid()

    def choice_scores(self, scores_TE: torch.Tensor) -> torch.Tensor:
        """Scores plus the correction bias, experts outside the `topk_group` best groups masked."""
        choice_TE = scores_TE + self._gate.e_score_correction_bias.float()
        num_tokens = choice_TE.shape[0]
        grouped = choice_TE.view(num_tokens, self.num_group, self.num_experts // self.num_group)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        allowed_TE = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, self.num_experts)
        return choice_TE.masked_fill(~allowed_TE, _MASKED)

    def limited_topk(self, router_logits_TE):
        scores_TE = self.scores(router_logits_TE)
        _, ids_TK = self._device_limited(self.choice_scores(scores_TE), norm_topk_prob=False)
        weights_TK = scores_TE.gather(1, ids_TK)
        if self.norm_topk_prob:
            weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
        return weights_TK * self.routed_scaling_factor, ids_TK
