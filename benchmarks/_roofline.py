"""Hardware arithmetic for the whole-model benchmarks (e2e.py, serve.py): the two ceilings measured in
the same run (`measure_peaks`: a large bf16 matmul, a large device-to-device copy) and what a model
must do (`ModelCost`: matmul FLOPs of a forward or a training step, bytes a decode step must read).

MFU = FLOPs / step time / measured matmul peak (prefill, training); the decode step's share of
the measured copy bandwidth = (weight + KV bytes it must read) / step time / copy bandwidth.
Counting rules (the same for every variant, so ratios compare like with like):

- FLOPs: 2 x (multiply-adds) of every matmul weight a token passes through: attention projections,
  routers, dense MLPs, shared experts, top-k of the routed experts (no embedding gather), the LM
  head at the positions whose logits are computed, and the attention scores and values over the
  keys each query sees (causal: S (S + 1) / 2 pairs per sequence). A training step is 3 x the
  forward with logits at every position (the optimizer is not counted).
- Decode bytes: every non-expert weight once (embedding rows and norms not counted), each MoE
  layer's experts that the B tokens select (expected distinct experts under uniform routing,
  E (1 - (1 - k/E)^B): k at B = 1, nearly all E at B = 64 with E = 64, k = 8), the LM head, and the
  K/V of the positions attended (B x context), all in the model's dtype. A static cache may read
  more (its whole length): that is overhead, not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from _timing import Stopwatch, slowest, synchronize  # benchmarks/_timing.py


# ------------------------------------------------------------------ ceilings
def _median_ms(fn: Any, device: torch.device, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    synchronize(device)
    watch = Stopwatch(device)
    for _ in range(reps):
        watch.mark()
        fn()
        watch.mark()
    times = sorted(watch.ms(2 * i, 2 * i + 1) for i in range(reps))
    return times[len(times) // 2]


def measure_peaks(
    device: torch.device, dtype: torch.dtype, matmul_n: int | None = None, copy_bytes: int | None = None
) -> dict[str, Any]:
    """The matmul rate (an n x n x n product in `dtype`, random operands) and the copy bandwidth
    (bytes read + written by a device-to-device copy), the slowest rank's (a collective)."""
    cuda = device.type == "cuda"
    n = matmul_n or (8192 if cuda else 256)
    size = copy_bytes or (2 << 30 if cuda else 32 << 20)
    gen = torch.Generator(device=device).manual_seed(1)
    a_NN = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b_NN = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    c_NN = torch.empty_like(a_NN)
    mm_ms = _median_ms(lambda: torch.mm(a_NN, b_NN, out=c_NN), device, reps=20 if cuda else 3)
    src = torch.randint(-100, 100, (size // 4,), device=device, dtype=torch.int32, generator=gen)
    dst = torch.empty_like(src)
    copy_ms = _median_ms(lambda: dst.copy_(src), device, reps=20 if cuda else 3)
    mm_ms, copy_ms = slowest([mm_ms, copy_ms], device)
    return {
        "matmul_n": n,
        "matmul_dtype": str(dtype).replace("torch.", ""),
        "matmul_ms": mm_ms,
        "matmul_tflops": 2 * n**3 / (mm_ms / 1e3) / 1e12,
        "copy_bytes": size,
        "copy_ms": copy_ms,
        "copy_gb_s": 2 * size / (copy_ms / 1e3) / 1e9,
    }


# ------------------------------------------------------------------ the model's work
@dataclass(frozen=True)
class ModelCost:
    """What a model computes and reads, from its modules (any supported family, converted or not)."""

    dense_params: int  # matmul weights every token passes through (all layers; no embedding, no head)
    moe_layers: tuple[tuple[int, int, int], ...]  # per MoE layer: (parameters of all its routed experts, E, top-k)
    head_params: int
    score_flops_per_pair: int  # QK^T and PV FLOPs per (query, key) pair, summed over layers
    kv_elems_per_token: int  # cached K/V elements per token, summed over layers
    bytes_per_elem: int

    @classmethod
    def of(cls, model: nn.Module) -> ModelCost:
        from occult.integrations import hf

        cfg = model.config
        blocks = [b for _, b in hf.moe_blocks(model)]
        expert_ids = {id(p) for b in blocks for p in b.experts.parameters() if p.ndim == 3}
        layers = model.model.layers
        dense = sum(p.numel() for p in layers.parameters() if p.ndim >= 2 and id(p) not in expert_ids)
        k = int(cfg.num_experts_per_tok)
        moe = []
        for b in blocks:
            experts = [p for p in b.experts.parameters() if p.ndim == 3]
            moe.append((sum(p.numel() for p in experts), int(experts[0].shape[0]), k))
        heads = int(cfg.num_attention_heads)
        if getattr(cfg, "kv_lora_rank", None):  # MLA (DeepSeek): transformers caches per-head K and V
            qk, v = int(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim), int(cfg.v_head_dim)
            kv = heads * (qk + v)
        else:
            qk = v = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
            kv = 2 * int(cfg.num_key_value_heads) * qk
        L = len(layers)
        head = model.get_output_embeddings().weight
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        return cls(
            dense,
            tuple(moe),
            head.numel(),
            L * 2 * heads * (qk + v),
            L * kv,
            torch.empty((), dtype=dtype).element_size(),
        )

    @property
    def active_params_per_token(self) -> int:
        return self.dense_params + sum(n * k // E for n, E, k in self.moe_layers)

    def forward_flops(self, batch: int, seq: int, head_positions: int) -> float:
        """A forward of `batch` sequences of `seq` tokens (causal), logits at `head_positions` positions in all."""
        pairs = batch * seq * (seq + 1) / 2
        return (
            2 * self.active_params_per_token * batch * seq
            + self.score_flops_per_pair * pairs
            + 2 * self.head_params * head_positions
        )

    def train_flops(self, batch: int, seq: int) -> float:
        """Forward + backward (2x the forward), logits at every position."""
        return 3 * self.forward_flops(batch, seq, batch * seq)

    def decode_bytes(self, batch: int, context: float, world: int = 1) -> dict[str, float]:
        """Bytes one decode step of `batch` rows (per GPU) must read on each GPU, each row attending `context`
        positions; `world` > 1: the experts are split over that many GPUs, each with its own `batch` rows."""
        experts = sum(n * (1 - (1 - k / E) ** (batch * world)) for n, E, k in self.moe_layers) / world
        weights = (self.dense_params + self.head_params + experts) * self.bytes_per_elem
        kv = batch * context * self.kv_elems_per_token * self.bytes_per_elem
        return {"weights": weights, "kv": kv, "total": weights + kv}

    def describe(self) -> dict[str, Any]:
        return {
            "dense_params": self.dense_params,
            "moe_layers": len(self.moe_layers),
            "expert_params": sum(n for n, _, _ in self.moe_layers),
            "head_params": self.head_params,
            "active_params_per_token": self.active_params_per_token,
            "bytes_per_elem": self.bytes_per_elem,
        }


def rate(flops: float, ms: float, peaks: dict[str, Any]) -> dict[str, float]:
    """Achieved TFLOP/s and MFU (of the measured matmul peak) of `flops` in `ms`."""
    tflops = flops / (ms / 1e3) / 1e12
    return {"flops": flops, "tflops_per_s": tflops, "mfu": tflops / peaks["matmul_tflops"]}


def bandwidth(nbytes: float, ms: float, peaks: dict[str, Any]) -> dict[str, float]:
    """Achieved GB/s and its share of the measured copy bandwidth for `nbytes` read in `ms`."""
    gbs = nbytes / (ms / 1e3) / 1e9
    return {"bytes": nbytes, "gb_s": gbs, "hbm_fraction": gbs / peaks["copy_gb_s"]}
