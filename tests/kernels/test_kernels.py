"""Triton expert-MLP kernels vs the torch reference (`occult.moe.experts.expert_mlp_reference`).

Without a GPU these run under Triton's CPU interpreter (`TRITON_INTERPRET=1`, set by _triton_interpreter.py before
the kernels are imported), on small shapes with small tiles, so several tiles, experts and
persistent-loop iterations are exercised. With a GPU they run compiled on it. The GPU-size
check (timings, large shapes, no host sync) is `benchmarks/bench_kernels.py`.
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


def _inputs(R, K, E, H, F, *, dtype=torch.float32, gate_dtype=None, slots=None, seed=0, pad=0.3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, H, generator=g)
    if slots is None:
        slots = torch.randint(0, E, (R, K), generator=g)
        slots[torch.rand(R, K, generator=g) < pad] = -1
    gates = torch.rand(R, K, generator=g)
    w1 = torch.randn(E, 2 * F, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, F, generator=g) / F**0.5
    dy = torch.randn(R, H, generator=g)
    to = lambda t, dt: t.to(DEVICE, dt).requires_grad_()  # noqa: E731
    return (
        to(x, dtype),
        slots.to(DEVICE),
        to(gates, gate_dtype or dtype),
        to(w1, dtype),
        to(w2, dtype),
        dy.to(DEVICE, dtype),
    )


def _run(fn, x, slots, gates, w1, w2, dy, **kw):
    y = fn(x, slots, gates, w1, w2, **kw)
    grads = torch.autograd.grad(y, (x, gates, w1, w2), dy, allow_unused=False)
    return y, grads


def _reference_fp32(x, slots, gates, w1, w2, dy):
    """float32 (float64 on CPU) reference on upcast copies of the inputs."""
    dt = torch.float64 if DEVICE == "cpu" else torch.float32
    ins = [t.detach().to(dt).requires_grad_() for t in (x, gates, w1, w2)]
    return _run(expert_mlp_reference, ins[0], slots, ins[1], ins[2], ins[3], dy.to(dt))


NAMES = ("y", "dx", "dgates", "dgate_up", "ddown")


def _assert_close(got, ref, tol):
    (y, grads), (yr, grads_r) = got, ref
    errs = {n: _rel(a, b) for n, a, b in zip(NAMES, (y, *grads), (yr, *grads_r))}
    assert all(e < tol for e in errs.values()), errs
    for n, t in zip(NAMES, (y, *grads)):
        assert torch.isfinite(t).all(), n


@needs_in_process
def test_available():
    assert kernels.available()
    assert kernels.available(DEVICE)


@pytest.mark.parametrize(
    "R,K,E,H,F",
    [
        (37, 3, 5, 48, 40),  # dims not multiples of the tiles, random padding and duplicate slots
        (64, 2, 4, 64, 32),  # every dim a multiple of the tiles (the unmasked-K path)
        (50, 1, 6, 32, 48),  # K = 1: the standard dispatcher's call
    ],
)
@needs_in_process
def test_matches_reference_fp32(R, K, E, H, F):
    ins = _inputs(R, K, E, H, F)
    _assert_close(_run(kernels.expert_mlp, *ins), _reference_fp32(*ins), 1e-4)


@needs_in_process
def test_matches_reference_bf16():
    # bf16 activations and weights, fp32 router gates (the usual mix)
    ins = _inputs(40, 4, 6, 64, 48, dtype=torch.bfloat16, gate_dtype=torch.float32, seed=1)
    got = _run(kernels.expert_mlp, *ins)
    assert got[0].dtype == torch.bfloat16 and got[1][1].dtype == torch.float32
    ref = _reference_fp32(*ins)
    _assert_close(got, ref, 3e-2)
    # and no worse than a few times the torch path's own bf16 error
    torch_bf16 = _run(expert_mlp_reference, *ins)
    for name, a, b, r in zip(NAMES, (got[0], *got[1]), (torch_bf16[0], *torch_bf16[1]), (ref[0], *ref[1])):
        assert _rel(a, r) < 4 * _rel(b, r) + 1e-3, name


@needs_in_process
def test_atomic_scatter_matches():
    ins = _inputs(37, 3, 5, 48, 40, seed=2)
    _assert_close(_run(kernels.expert_mlp, *ins, atomic=True), _reference_fp32(*ins), 1e-4)


@pytest.fixture(scope="module")
def default_run():
    """The kernels' forward and backward with the default configuration (deterministic combine, split SwiGLU
    dgrad epilogue) on the ragged shape: (inputs, result). Read-only: the tests below compare another run to it."""
    ins = _inputs(37, 3, 5, 48, 40, seed=3)
    return ins, _run(kernels.expert_mlp, *ins)


@needs_in_process
def test_deterministic(default_run):
    ins, a = default_run
    b = _run(kernels.expert_mlp, *ins)
    for t, u in zip((a[0], *a[1]), (b[0], *b[1])):
        assert torch.equal(t, u)


@needs_in_process
def test_expert_with_no_rows():
    R, K, E = 30, 2, 5
    slots = torch.randint(0, E - 1, (R, K))
    slots[slots == 2] = 3  # experts 2 and 4 get nothing
    ins = _inputs(R, K, E, 32, 32, slots=slots, seed=4)
    got = _run(kernels.expert_mlp, *ins)
    _assert_close(got, _reference_fp32(*ins), 1e-4)
    dw1, dw2 = got[1][2], got[1][3]
    for e in (2, 4):
        assert torch.count_nonzero(dw1[e]) == 0 and torch.count_nonzero(dw2[e]) == 0


@needs_in_process
def test_all_rows_to_one_expert():
    R, K, E = 45, 2, 4
    slots = torch.full((R, K), -1, dtype=torch.long)
    slots[:, 0] = 1
    ins = _inputs(R, K, E, 32, 48, slots=slots, seed=5)
    _assert_close(_run(kernels.expert_mlp, *ins), _reference_fp32(*ins), 1e-4)


@needs_in_process
def test_padding_only_and_out_of_range_slots():
    R, K, E = 20, 3, 4
    ins = _inputs(R, K, E, 32, 32, slots=torch.full((R, K), -1, dtype=torch.long), seed=6)
    y, grads = _run(kernels.expert_mlp, *ins)
    assert torch.count_nonzero(y) == 0
    assert all(torch.count_nonzero(g) == 0 for g in grads)
    # slots >= E are padding on the Triton path (no device-side check)
    slots = torch.randint(0, E, (R, K))
    ins = _inputs(R, K, E, 32, 32, slots=slots, seed=7)
    bad = slots.clone().to(DEVICE)
    bad[:, 2] = E + 3
    ref_slots = bad.clone()
    ref_slots[:, 2] = -1
    got = _run(kernels.expert_mlp, ins[0], bad, *ins[2:])
    _assert_close(got, _reference_fp32(ins[0], ref_slots, *ins[2:]), 1e-4)


@needs_in_process
def test_zero_rows():
    ins = _inputs(0, 3, 4, 32, 32, seed=8)
    y, grads = _run(kernels.expert_mlp, *ins)
    assert y.shape == (0, 32)
    assert grads[0].shape == (0, 32) and grads[1].shape == (0, 3)
    assert all(torch.count_nonzero(g) == 0 for g in grads[2:])


@needs_in_process
def test_strided_weights_and_partial_grads():
    R, K, E, H, F = 33, 2, 3, 32, 48
    x, slots, gates, _, _, dy = _inputs(R, K, E, H, F, seed=9)
    g = torch.Generator().manual_seed(10)
    # weights as transposed views (not contiguous), and only some inputs need grads
    w1 = (torch.randn(E, H, 2 * F, generator=g) / H**0.5).to(DEVICE).transpose(1, 2).requires_grad_()
    w2 = (torch.randn(E, F, H, generator=g) / F**0.5).to(DEVICE).transpose(1, 2)
    y = kernels.expert_mlp(x, slots, gates.detach(), w1, w2)
    dx, dw1 = torch.autograd.grad(y, (x, w1), dy)
    yr = expert_mlp_reference(x, slots, gates.detach(), w1, w2)
    dxr, dw1r = torch.autograd.grad(yr, (x, w1), dy)
    assert _rel(y, yr) < 1e-4 and _rel(dx, dxr) < 1e-4 and _rel(dw1, dw1r) < 1e-4


@needs_in_process
@pytest.mark.parametrize("R,K,E", [(37, 3, 5), (300, 8, 16), (129, 1, 3), (20, 2, 130)])
def test_pairs_match_a_stable_sort(R, K, E):
    from occult.kernels.pairs import build_pairs, build_pairs_torch

    slots = torch.randint(-1, E + 1, (R, K), generator=torch.Generator().manual_seed(R)).to(DEVICE)
    pair, offsets = build_pairs(slots, E)
    pair_ref, offsets_ref = build_pairs_torch(slots, E)
    assert torch.equal(pair, pair_ref) and torch.equal(offsets, offsets_ref)


@needs_in_process
def test_inference_path_and_backend_selection():
    ins = _inputs(25, 2, 3, 32, 32, seed=11)
    with torch.no_grad():
        y = expert_mlp(*ins[:5], backend="triton")
        yr = expert_mlp_reference(*ins[:5])
    assert _rel(y, yr) < 1e-4
    with pytest.raises(ValueError):
        kernels.expert_mlp(ins[0], ins[1][:, :1], *ins[2:5])


@needs_in_process
@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")
def test_grouped_mm_weight_grads(monkeypatch):
    # the Hopper/bf16 paths (gather + torch._grouped_mm for the weight gradients, optionally for
    # the SwiGLU dgrad and the forward's GEMM 1), forced on any device, vs the reference and the
    # Triton kernels; experts 1 and 4 get no rows (zero weight gradients)
    R, K, E = 40, 3, 6
    slots = torch.randint(0, E, (R, K), generator=torch.Generator().manual_seed(12))
    slots[(slots == 1) | (slots == 4)] = -1
    ins = _inputs(R, K, E, 64, 48, dtype=torch.bfloat16, gate_dtype=torch.float32, slots=slots, seed=12)
    monkeypatch.setenv("OCCULT_WGRAD", "triton")
    monkeypatch.setenv("OCCULT_DGRAD1", "triton")
    monkeypatch.setenv("OCCULT_GEMM1", "triton")
    tri = _run(kernels.expert_mlp, *ins)
    ref = _reference_fp32(*ins)
    # the SwiGLU dgrad and the forward's GEMM 1 through torch._grouped_mm too (GEMM 1 alone: the
    # backward then copies x itself; GEMM 1 with the weight gradients: they read its copy)
    for wgrad, dgrad, gemm1 in [
        ("grouped_mm", "triton", "triton"),
        ("grouped_mm", "grouped_mm", "triton"),
        ("triton", "triton", "grouped_mm"),
        ("grouped_mm", "grouped_mm", "grouped_mm"),
    ]:
        monkeypatch.setenv("OCCULT_WGRAD", wgrad)
        monkeypatch.setenv("OCCULT_DGRAD1", dgrad)
        monkeypatch.setenv("OCCULT_GEMM1", gemm1)
        got = _run(kernels.expert_mlp, *ins)
        _assert_close(got, ref, 3e-2)
        assert _rel(got[0], tri[0]) < 1e-2
        for a, b in zip(got[1], tri[1]):
            assert _rel(a, b) < 1e-2
        for dw in got[1][2:]:
            assert dw.dtype == torch.bfloat16
            assert torch.count_nonzero(dw[1]) == 0 and torch.count_nonzero(dw[4]) == 0
    # only padding: every weight gradient is zero
    pad = _inputs(10, 2, E, 64, 48, dtype=torch.bfloat16, slots=torch.full((10, 2), -1), seed=13)
    assert all(torch.count_nonzero(g) == 0 for g in _run(kernels.expert_mlp, *pad)[1])


@needs_in_process
@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")
def test_grouped_gemm1_backward_twice_gives_the_same_gradients(monkeypatch):
    # the forward's copy of x rows (setting gemm1) is saved for the backward: a second backward of the
    # same graph (retain_graph) must find it as the first left it, whichever backward paths run
    R, K, E = 33, 4, 5
    ins = _inputs(R, K, E, 32, 40, dtype=torch.bfloat16, gate_dtype=torch.float32, seed=torch.seed() % 2**31)
    x, slots, gates, w1, w2, dy = ins
    monkeypatch.setenv("OCCULT_GEMM1", "grouped_mm")
    for wgrad, dgrad in [("grouped_mm", "triton"), ("grouped_mm", "grouped_mm")]:
        monkeypatch.setenv("OCCULT_WGRAD", wgrad)
        monkeypatch.setenv("OCCULT_DGRAD1", dgrad)
        y = kernels.expert_mlp(x, slots, gates, w1, w2)
        assert y.grad_fn.saved_tensors[-1] is not None  # the copy, kept for grad gate_up
        first = torch.autograd.grad(y, (x, gates, w1, w2), dy, retain_graph=True)
        second = torch.autograd.grad(y, (x, gates, w1, w2), dy)
        for a, b in zip(first, second):
            assert torch.equal(a, b)
        # gate_up frozen (fine-tuning the routers, say): the copy is not kept, the other gradients are the same
        frozen = w1.detach()
        y = kernels.expert_mlp(x, slots, gates, frozen, w2)
        assert y.grad_fn.saved_tensors[-1] is None
        for a, b in zip(torch.autograd.grad(y, (x, gates, w2), dy), (first[0], first[1], first[3])):
            assert torch.equal(a, b)


@needs_in_process
@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")
def test_gemm1_auto_takes_grouped_mm_only_for_dense_rows(monkeypatch):
    # under OCCULT_GEMM1=auto the training GEMM 1 takes _grouped_mm (where it would run there: patched true
    # here) only for rows without padding slots, whose kept copy holds real pairs only; forced, always
    from occult.kernels import op

    calls = []
    real = op.gemm1_grouped
    monkeypatch.setattr(op, "use_grouped_mm", lambda *a, **kw: True)
    monkeypatch.setattr(op, "gemm1_grouped", lambda *a: calls.append(1) or real(*a))
    R, K, E = 21, 3, 4
    ins = _inputs(R, K, E, 32, 24, dtype=torch.bfloat16, gate_dtype=torch.float32, seed=torch.seed() % 2**31, pad=0)
    for mode, dense, taken in [("auto", False, 0), ("auto", True, 1), ("grouped_mm", False, 1)]:
        monkeypatch.setenv("OCCULT_GEMM1", mode)
        calls.clear()
        got = _run(lambda *a: kernels.expert_mlp(*a, dense=dense), *ins)
        assert len(calls) == taken, (mode, dense)
        _assert_close(got, _reference_fp32(*ins), 3e-2)
    with torch.no_grad():  # inference: the fused GEMM 1 whatever the setting
        calls.clear()
        kernels.expert_mlp(*ins[:5], dense=True)
        assert not calls


@needs_in_process
def test_gather_pair_rows_writes_the_first_p_rows_only():
    from occult.kernels.grouped_mm import gather_pair_rows
    from occult.kernels.pairs import build_pairs

    R, K, E = 50, 3, 4
    slots = torch.randint(-1, E, (R, K), generator=torch.Generator().manual_seed(14)).to(DEVICE)
    src = torch.randn(R, 40, generator=torch.Generator().manual_seed(15)).to(DEVICE)
    pair, offsets = build_pairs(slots, E)
    out = torch.full((R * K, 40), float("nan"), device=DEVICE)
    gather_pair_rows(src, pair, offsets, K, out=out)
    p = int(offsets[-1])
    assert torch.equal(out[:p], src[pair[:p].long() // K])
    assert torch.isnan(out[p:]).all()


@needs_in_process
def test_dgrad_epilogue_split_matches_unsplit(default_run):
    from occult.kernels import config

    ins, split = default_run
    config.override("dgrad1", split=1)
    try:
        whole = _run(kernels.expert_mlp, *ins)
    finally:
        config.override("dgrad1", None)
    for a, b in zip((split[0], *split[1]), (whole[0], *whole[1])):
        assert _rel(a, b) < 1e-6


@needs_in_process
def test_one_program_per_tile_gives_the_persistent_launch_bit_for_bit(default_run, monkeypatch):
    """`OCCULT_KERNEL_GRID=tiles`: one program per tile of the bound (most past the device's tile count, which exit
    at once) instead of a few walking the tiles; every tile is computed as before, so the same bits."""
    from occult.kernels import grouped_gemm

    assert grouped_gemm.grid_programs(50, 132, "persistent") == 50
    assert grouped_gemm.grid_programs(500, 132, "persistent") == 132
    assert grouped_gemm.grid_programs(500, 132, "tiles") == 500
    assert grouped_gemm.grid_programs(0, 132, "tiles") == grouped_gemm.grid_programs(0, 132, "persistent") == 1
    ins, persistent = default_run
    monkeypatch.setenv("OCCULT_KERNEL_GRID", "tiles")
    assert grouped_gemm.num_programs(torch.device(DEVICE), 500) == 500
    tiles = _run(kernels.expert_mlp, *ins)
    for name, a, b in zip(NAMES, (tiles[0], *tiles[1]), (persistent[0], *persistent[1])):
        assert torch.equal(a, b), name


@pytest.mark.skipif(IN_PROCESS, reason="kernels already tested in this process")
def test_in_subprocess():
    run_file_in_fresh_process(__file__)
