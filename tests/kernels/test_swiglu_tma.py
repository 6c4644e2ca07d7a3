"""`occult.kernels.swiglu_tma`: GEMM 1 and the SwiGLU dgrad with the SwiGLU in their epilogues, through TMA.

Without a GPU under Triton's CPU interpreter (small tiles: several tiles, experts and persistent-loop iterations);
on a Hopper GPU compiled. Each kernel against a per-expert torch product on the same sorted rows (fp64 on CPU), and
the whole op under settings `gemm1` / `dgrad1` = `tma` against the fp32 reference and the `_grouped_mm` path.
"""

from __future__ import annotations

import pytest
import torch

# first: Triton's CPU interpreter without a GPU, or this file in a fresh process (test_in_subprocess)
from _triton_interpreter import DEVICE, IN_PROCESS, needs_in_process, run_file_in_fresh_process

from occult import kernels
from occult.moe.experts import expert_mlp_reference

pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and torch.cuda.get_device_capability()[0] < 9, reason="TMA needs compute capability 9 (Hopper)"
)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    denom = b.norm().item()
    return (a - b).norm().item() / denom if denom > 0 else (a - b).norm().item()


def _sorted_problem(seed: int, R: int, K: int, E: int, H: int, F: int, empty=(1,)):
    """Pairs sorted by expert (experts in `empty` get none), x rows copied into that order, garbage past P."""
    from occult.kernels.grouped_mm import gather_pair_rows
    from occult.kernels.pairs import build_pairs

    g = torch.Generator().manual_seed(seed)
    slots = torch.randint(0, E, (R, K), generator=g)
    for e in empty:
        slots[slots == e] = -1
    slots[torch.rand(R, K, generator=g) < 0.2] = -1
    dt = torch.bfloat16
    x = torch.randn(R, H, generator=g).to(DEVICE, dt)
    gates = torch.rand(R * K, generator=g).to(DEVICE)
    gate_up = (torch.randn(E, 2 * F, H, generator=g) / H**0.5).to(DEVICE, dt)
    down = (torch.randn(E, H, F, generator=g) / F**0.5).to(DEVICE, dt)
    pair, offsets = build_pairs(slots.to(DEVICE), E)
    x_sorted = gather_pair_rows(x, pair, offsets, K)
    num_pairs = int(offsets[-1])
    x_sorted[num_pairs:] = float("nan")  # rows past P are never read into a stored row
    return pair, offsets, gates, x_sorted, gate_up, down, num_pairs


def _per_expert(rows, weight, offsets, fn):
    """`fn(rows[s:t], weight[e])` stacked in sorted order, fp64."""
    out = [fn(rows[s:t].double(), weight[e].double()) for e, (s, t) in enumerate(zip(offsets[:-1], offsets[1:]))]
    return torch.cat(out)


@needs_in_process
@pytest.mark.parametrize("R,K,E,H,F", [(37, 3, 5, 48, 40), (40, 2, 4, 64, 32), (23, 1, 6, 40, 24)])
def test_gemm1_swiglu_matches_per_expert_products(R, K, E, H, F):
    # ragged tiles (H and F not multiples of the 16-wide tiles), an expert with no rows, NaN rows past P
    from occult.kernels import swiglu_tma

    pair, offsets, gates, x_sorted, gate_up, _, p = _sorted_problem(R + K + E, R, K, E, H, F)
    assert swiglu_tma.fits(x_sorted, gate_up)
    hg, ab = swiglu_tma.gemm1_swiglu(x_sorted, gate_up, pair, offsets, gates)
    off = offsets.tolist()
    ab_ref = _per_expert(x_sorted, gate_up, off, lambda x, w: x @ w.T)
    a, b = ab_ref[:, :F], ab_ref[:, F:]
    hg_ref = gates[pair[:p].long()].double()[:, None] * a * torch.sigmoid(a) * b
    assert _rel(ab[:p], ab_ref) < 1e-2 and _rel(hg[:p], hg_ref) < 1e-2
    assert torch.isfinite(ab[:p]).all() and torch.isfinite(hg[:p]).all()


