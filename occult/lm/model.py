"""A small decoder-only MoE language model built on `OccultMoE`.

    pre-norm blocks:  x = x + Attention(RMSNorm(x))      (rotary, causal, SDPA)
                      x = x + OccultMoE(RMSNorm(x))      (softmax top-k router, SwiGLU experts)
    RMSNorm, then an LM head tied to the embedding.

`ModelConfig` (`occult.lm.model_config`) holds the shape; `OccultLM(config)` builds it (single process by default; pass
`placement`/`group` to shard experts over an expert-parallel group, each rank then holding
only its experts). Routing can be limited to N devices per token at any time with
`set_routing(max_devices=N, placement=P, method=..., similarity=...)`; `P` may have any device
count, e.g. 4 *virtual* devices on one GPU (the layers' own dispatch is unaffected).

`forward(input_ids, targets)` returns `LMOutput(logits, loss, aux_loss)`: `loss` is the mean
next-token cross entropy, `aux_loss` the mean over MoE layers of the load-balancing loss
`E * sum_e f_e * P_e` (f_e: share of the token-expert assignments that went to e, P_e: mean
router probability of e; 1.0 when perfectly balanced). `observe_routing(fn)` calls
`fn(layer, logits_TE, weights_TK, ids_TK)` after every MoE layer's routing (profiling, E[C_T]).
Saving and loading weights: `occult.lm.checkpoint`.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from occult.lm.model_config import LMOutput, ModelConfig
from occult.moe.config import ExecConfig, MoEConfig, RoutingConfig
from occult.moe.layer import OccultMoE
from occult.moe.pruning import METHODS, PruningError, limit_routers
from occult.placement import Placement
from occult.training.loss import cross_entropy


# ------------------------------------------------------------------ blocks
class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


class Rotary(nn.Module):
    """Rotary position embedding (half-split layout), cos/sin tables in fp32."""

    def __init__(self, head_size: int, max_seq_len: int, theta: float) -> None:
        super().__init__()
        inv = 1.0 / theta ** (torch.arange(0, head_size, 2, dtype=torch.float32) / head_size)
        freqs = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, heads, S, head_size]
        S = x.shape[-2]
        cos, sin = self.cos[:S].to(x.device), self.sin[:S].to(x.device)
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_size = cfg.hidden_size // cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=False)
        self.out = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.rotary = Rotary(self.head_size, cfg.max_seq_len, cfg.rope_theta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, H = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.num_heads, self.head_size).permute(2, 0, 3, 1, 4)
        q, k = self.rotary(q).to(v.dtype), self.rotary(k).to(v.dtype)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, S, H))


RoutingObserver = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class ExpertLayout:
    """Where a model's experts live and how they exchange (`OccultLM`'s keywords, handed to every block):
    `placement` (None: contiguous), the process `group` they span, the `dispatcher`, and `init_weights`
    (False: left uninitialised, every weight copied in next)."""

    placement: Placement | None = None
    group: Any = None
    dispatcher: str = "dedup"
    init_weights: bool = True


class MoEBlock(nn.Module):
    """`OccultMoE` plus what the model needs around it: the auxiliary loss and routing observers."""

    def __init__(self, cfg: ModelConfig, layer_index: int, layout: ExpertLayout) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.moe = OccultMoE(
            MoEConfig(cfg.hidden_size, cfg.expert_ffn_size, cfg.num_experts, cfg.top_k),
            routing=RoutingConfig(norm_topk_prob=cfg.norm_topk_prob),
            execution=ExecConfig(
                dispatcher=layout.dispatcher, expert_backend=cfg.expert_backend, transport=cfg.transport
            ),
            placement=layout.placement,
            layer_index=layer_index if layout.placement is not None else 0,
            group=layout.group,
            init_weights=layout.init_weights,
        )
        self.observers: list[RoutingObserver] = []
        self.want_aux = True
        self.aux_group: Any = None  # set: the training aux loss is over every rank's tokens

    @property
    def router(self) -> nn.Module:
        return self.moe.router

    def routing_of(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's routing of `x` made again beside it: (gate logits_TE, weights_TK, ids_TK), the same
        tensors the layer's router makes. The aux loss and the observers need them, and the layer's call may
        be a replay of its CUDA graphs (`--layer-graphs`), which runs no Python a hook could read them in.
        (One more gate product a call: T x H x E, small beside the experts.)"""
        logits_TE = self.moe.router.gate(x.reshape(-1, x.shape[-1]))
        weights_TK, ids_TK = self.moe.router.route_logits(logits_TE)
        return logits_TE, weights_TK, ids_TK

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.moe(x)
        aux = y.new_zeros((), dtype=torch.float32)
        if not (self.observers or self.want_aux):
            return y, aux
        logits, weights_TK, ids_TK = self.routing_of(x)
        for fn in self.observers:
            fn(self.layer_index, logits.detach(), weights_TK.detach(), ids_TK.detach())
        if self.want_aux and self.aux_group is not None and self.training:
            aux = global_aux_loss(logits, ids_TK, self.aux_group)
        elif self.want_aux and ids_TK.numel():
            E = logits.shape[-1]
            probs_TE = torch.softmax(logits.float(), dim=-1)
            flat = ids_TK.reshape(-1)
            share_E = (
                torch.zeros(E, dtype=torch.float32, device=flat.device).scatter_add_(
                    0, flat, torch.ones_like(flat, dtype=torch.float32)
                )
                / flat.numel()
            )  # no host sync
            aux = E * (share_E * probs_TE.mean(0)).sum()
        return y, aux


