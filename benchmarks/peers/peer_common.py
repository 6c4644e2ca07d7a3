"""What every peer adapter shares: the case (shape, weights, routing, inputs), the reference check.

One `Case` per rank: the same full expert weights on every rank (generated from one seed on the
device), this rank's tokens and their preset top-k expert ids (uniform random, the same ids
`occult bench --routing random` uses), a few input sets to rotate between timed calls, and the
gradients fed to backward. A peer adapter builds its layer from the case, copies the weights
in, forces the preset routing, and exposes `forward(i)` / `forward_backward(i)` on input set i.

Gate weights: the softmax over all experts of the real router's logits, taken at the preset ids
(as `occult.tools.bench.PresetRouter` does), so the router gets gradients in every implementation.
A peer that always renormalises the top-k weights (DeepSpeed-MoE's top-k gate) is checked
against the renormalised reference instead (`Peer.renormalized`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from occult.tools.bench import SHAPES, Shape


@dataclass
class Case:
    shape: Shape
    rank: int
    world: int
    device: torch.device
    dtype: torch.dtype
    w1_full: torch.Tensor  # [E, 2F, H]: gate rows first, then up rows (SwiGLU: silu(gate) * up)
    w2_full: torch.Tensor  # [E, H, F]
    gate_w: torch.Tensor  # [E, H]
    xs: list[torch.Tensor]  # input sets, [T, H] each
    gs: list[torch.Tensor]  # output gradients, [T, H] each
    ids: list[torch.Tensor]  # preset top-k ids per input set, [T, K] int64
    check_tokens: int = 256
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return self.xs[0].shape[0]

    @property
    def local_experts(self) -> int:
        return self.shape.experts // self.world

    def local_slice(self) -> slice:
        """The experts this rank holds in every peer: a contiguous block (all peers shard that way)."""
        n = self.local_experts
        return slice(self.rank * n, (self.rank + 1) * n)


def make_case(
    shape_name: str,
    rank: int,
    world: int,
    device: torch.device,
    dtype: torch.dtype,
    tokens: int,
    input_sets: int,
    seed: int = 1234,
) -> Case:
    """The same weights and routing on every rank; each rank's own slice of tokens."""
    from occult.placement import synthetic

    shape = SHAPES[shape_name]
    gen = torch.Generator(device=device).manual_seed(seed)
    E, H, F = shape.experts, shape.hidden, shape.ffn
    w1 = (torch.randn(E, 2 * F, H, generator=gen, device=device, dtype=torch.float32) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, F, generator=gen, device=device, dtype=torch.float32) / F**0.5).to(dtype)
    gw = (torch.randn(E, H, generator=gen, device=device, dtype=torch.float32) / H**0.5).to(dtype)
    trace = synthetic.uniform_trace(world * input_sets * tokens, E, shape.top_k, seed=7)
    ids_all = torch.as_tensor(np.asarray(trace.topk_ids[0], dtype=np.int64)).view(
        world, input_sets, tokens, shape.top_k
    )
    xgen = torch.Generator(device=device).manual_seed(seed + 1 + rank)
    xs = [
        torch.randn(tokens, H, generator=xgen, device=device, dtype=torch.float32).to(dtype) for _ in range(input_sets)
    ]
    gs = [
        torch.randn(tokens, H, generator=xgen, device=device, dtype=torch.float32).to(dtype) for _ in range(input_sets)
    ]
    ids = [ids_all[rank, i].to(device) for i in range(input_sets)]
    return Case(shape, rank, world, device, dtype, w1, w2, gw, xs, gs, ids)


def gate_weights(
    x_TH: torch.Tensor, gate_w: torch.Tensor, ids_TK: torch.Tensor, renormalize: bool = False
) -> torch.Tensor:
    """float32 softmax over all experts of x @ gate_w^T, at the preset ids (optionally renormalised)."""
    probs = torch.softmax(x_TH.float() @ gate_w.float().t(), dim=-1).gather(1, ids_TK)
    return probs / probs.sum(-1, keepdim=True) if renormalize else probs


def reference(case: Case, renormalize: bool = False) -> torch.Tensor:
    """float32 output of the first `check_tokens` tokens of input set 0, expert by expert."""
    from occult.tools.bench import dense_reference as _dense_reference

    n = min(case.check_tokens, case.tokens)
    x, ids = case.xs[0][:n], case.ids[0][:n]
    w = gate_weights(x, case.gate_w, ids, renormalize)
    return _dense_reference(x, ids, w, case.w1_full, case.w2_full)


def rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    y = y.float().reshape(ref.shape)
    return float(((y - ref).norm() / ref.norm().clamp_min(1e-30)).item())


class Peer:
    """One implementation of the layer on this rank. Subclasses set up `self` in `__init__(case)`."""

    name = "peer"
    renormalized = False  # gate weights renormalised over the top-k (checked against that reference)
    routing_forced = True  # the preset ids are used (else the peer's own routing on the same weights)

    def __init__(self, case: Case) -> None:
        self.case = case

    def __call__(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Output [T, H] of input set i (x is xs[i], possibly a leaf requiring grad)."""
        raise NotImplementedError

    def forward(self, i: int) -> torch.Tensor:
        with torch.no_grad():
            return self(i, self.case.xs[i])

    def forward_backward(self, i: int) -> torch.Tensor:
        """One step with backward; returns the input (its .grad holds dL/dx)."""
        x = self.case.xs[i].detach().requires_grad_()
        y = self(i, x)
        y.backward(self.case.gs[i].reshape(y.shape))
        return x

    def info(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass
