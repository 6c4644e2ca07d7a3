"""`occult.kernels.grouped_gemm_tma`: GEMM 2 and the GEMM-1 dgrad with their operands read through TMA descriptors.

Against the pointer kernel (`OCCULT_TMA=off`) bit for bit (the same tiles, the same products in the same order),
against the float64 reference, with the edges the descriptors meet: a tile's rows past its expert's, an expert with
no rows, padding slots, N and K not multiples of the tiles (the weight's next expert read, then masked or multiplied
by zeros), and the layouts it does not take (gate and up kept apart, strided rows, fp32) falling back. Under
Triton's CPU interpreter without a GPU (small tiles), compiled on one.
"""

from __future__ import annotations

import pytest
import torch

# first: Triton's CPU interpreter without a GPU, or this file in a fresh process (test_in_subprocess)
from _triton_interpreter import DEVICE, IN_PROCESS, needs_in_process, run_file_in_fresh_process

from occult import kernels
from occult.kernels.grouped_gemm import gemm_scatter
from occult.kernels.grouped_gemm_tma import layout
from occult.kernels.pairs import build_pairs
from occult.moe.experts import expert_mlp_reference


def _draw(R, K, E, H, F, dtype=torch.bfloat16):
    """x, slots (padding, expert 1 without rows), gates, gate_up, down, dy: fresh draws."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    slots = torch.randint(0, E, (R, K), generator=g)
    slots[torch.rand(R, K, generator=g) < 0.2] = -1
    slots[slots == 1] = -1
    leaf = lambda t: t.to(DEVICE, dtype).requires_grad_()  # noqa: E731
    return (
        leaf(torch.randn(R, H, generator=g)),
        slots.to(DEVICE),
        leaf(torch.rand(R, K, generator=g)),
        leaf(torch.randn(E, 2 * F, H, generator=g) / H**0.5),
        leaf(torch.randn(E, H, F, generator=g) / F**0.5),
        torch.randn(R, H, generator=g).to(DEVICE, dtype),
    )


def _step(x, slots, gates, gate_up, down, dy):
    y = kernels.expert_mlp(x, slots, gates, gate_up, down)
    return (y, *torch.autograd.grad(y, (x, gates, gate_up, down), dy))


def _calls(monkeypatch) -> list[bool]:
    """Which kernel each stored gemm_scatter product took (True: TMA)."""
    from occult.kernels import grouped_gemm

    taken: list[bool] = []
    real = grouped_gemm.gemm_scatter_tma
    monkeypatch.setattr(grouped_gemm, "gemm_scatter_tma", lambda *a, **k: taken.append(True) or real(*a, **k))
    return taken


@needs_in_process
@pytest.mark.parametrize("shape", [(40, 4, 5, 32, 32), (37, 3, 6, 40, 24)], ids=["tiles-divide", "tails"])
def test_the_tma_kernel_equals_the_pointer_kernel_bit_for_bit(monkeypatch, shape):
    ins = _draw(*shape)
    runs = {}
    for mode in ("off", "on"):
        monkeypatch.setenv("OCCULT_TMA", mode)
        taken = _calls(monkeypatch)
        runs[mode] = _step(*ins)
        assert len(taken) == (2 if mode == "on" else 0)  # the forward's GEMM 2 and the backward's dx
    for a, b in zip(runs["on"], runs["off"]):
        assert torch.equal(a, b)
    x, slots, gates, gate_up, down, dy = (t.detach().double() if t.is_floating_point() else t for t in ins)
    want = expert_mlp_reference(x, slots, gates, gate_up, down)
    y = runs["on"][0].double()
    assert (y - want).norm() / want.norm() < 2e-2  # bf16 storage of the products


@needs_in_process
def test_a_tile_past_the_last_pair_and_an_expert_without_rows(monkeypatch):
    E, H, F, K = 4, 32, 32, 2
    slots = torch.tensor([[0, 3], [3, -1], [0, 0], [3, 2]], device=DEVICE)  # expert 1 has none, expert 0 a repeat
    pair, offsets = build_pairs(slots, E)
    a = torch.randn(slots.numel(), F, device=DEVICE).bfloat16()
    down = (torch.randn(E, H, F, device=DEVICE) / F**0.5).bfloat16()
    out = {}
    for mode in ("off", "on"):
        monkeypatch.setenv("OCCULT_TMA", mode)
        taken = _calls(monkeypatch)
        blank = torch.zeros(slots.numel(), H, device=DEVICE, dtype=torch.bfloat16)
        out[mode] = gemm_scatter(a, pair, offsets, down.transpose(1, 2), K, blank)
        assert len(taken) == (mode == "on")
    assert torch.equal(out["on"], out["off"])
    assert out["on"][3].abs().sum() == 0  # the padding slot's row is never written
    placed = pair[: int(offsets[-1])].long()  # row i of `a` is sorted pair i, stored at its flat index
    want = torch.einsum("pf,phf->ph", a[: len(placed)].float(), down[slots.reshape(-1)[placed]].float())
    assert torch.allclose(out["on"][placed].float(), want, rtol=1e-2, atol=1e-2)


def test_layouts_the_kernel_takes_and_those_it_does_not():
    E, F, H, P = 3, 16, 24, 10
    gate_up = torch.randn(E, 2 * F, H).bfloat16()
    down = torch.randn(E, H, F).bfloat16()
    rows, rows_f = torch.randn(P, 2 * F).bfloat16(), torch.randn(P, F).bfloat16()
    out = torch.empty(P, H).bfloat16()
    b2d, k_major = layout(rows, gate_up, None, out)  # the dgrad of GEMM 1: the joined weight
    assert not k_major and b2d.shape == (E * 2 * F, H) and b2d.data_ptr() == gate_up.data_ptr()
    b2d, k_major = layout(rows_f, down.transpose(1, 2), None, out)  # GEMM 2: down read transposed
    assert k_major and b2d.shape == (E * H, F)
    assert layout(rows_f, down.transpose(1, 2).contiguous(), None, out)[1] is False  # [E, F, H] stored
    assert layout(rows, gate_up[:, :F], gate_up[:, F:], out) is None  # gate and up as two tensors
    assert layout(rows[:, :F], down.transpose(1, 2), None, out) is None  # rows 2F apart, not F
    assert layout(rows_f, down.transpose(1, 2), None, out.float()) is None  # an fp32 output
    assert layout(rows.float(), gate_up.float(), None, out.float()) is None  # fp32 operands
    assert layout(torch.randn(P * F + 1).bfloat16()[1:].view(P, F), down.transpose(1, 2), None, out) is None  # 2 B off


@pytest.mark.skipif(IN_PROCESS, reason="ran in this process")
def test_in_subprocess():
    run_file_in_fresh_process(__file__)