@needs_in_process
@pytest.mark.parametrize("R,K,E,H,F", [(37, 3, 5, 48, 40), (40, 2, 4, 64, 32)])
def test_swiglu_dgrad_matches_the_grouped_mm_pass(R, K, E, H, F):
    from occult.kernels import swiglu_tma
    from occult.kernels.grouped_mm import gather_pair_rows, swiglu_backward_rows

    pair, offsets, gates, x_sorted, gate_up, down, p = _sorted_problem(2 * R + E, R, K, E, H, F)
    g = torch.Generator().manual_seed(R * E)
    dy = torch.randn(R, H, generator=g).to(DEVICE, torch.bfloat16)
    dy_sorted = gather_pair_rows(dy, pair, offsets, K)
    ab = swiglu_tma.gemm1_swiglu(x_sorted, gate_up, pair, offsets, gates)[1]
    dab, dg = swiglu_tma.swiglu_dgrad(dy_sorted, down, ab, pair, offsets, gates)
    u = _per_expert(dy_sorted, down, offsets.tolist(), lambda d, w: d @ w).float()
    u_full = torch.zeros(pair.numel(), F, device=DEVICE)
    u_full[:p] = u
    dab_ref, dg_ref = swiglu_backward_rows(u_full, ab, pair, offsets, gates)  # (the elementwise pass, fp32 u)
    assert _rel(dab[:p], dab_ref[:p]) < 1e-2 and _rel(dg, dg_ref) < 1e-3
    valid = torch.zeros(pair.numel(), dtype=torch.bool, device=DEVICE)
    valid[pair[:p].long()] = True
    assert torch.count_nonzero(dg[~valid]) == 0  # padding slots get no gate gradient


@needs_in_process
@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")
@pytest.mark.parametrize("top_k", [1, 3, 5])
def test_op_with_tma_matches_reference_and_grouped_mm(monkeypatch, top_k):
    # the whole op, one rank's dense rows (top-k = all at 5 experts), every gradient, against the fp32 reference and
    # the _grouped_mm path of the same settings
    R, E, H, F = 29, 5, 48, 40
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    slots = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(R)])
    dt = torch.bfloat16
    leaf = lambda t, d=dt: t.to(DEVICE, d).requires_grad_()  # noqa: E731
    x = leaf(torch.randn(R, H, generator=g))
    gates = leaf(torch.rand(R, top_k, generator=g), torch.float32)
    w1 = leaf(torch.randn(E, 2 * F, H, generator=g) / H**0.5)
    w2 = leaf(torch.randn(E, H, F, generator=g) / F**0.5)
    dy = torch.randn(R, H, generator=g).to(DEVICE, dt)
    inputs = (x, gates, w1, w2)

    def run(fn):
        y = fn(x, slots.to(DEVICE), gates, w1, w2)
        return (y, *torch.autograd.grad(y, inputs, dy))

    ref_in = [t.detach().double().requires_grad_() for t in inputs]
    y = expert_mlp_reference(ref_in[0], slots.to(DEVICE), *ref_in[1:])
    ref = (y, *torch.autograd.grad(y, ref_in, dy.double()))
    monkeypatch.setenv("OCCULT_WGRAD", "grouped_mm")
    got = {}
    for mode in ("grouped_mm", "tma"):
        monkeypatch.setenv("OCCULT_GEMM1", mode)
        monkeypatch.setenv("OCCULT_DGRAD1", mode)
        got[mode] = run(lambda *a: kernels.expert_mlp(*a, dense=True))
    for name, a, b, r in zip(("y", "dx", "dgates", "dgate_up", "ddown"), got["tma"], got["grouped_mm"], ref):
        assert a.dtype == b.dtype, name
        assert _rel(a, r) < 3e-2 and _rel(a, b) < 2e-2, name


@needs_in_process
def test_fits_refuses_what_the_descriptors_cannot_read():
    from occult.kernels import swiglu_tma

    rows = torch.zeros(64, 48, device=DEVICE, dtype=torch.bfloat16)
    weight = torch.zeros(3, 80, 48, device=DEVICE, dtype=torch.bfloat16)
    assert swiglu_tma.fits(rows, weight)
    assert not swiglu_tma.fits(rows.float(), weight.float())  # 4-byte floats
    assert not swiglu_tma.fits(rows, weight.half())  # mixed dtypes
    assert not swiglu_tma.fits(rows[:, :44], weight)  # rows not contiguous
    assert not swiglu_tma.fits(torch.zeros(64, 44, device=DEVICE, dtype=torch.bfloat16), weight)  # 88-byte rows
    offset = torch.zeros(64 * 48 + 4, device=DEVICE, dtype=torch.bfloat16)[4:].view(64, 48)
    assert not swiglu_tma.fits(offset, weight)  # its start 8 bytes off 16


@pytest.mark.skipif(IN_PROCESS, reason="kernels already tested in this process")
def test_in_subprocess():
    run_file_in_fresh_process(__file__)
