"""`DenseMoE`, the single-process reference every expert-parallel layer must match, and the
fused SwiGLU expert parameters both layers are built with (`expert_parameters`)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from occult.moe.experts import swiglu_expert
from occult.moe.routing import TopKRouter


def expert_parameters(
    num_experts: int, hidden: int, ffn: int, dtype, device, init: bool = True
) -> tuple[nn.Parameter, nn.Parameter]:
    """Fused SwiGLU expert weights `gate_up_proj` [E, 2F, H] and `down_proj` [E, H, F]."""
    gate_up = torch.empty(num_experts, 2 * ffn, hidden, dtype=dtype, device=device)
    down = torch.empty(num_experts, hidden, ffn, dtype=dtype, device=device)
    if init:
        nn.init.normal_(gate_up, std=1.0 / math.sqrt(hidden))
        nn.init.normal_(down, std=1.0 / math.sqrt(ffn))
    return nn.Parameter(gate_up), nn.Parameter(down)


class DenseMoE(nn.Module):
    """All experts in one process: the plain reference `OccultMoE` must match.

    Same parameters as `OccultMoE` with every expert present, in expert-id order:
    `router.gate.weight` [E, H], `gate_up_proj` [E, 2F, H], `down_proj` [E, H, F].
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size, self.ffn_size = hidden_size, ffn_size
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.router = TopKRouter(hidden_size, num_experts, top_k, norm_topk_prob, dtype=dtype, device=device)
        self.gate_up_proj, self.down_proj = expert_parameters(num_experts, hidden_size, ffn_size, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_TH = x.reshape(-1, self.hidden_size)
        weights_TK, ids_TK = self.router(x_TH)
        acc = torch.promote_types(x.dtype, torch.float32)
        y_TH = torch.zeros(x_TH.shape, dtype=acc, device=x.device)
        for e in range(self.num_experts):
            token_N, column_N = (ids_TK == e).nonzero(as_tuple=True)
            if token_N.numel():
                out = swiglu_expert(x_TH[token_N], self.gate_up_proj[e], self.down_proj[e])
                y_TH = y_TH.index_add(0, token_N, out.to(acc) * weights_TK[token_N, column_N, None].to(acc))
        return y_TH.to(x.dtype).reshape(x.shape)