def global_aux_loss(logits_TE: torch.Tensor, ids_TK: torch.Tensor, group: Any) -> torch.Tensor:
    """The load-balancing loss of the tokens of every rank of `group` (one all-reduce of 2E+1 sums).

    Its value is the global loss on every rank; its gradient is `group size` times this rank's
    share, so gradients averaged over the ranks are those of the global loss.
    """
    import torch.distributed as dist

    E = logits_TE.shape[-1]
    psum_E = torch.softmax(logits_TE.float(), dim=-1).sum(0)
    flat = ids_TK.reshape(-1)
    count_E = torch.zeros(E, dtype=torch.float32, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.float32)
    )
    tokens = torch.full((1,), float(logits_TE.shape[0]), device=psum_E.device)
    sums = torch.cat([count_E, psum_E.detach(), tokens])
    dist.all_reduce(sums, group=group)
    share_E = sums[:E] / sums[:E].sum().clamp_min(1.0)
    total = sums[-1].clamp_min(1.0)
    value = E * (share_E * sums[E : 2 * E]).sum() / total
    mine = E * (share_E * psum_E).sum() / total * dist.get_world_size(group)
    return mine + (value - mine).detach()


class DecoderBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int, layout: ExpertLayout) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.attn = Attention(cfg)
        self.moe_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.moe = MoEBlock(cfg, layer_index, layout)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.attn_norm(x))
        y, aux = self.moe(self.moe_norm(x))
        return x + y, aux


# ------------------------------------------------------------------- model
@dataclass
class RoutingSpec:
    """The routing rule in force: plain top-k (`max_devices=None`) or limited to N devices."""

    max_devices: int | None = None
    method: str = "score"
    placement: Placement | None = None
    similarity: list[torch.Tensor] | None = field(default=None, repr=False)

    def to_json(self) -> str:
        return json.dumps(
            {
                "max_devices": self.max_devices,
                "method": self.method,
                "placement": None if self.placement is None else self.placement.to_json_dict(),
                "similarity": self.similarity is not None,
            }
        )

    def describe(self) -> str:
        if self.max_devices is None:
            return "standard top-k"
        return f"limited to {self.max_devices} of {self.placement.num_devices} devices ({self.method})"


