"""How the GPU suite judges a model's gradients against the eager model's, in fp32 and in half precision.

In fp32 the judgement is exact up to rounding: every parameter within `FP32_TOL` (relative L2).

In half precision a tiny random MoE model breaks near-tied router logits differently under any change of
rounding, and one token sent to another expert moves many gradients by several percent. Session 37 (2 x H200,
tiny DeepSeek-V3, traced layers against eager, 3 seeds x 2 dtypes x 2 ranks): fp16 off by up to 8.4% on one
rank's attention and expert gradients while eager fp16 stood 0.3% from fp32; up to 18% on a router; bf16 eager
itself 5-38% from fp32 (its worst parameter), the traced model up to 40% from eager. A comparison with a single
eager run cannot tell such a flip from a small error, so in half precision it catches what it can: a gradient
lost or not finite, or a parameter off by more than `FLIP` and twice the eager model's own distance from fp32
(a zeroed or sign-flipped gradient is off by 1 or 2, a factor of two by 0.5, a quarter of the experts'
gradients lost by 0.5). The arithmetic itself is checked at real shapes against fp32 references
(test_kernels_real_shapes.py) and the logic in fp32, here and on CPU.
"""

from __future__ import annotations

import torch

FP32_TOL = 1e-3
FLIP = 0.35  # above every flip of session 37 that twice eager's own distance did not cover (at most 0.32, bf16)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """The relative L2 distance of `a` from `b`."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)).item()


def worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest relative L2 distance of a parameter's gradient in `a` from its gradient in `b`."""
    return max(relative(a[n], g) for n, g in b.items())


def gradients_off(
    got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], exact: dict[str, torch.Tensor], dtype: torch.dtype
) -> dict[str, str]:
    """What is wrong with `got` (gradients by name) against `ref` (the eager model in `dtype`), with `exact`
    (the same model in fp32) for half precision's own distance; empty when nothing is."""
    off = {n: "lost" for n in ref if n not in got}
    off.update({n: "not finite" for n, g in got.items() if not torch.isfinite(g).all()})
    if dtype == torch.float32:
        bound = FP32_TOL
    else:
        bound = max(FLIP, 2 * worst(ref, exact))
    for n, g in ref.items():
        if n not in off and (err := relative(got[n], g)) > bound:
            off[n] = f"{err:.4f} > {bound:.4f}"
    return off
