"""The GPU suite's gradient judgement (tests/gpu/gradient_judge.py) on CPU tensors: exact in fp32, and in half
precision it passes what routing flips do and fails the gross errors it is there to catch."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.gradient_judge import FLIP, FP32_TOL, gradients_off


def _grads(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"experts": torch.randn(8, 16, 4, generator=gen), "router": torch.randn(8, 4, generator=gen)}


def _moved(grads: dict[str, torch.Tensor], by: float, seed: int) -> dict[str, torch.Tensor]:
    """Each gradient moved by `by` of its own norm in a fresh random direction."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for n, g in grads.items():
        d = torch.randn(g.shape, generator=gen)
        out[n] = g + by * g.norm() * d / d.norm()
    return out


def test_fp32_is_judged_exactly():
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    ref = _grads(seed)
    assert gradients_off(_moved(ref, FP32_TOL / 2, seed + 1), ref, ref, torch.float32) == {}
    off = gradients_off(_moved(ref, FP32_TOL * 2, seed + 1), ref, ref, torch.float32)
    assert sorted(off) == ["experts", "router"], off


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_passes_flips_and_fails_gross_errors(dtype):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    exact = _grads(seed)
    ref = _moved(exact, 0.003, seed + 1)  # eager half precision: close to fp32
    assert gradients_off(_moved(ref, 0.9 * FLIP, seed + 2), ref, exact, dtype) == {}  # a flip's size
    zeroed = dict(ref, experts=torch.zeros_like(ref["experts"]))
    assert list(gradients_off(zeroed, ref, exact, dtype)) == ["experts"]
    one_expert_left = dict(ref, experts=ref["experts"] * (torch.arange(8) == 0).view(8, 1, 1))
    assert list(gradients_off(one_expert_left, ref, exact, dtype)) == ["experts"]
    doubled = dict(ref, router=2 * ref["router"])
    assert list(gradients_off(doubled, ref, exact, dtype)) == ["router"]
    nan = dict(ref, router=ref["router"].clone().index_fill_(0, torch.tensor([3]), float("nan")))
    assert gradients_off(nan, ref, exact, dtype) == {"router": "not finite"}
    assert gradients_off({"router": ref["router"]}, ref, exact, dtype) == {"experts": "lost"}
    # eager's own distance from fp32 widens the bound: a flip in the reference itself
    far_ref = _moved(exact, 0.3, seed + 3)
    assert gradients_off(_moved(far_ref, 0.5, seed + 4), far_ref, exact, dtype) == {}
    assert gradients_off(_moved(far_ref, 0.7, seed + 4), far_ref, exact, dtype) != {}
