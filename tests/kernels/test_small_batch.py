"""The small-batch (decode) expert kernels (`occult.kernels.small_batch`) vs the torch reference.

Without a GPU they run under Triton's CPU interpreter (`TRITON_INTERPRET=1`, set by _triton_interpreter.py
before the kernels are imported) on small shapes with small tiles (several n-tiles, chunks of
pairs per expert and k-steps). The GPU-size check and timings are `benchmarks/bench_decode_experts.py`.
"""

from __future__ import annotations

import pytest
import torch

# first: Triton's CPU interpreter without a GPU, or this file in a fresh process (test_in_subprocess)
from _triton_interpreter import DEVICE, IN_PROCESS, needs_in_process, run_file_in_fresh_process

from occult import kernels
from occult.moe.experts import expert_mlp, expert_mlp_reference


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    denom = b.norm().item()
    return (a - b).norm().item() / denom if denom > 0 else (a - b).norm().item()


def _inputs(R, K, E, H, F, dtype, *, slots=None, pad=0.3, gen=None):
    g = gen or torch.Generator().manual_seed(torch.seed() % 2**31)
    if slots is None:
        slots = torch.randint(0, E, (R, K), generator=g)
        slots[torch.rand(R, K, generator=g) < pad] = -1
        if R > 2:
            slots[R // 2] = -1  # a row of padding only
    x = torch.randn(R, H, generator=g)
    gates = torch.rand(R, K, generator=g)
    w1 = torch.randn(E, 2 * F, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, F, generator=g) / F**0.5
    return (
        x.to(DEVICE, dtype),
        slots.to(DEVICE),
        gates.to(DEVICE, torch.float32),
        w1.to(DEVICE, dtype),
        w2.to(DEVICE, dtype),
    )


def _reference(x, slots, gates, w1, w2):
    dt = torch.float64 if DEVICE == "cpu" else torch.float32
    return expert_mlp_reference(x.to(dt), slots, gates.to(dt), w1.to(dt), w2.to(dt))


def _small(*ins, down_by_row):
    from occult.kernels.small_batch import expert_mlp_small_batch

    return expert_mlp_small_batch(*ins, down_by_row=down_by_row)


@needs_in_process
@pytest.mark.parametrize("down_by_row", [False, True])
@pytest.mark.parametrize(
    "R,K,E,H,F",
    [
        (1, 8, 6, 32, 32),  # decode: one row, duplicate slots possible
        (9, 3, 5, 48, 40),  # dims not multiples of the tiles, a row of padding only
        (20, 4, 3, 32, 32),  # > 16 pairs per expert: several chunks of one expert in a program
        (7, 1, 4, 32, 48),  # K = 1
    ],
)
def test_matches_reference_fp32(R, K, E, H, F, down_by_row):
    ins = _inputs(R, K, E, H, F, torch.float32)
    y = _small(*ins, down_by_row=down_by_row)
    assert y.dtype == torch.float32 and y.shape == (R, H)
    assert _rel(y, _reference(*ins)) < 1e-5


@needs_in_process
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("down_by_row", [False, True])
def test_matches_reference_half(dtype, down_by_row):
    ins = _inputs(6, 4, 5, 64, 48, dtype)
    y = _small(*ins, down_by_row=down_by_row)
    assert y.dtype == dtype
    ref = _reference(*ins)
    own = expert_mlp_reference(*ins)  # the torch path in the same dtype
    assert _rel(y, ref) < 3e-2
    assert _rel(y, ref) < 4 * _rel(own, ref) + 1e-3


@needs_in_process
@pytest.mark.parametrize("down_by_row", [False, True])
def test_padding_only_out_of_range_and_zero_rows(down_by_row):
    R, K, E, H, F = 5, 3, 4, 32, 32
    ins = _inputs(R, K, E, H, F, torch.float32, slots=torch.full((R, K), -1, dtype=torch.long))
    y = _small(*ins, down_by_row=down_by_row)
    assert torch.count_nonzero(y) == 0  # written (new_empty underneath), and zero
    # slots >= E are padding, as on the grouped-GEMM path
    slots = torch.randint(0, E, (R, K))
    bad = slots.clone()
    bad[:, 1] = E + 2
    ref_slots = bad.clone()
    ref_slots[:, 1] = -1
    x, _, gates, w1, w2 = _inputs(R, K, E, H, F, torch.float32)
    y = _small(x, bad.to(DEVICE), gates, w1, w2, down_by_row=down_by_row)
    assert _rel(y, _reference(x, ref_slots.to(DEVICE), gates, w1, w2)) < 1e-5
    ins = _inputs(0, K, E, H, F, torch.float32)
    assert _small(*ins, down_by_row=down_by_row).shape == (0, H)


@needs_in_process
def test_strided_weights():
    R, K, E, H, F = 3, 2, 3, 32, 48
    x, slots, gates, _, _ = _inputs(R, K, E, H, F, torch.float32)
    g = torch.Generator().manual_seed(1)
    w1 = (torch.randn(E, H, 2 * F, generator=g) / H**0.5).to(DEVICE).transpose(1, 2)
    w2 = (torch.randn(E, F, H, generator=g) / F**0.5).to(DEVICE).transpose(1, 2)
    for down_by_row in (False, True):
        y = _small(x, slots, gates, w1, w2, down_by_row=down_by_row)
        assert _rel(y, _reference(x, slots, gates, w1, w2)) < 1e-5


@needs_in_process
def test_inference_takes_the_small_batch_path(monkeypatch):
    from occult.kernels import op

    calls = []
    real = op.expert_mlp_small_batch
    monkeypatch.setattr(op, "expert_mlp_small_batch", lambda *a, **k: calls.append(1) or real(*a, **k))
    ins = _inputs(4, 2, 3, 32, 32, torch.float32)
    with torch.no_grad():
        y = expert_mlp(*ins, backend="triton")
    assert calls == [1] and _rel(y, _reference(*ins)) < 1e-5
    from occult.kernels import small_batch

    monkeypatch.setattr(small_batch, "MAX_PAIRS", 7)  # R*K = 8 > 7: the grouped-GEMM path
    with torch.no_grad():
        y = kernels.expert_mlp(*ins)
    assert calls == [1] and _rel(y, _reference(*ins)) < 1e-5
    monkeypatch.undo()
    monkeypatch.setattr(op, "expert_mlp_small_batch", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = ins[0].clone().requires_grad_()  # autograd: the grouped-GEMM op
    kernels.expert_mlp(x, *ins[1:]).sum().backward()
    assert calls == [1] and x.grad is not None


@pytest.mark.skipif(IN_PROCESS, reason="kernels already tested in this process")
def test_in_subprocess():
    run_file_in_fresh_process(__file__)
