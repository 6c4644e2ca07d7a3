"""The shape of an `OccultLM` (`ModelConfig`: sizes, rotary, norms, the expert backend and the
all-to-alls' transport) and what its forward returns (`LMOutput`). Plain data: nothing here builds a model."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from occult.moe.config import TRANSPORTS


@dataclass
class ModelConfig:
    """Shape of an `OccultLM`. `expert_ffn_size` is each expert's SwiGLU width."""

    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_experts: int = 32
    top_k: int = 4
    expert_ffn_size: int = 256
    norm_topk_prob: bool = False
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    tie_embeddings: bool = True
    init_std: float = 0.02
    expert_backend: str = (
        "auto"  # the expert MLP's kernels (ExecConfig.expert_backend): Triton on a CUDA GPU, else torch
    )
    transport: str = "auto"  # the all-to-alls' transport (ExecConfig.transport): execution only, results equal

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_experts",
            "top_k",
            "expert_ffn_size",
            "max_seq_len",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {v!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError(f"head size {self.hidden_size // self.num_heads} must be even for rotary embeddings")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.expert_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"expert_backend must be 'auto', 'torch' or 'triton', got {self.expert_backend!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig field(s) {unknown}; known: {sorted(known)}")
        return cls(**dict(d))


class LMOutput(NamedTuple):
    logits: torch.Tensor | None
    loss: torch.Tensor | None
    aux_loss: torch.Tensor


__all__ = ["LMOutput", "ModelConfig"]
