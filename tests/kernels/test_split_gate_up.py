"""The expert kernels with gate and up weights kept apart (`gate_up_proj_EFH=(gate, up)`, TorchTitan's `w1`, `w3`).

The kernels read both tensors where they are and return one gradient each; against the float64 reference
(outputs and every gradient), against the same weights joined into one `[E, 2F, H]` tensor (bit for bit where the
tiles line up with F: the same products in the same order), through the `_grouped_mm` weight gradients, the
paths that join them first (the `_grouped_mm` GEMM 1, decode), deferred weight gradients, strided weights and bad
shapes. Under Triton's CPU interpreter without a GPU (small tiles: several per F).
"""

from __future__ import annotations

import pytest
import torch

# first: Triton's CPU interpreter without a GPU, or this file in a fresh process (test_in_subprocess)
from _triton_interpreter import DEVICE, IN_PROCESS, needs_in_process, run_file_in_fresh_process

from occult import kernels
from occult.moe.experts import LocalExperts, expert_mlp_reference


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return (a - b).norm().item() / max(b.norm().item(), 1e-30)


def _inputs(R, K, E, H, F, dtype=torch.float32, seed=None, empty_expert=True):
    """x, slots (padding and, optionally, expert 1 without rows), gates, gate, up, down, dy; fresh draws."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())) if seed is None else seed)
    slots = torch.randint(0, E, (R, K), generator=g)
    slots[torch.rand(R, K, generator=g) < 0.3] = -1
    if empty_expert:
        slots[slots == 1] = -1
    leaf = lambda t: t.to(DEVICE, dtype).requires_grad_()  # noqa: E731
    return (
        leaf(torch.randn(R, H, generator=g)),
        slots.to(DEVICE),
        leaf(torch.rand(R, K, generator=g)),
        leaf(torch.randn(E, F, H, generator=g) / H**0.5),
        leaf(torch.randn(E, F, H, generator=g) / H**0.5),
        leaf(torch.randn(E, H, F, generator=g) / F**0.5),
        torch.randn(R, H, generator=g).to(DEVICE, dtype),
    )


def _split(x, slots, gates, gate, up, down, dy):
    y = kernels.expert_mlp(x, slots, gates, (gate, up), down)
    return (y, *torch.autograd.grad(y, (x, gates, gate, up, down), dy))


def _joined(x, slots, gates, gate, up, down, dy):
    y = kernels.expert_mlp(x, slots, gates, torch.cat([gate, up], dim=1), down)
    return (y, *torch.autograd.grad(y, (x, gates, gate, up, down), dy))


def _reference(x, slots, gates, gate, up, down, dy):
    x, gates, gate, up, down = (t.detach().double().requires_grad_() for t in (x, gates, gate, up, down))
    y = expert_mlp_reference(x, slots, gates, torch.cat([gate, up], dim=1), down)
    return (y, *torch.autograd.grad(y, (x, gates, gate, up, down), dy.double()))


NAMES = ("y", "dx", "dgates", "dgate", "dup", "ddown")


@needs_in_process
@pytest.mark.parametrize("ffn", [48, 40])  # 48: the kernels' tiles divide F; 40: a masked tail in each half
def test_kept_apart_matches_the_reference_and_the_joined_weight(ffn):
    ins = _inputs(37, 3, 5, 32, ffn)
    got, joined, ref = _split(*ins), _joined(*ins), _reference(*ins)
    for name, a, b, r in zip(NAMES, got, joined, ref):
        assert _rel(a, r) < 1e-5, name
        if ffn % 16 == 0:  # (the interpreter's tiles are 16 wide: the same products in the same order)
            assert torch.equal(a, b), name
        else:
            assert _rel(a, b) < 1e-6, name
    dgate, dup = got[3], got[4]
    assert dgate.is_contiguous() and dup.is_contiguous() and dgate.data_ptr() != dup.data_ptr()
    assert torch.count_nonzero(dgate[1]) == 0 and torch.count_nonzero(dup[1]) == 0  # expert 1 has no rows


@needs_in_process
@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")
@pytest.mark.parametrize("gemm1", ["triton", "grouped_mm"])  # grouped_mm's GEMM 1 takes the joined weight only
def test_kept_apart_through_grouped_mm(monkeypatch, gemm1):
    monkeypatch.setenv("OCCULT_WGRAD", "grouped_mm")
    monkeypatch.setenv("OCCULT_DGRAD1", "grouped_mm")
    monkeypatch.setenv("OCCULT_GEMM1", gemm1)
    ins = _inputs(40, 3, 6, 64, 48, dtype=torch.bfloat16)
    got, ref = _split(*ins), _reference(*ins)
    for name, a, r in zip(NAMES, got, ref):
        assert a.dtype == torch.bfloat16 and _rel(a, r) < 3e-2, name
    assert torch.count_nonzero(got[3][1]) == 0 and torch.count_nonzero(got[4][1]) == 0


@needs_in_process
def test_kept_apart_without_autograd_and_in_decode():
    ins = _inputs(25, 2, 3, 32, 32)
    x, slots, gates, gate, up, down, _ = ins
    with torch.no_grad():
        want = expert_mlp_reference(x, slots, gates, torch.cat([gate, up], dim=1), down)
        assert _rel(kernels.expert_mlp(x, slots, gates, (gate, up), down), want) < 1e-5
        assert _rel(LocalExperts((gate, up), down, backend="triton")(x, slots, gates), want) < 1e-5
        assert _rel(LocalExperts((gate, up), down, backend="torch")(x, slots, gates), want) < 1e-12
        one = slice(0, 3)  # a decode-sized call (the small-batch kernels join the weights first)
        assert _rel(kernels.expert_mlp(x[one], slots[one], gates[one], (gate, up), down), want[one]) < 1e-5


@needs_in_process
def test_kept_apart_with_deferred_weight_gradients(monkeypatch):
    ins = _inputs(24, 3, 4, 16, 16, empty_expert=False)
    x, slots, gates, gate, up, down, dy = ins
    runs = []
    for defer in ("0", "1"):
        monkeypatch.setenv("OCCULT_DEFER_WGRAD", defer)
        for t in (x, gates, gate, up, down):
            t.grad = None
        for _ in range(2):  # the second step adds to the first's .grad
            (kernels.expert_mlp(x, slots, gates, (gate, up), down) * dy).sum().backward()
        runs.append([t.grad.clone() for t in (x, gates, gate, up, down)])
    for name, a, b in zip(NAMES[1:], *runs):
        assert torch.equal(a, b), name


@needs_in_process
def test_kept_apart_strided_weights_and_bad_shapes():
    ins = _inputs(30, 2, 3, 32, 48)
    x, slots, gates, gate, up, down, dy = ins
    up_t = up.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()  # other strides than gate's
    got = _split(x, slots, gates, gate, up_t, down, dy)
    ref = _reference(x, slots, gates, gate, up_t, down, dy)
    for name, a, r in zip(NAMES, got, ref):
        assert _rel(a, r) < 1e-5, name
    with pytest.raises(ValueError, match="gate and up"):
        kernels.expert_mlp(x, slots, gates, (gate, up[:, :-1]), down)
    with pytest.raises(ValueError, match="down"):
        kernels.expert_mlp(x, slots, gates, (gate, up), down[:, :, :-1])
    from occult.kernels.grouped_gemm import gather_gemm_swiglu, gemm_scatter
    from occult.kernels.pairs import build_pairs

    pair, offsets = build_pairs(slots, 3)
    with torch.no_grad(), pytest.raises(ValueError, match="one shape and strides"):  # (the launchers' own checks)
        gather_gemm_swiglu(x, pair, offsets, gate, up.transpose(1, 2).contiguous().transpose(1, 2), gates, 2, False)
    with torch.no_grad(), pytest.raises(ValueError, match="b2 must match b"):
        out = x.new_empty((60, 48))
        gemm_scatter(x, pair, offsets, gate.transpose(1, 2), 2, out, b2_EKN=up[:, :-1].transpose(1, 2))  # (another N)


@pytest.mark.skipif(IN_PROCESS, reason="kernels already tested in this process")
def test_in_subprocess():
    run_file_in_fresh_process(__file__)