class OccultLM(nn.Module):
    """Decoder-only MoE language model; see the module docstring."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        placement: Placement | None = None,
        group: Any = None,
        dispatcher: str = "dedup",
        init_weights: bool = True,
    ) -> None:
        """`init_weights=False`: the expert weights left uninitialised and `reset_parameters` not run, for a model
        whose weights are all copied in next (a shard of a full model, a checkpoint): at OLMoE's sizes the random
        init on one CPU thread takes tens of seconds."""
        super().__init__()
        self.config = config
        cfg = config
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layout = ExpertLayout(placement, group, dispatcher, init_weights)
        self.blocks = nn.ModuleList(DecoderBlock(cfg, i, layout) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.routing = RoutingSpec()
        if init_weights:
            self.reset_parameters()

    # ------------------------------------------------------------- set-up
    def reset_parameters(self) -> None:
        std = self.config.init_std
        out_std = std / math.sqrt(2 * self.config.num_layers)
        with torch.no_grad():
            nn.init.normal_(self.embed.weight, std=std)
            if not self.config.tie_embeddings:
                nn.init.normal_(self.lm_head.weight, std=std)
            for block in self.blocks:
                nn.init.normal_(block.attn.qkv.weight, std=std)
                nn.init.normal_(block.attn.out.weight, std=out_std)
                moe = block.moe.moe
                nn.init.normal_(moe.router.gate.weight, std=std)
                nn.init.normal_(moe.gate_up_proj, std=std)
                nn.init.normal_(moe.down_proj, std=out_std)

    def moe_layers(self) -> list[OccultMoE]:
        return [b.moe.moe for b in self.blocks]

    def routers(self) -> list[nn.Module]:
        return [b.moe.router for b in self.blocks]

    def expert_parameters(self) -> dict[str, tuple[nn.Parameter, torch.Tensor]]:
        """Expert weights by parameter name: (parameter [E_local, ...], global expert id of each slot)."""
        out = {}
        for i, m in enumerate(self.moe_layers()):
            for attr in ("gate_up_proj", "down_proj"):
                out[f"blocks.{i}.moe.moe.{attr}"] = (getattr(m, attr), m.local_expert_ids)
        return out

    def moe_parameter_names(self) -> list[str]:
        """Parameters of the MoE blocks (router and experts): what MoE-only fine-tuning updates."""
        return [n for n, _ in self.named_parameters() if ".moe.moe." in n]

    def num_parameters(self, active: bool = False) -> int:
        """All parameters, or those one token uses (top_k of num_experts experts per layer)."""
        total = sum(p.numel() for p in self.parameters())
        if not active:
            return total
        experts = sum(m.gate_up_proj.numel() + m.down_proj.numel() for m in self.moe_layers())
        return total - experts + experts * self.config.top_k // self.config.num_experts

    def set_routing(
        self,
        max_devices: int | None = None,
        placement: Placement | None = None,
        method: str = "score",
        similarity: Sequence[torch.Tensor] | None = None,
    ) -> None:
        """Limit every token to `max_devices` devices of `placement` (None: plain top-k).

        `placement` may have any device count (virtual devices on one process). Without one,
        the layers' own (world-size) placement is used. `similarity` (one [E, E] table per MoE
        layer, `occult.moe.pruning.load_similarity`) is needed for `method="similarity"`.
        """
        if method not in METHODS:
            raise PruningError(f"prune method must be one of {METHODS}, got {method!r}")
        if placement is None and max_devices is not None:
            placement = Placement(
                torch.stack([m.expert_device_E.cpu() for m in self.moe_layers()]).numpy(),
                self.moe_layers()[0].num_ranks,
            )
        if placement is not None:
            placement.check_fits(self.config.num_experts, placement.num_devices)
            if placement.num_layers not in (1, self.config.num_layers):
                raise PruningError(
                    f"the placement has {placement.num_layers} layers, "
                    f"but the model has {self.config.num_layers} MoE layers"
                )
        sims = None if similarity is None else [torch.as_tensor(s, dtype=torch.float32) for s in similarity]
        limit_routers(self.routers(), placement, max_devices, method, sims)
        self.routing = RoutingSpec(max_devices, method, placement, sims if max_devices is not None else None)
        if max_devices is None:
            self.routing.placement = placement

    @contextlib.contextmanager
    def observe_routing(self, fn: RoutingObserver) -> Iterator[None]:
        """Call `fn(layer, logits_TE, weights_TK, ids_TK)` after each MoE layer's routing."""
        for b in self.blocks:
            b.moe.observers.append(fn)
        try:
            yield
        finally:
            for b in self.blocks:
                b.moe.observers.remove(fn)

    # ------------------------------------------------------------ forward
    def forward(
        self, input_ids: torch.Tensor, targets: torch.Tensor | None = None, return_logits: bool = True
    ) -> LMOutput:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must have shape [batch, seq], got {list(input_ids.shape)}")
        if input_ids.shape[1] > self.config.max_seq_len:
            raise ValueError(f"sequence length {input_ids.shape[1]} exceeds max_seq_len={self.config.max_seq_len}")
        x = self.embed(input_ids)
        aux_total = x.new_zeros((), dtype=torch.float32)
        for block in self.blocks:
            x, aux = block(x)
            aux_total = aux_total + aux
        logits = self.lm_head(self.norm(x))
        loss = None
        if targets is not None:
            loss = cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return LMOutput(logits if return_logits else None, loss, aux_total / len(self.blocks))

    def set_aux_loss(self, enabled: bool) -> None:
        for b in self.blocks:
            b.moe.want_aux = enabled

    def set_aux_group(self, group: Any) -> None:
        """Compute the training load-balancing loss over the tokens of every rank of `group`."""
        for b in self.blocks:
            b.moe.aux_group = group


__all__ = ["ModelConfig", "OccultLM", "LMOutput", "RoutingSpec"]
