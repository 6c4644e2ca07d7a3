"""The Triton expert kernels at real shapes on a GPU, against the torch reference in fp32.

Shapes are those one rank sees in the OLMoE layer (hidden 2048, expert ffn 1024): the dedup
dispatcher's rows (up to 8 local experts per row, the rest padding) and the standard
dispatcher's (one expert per row). Forward and every gradient (x, gates, both weights), in
fp32 (exact "ieee" products), bf16 and fp16.
"""

from __future__ import annotations

import pytest
import torch

from occult import kernels

TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}
NAMES = ("y", "dx", "dgates", "dgate_up", "ddown")
SHAPES = {  # rows, slots per row, local experts, padding share
    "dedup": (12288, 8, 16, 0.6),
    "standard": (32768, 1, 32, 0.0),
}
H, F = 2048, 1024


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return (a - b).norm().item() / max(b.norm().item(), 1e-30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_kernels_match_reference_at_olmoe_shape(shape, dtype):
    from occult.moe.experts import expert_mlp_reference

    assert kernels.available("cuda")
    R, K, E, pad = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31, ())))
    dev = "cuda"
    slots = torch.randint(0, E, (R, K), device=dev, generator=g)
    slots[torch.rand(R, K, device=dev, generator=g) < pad] = -1
    x = torch.randn(R, H, device=dev, generator=g)
    gates = torch.rand(R, K, device=dev, generator=g)
    w1 = torch.randn(E, 2 * F, H, device=dev, generator=g) / H**0.5
    w2 = torch.randn(E, H, F, device=dev, generator=g) / F**0.5
    dy = torch.randn(R, H, device=dev, generator=g)
    ins = [t.to(dtype).requires_grad_() for t in (x, gates, w1, w2)]
    ins[1] = gates.float().requires_grad_()  # gate weights arrive in fp32 from the router
    y = kernels.expert_mlp(ins[0], slots, ins[1], ins[2], ins[3])
    got = (y, *torch.autograd.grad(y, ins, dy.to(dtype)))
    ref_ins = [t.detach().float().requires_grad_() for t in ins]
    y_ref = expert_mlp_reference(ref_ins[0], slots, ref_ins[1], ref_ins[2], ref_ins[3])
    ref = (y_ref, *torch.autograd.grad(y_ref, ref_ins, dy.to(dtype).float()))
    errors = {n: _rel(a, b) for n, a, b in zip(NAMES, got, ref)}
    assert all(torch.isfinite(t).all() for t in got), errors
    assert max(errors.values()) < TOL[dtype], (shape, dtype, errors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_gate_and_up_kept_apart_at_qwen3_shape(dtype):
    """TorchTitan's `w1` and `w3` as two tensors (`gate_up_proj_EFH=(gate, up)`): the kernels read both where they
    are (GEMM 1 through two pointers, the input gradient's GEMM over both) and give each its own gradient; Qwen3's
    expert shape on one of 2 EP ranks (64 experts x 768, hidden 2048), against the fp32 reference."""
    from occult.moe.experts import expert_mlp_reference

    R, K, E, pad, h, f = 12288, 8, 64, 0.6, 2048, 768
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(int(torch.randint(0, 2**31, ())))
    slots = torch.randint(0, E, (R, K), device=dev, generator=g)
    slots[torch.rand(R, K, device=dev, generator=g) < pad] = -1
    slots[slots == 3] = -1  # an expert without rows
    weights = [torch.randn(E, f, h, device=dev, generator=g) / h**0.5 for _ in range(2)]
    weights.append(torch.randn(E, h, f, device=dev, generator=g) / f**0.5)
    x, dy = torch.randn(R, h, device=dev, generator=g), torch.randn(R, h, device=dev, generator=g).to(dtype)
    ins = [t.to(dtype).requires_grad_() for t in (x, *weights)]
    gates = torch.rand(R, K, device=dev, generator=g).requires_grad_()  # fp32, as from the router
    y = kernels.expert_mlp(ins[0], slots, gates, (ins[1], ins[2]), ins[3])
    got = (y, *torch.autograd.grad(y, (ins[0], gates, *ins[1:]), dy))
    ref_ins = [t.detach().float().requires_grad_() for t in (ins[0], gates, *ins[1:])]
    y_ref = expert_mlp_reference(ref_ins[0], slots, ref_ins[1], torch.cat(ref_ins[2:4], dim=1), ref_ins[4])
    ref = (y_ref, *torch.autograd.grad(y_ref, ref_ins, dy.float()))
    names = ("y", "dx", "dgates", "dgate", "dup", "ddown")
    errors = {n: _rel(a, b) for n, a, b in zip(names, got, ref)}
    assert all(torch.isfinite(t).all() for t in got), errors
    assert max(errors.values()) < TOL[dtype], (dtype, errors)
    assert got[3].is_contiguous() and got[4].is_contiguous()
    assert torch.count_nonzero(got[3][3]) == 0 and torch.count_nonzero(got[4][3]) == 0


def _poison_free_memory(device: str) -> None:
    """Fill free device memory with NaN bit patterns (all bits set): first memory handed back to the
    driver (`empty_cache`), which a new segment (a CUDA-graph recording's own pool) may get, then the
    caching allocator's free blocks. A kernel that reads memory it never wrote (rows past the last pair,
    an expert with no rows) then sees NaN, as it may in a training step after other work freed its memory."""
    for keep in (False, True):
        big = [torch.full((1 << 28,), -1, dtype=torch.int32, device=device) for _ in range(4)]  # 4 x 1 GiB
        small = [torch.full((1 << 17,), -1, dtype=torch.int32, device=device) for _ in range(512)]  # 512 KiB each
        del big, small
        if not keep:
            torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_kernels_never_read_memory_they_did_not_write(dtype):
    """Forward and backward on memory that holds NaN wherever it was not written: every output and
    gradient finite and equal to the reference, with half the local experts getting no rows and
    most slots padding (the rows past the last pair and the empty experts' groups are never read)."""
    from occult.moe.experts import expert_mlp_reference

    R, K, E = 6144, 8, 16
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(int(torch.randint(0, 2**31, ())))
    slots = torch.randint(0, E // 2, (R, K), device=dev, generator=g) * 2  # odd experts get no rows
    slots[torch.rand(R, K, device=dev, generator=g) < 0.7] = -1
    x = torch.randn(R, H, device=dev, generator=g)
    gates = torch.rand(R, K, device=dev, generator=g)
    w1 = torch.randn(E, 2 * F, H, device=dev, generator=g) / H**0.5
    w2 = torch.randn(E, H, F, device=dev, generator=g) / F**0.5
    dy = torch.randn(R, H, device=dev, generator=g).to(dtype)
    ins = [
        x.to(dtype).requires_grad_(),
        gates.requires_grad_(),
        w1.to(dtype).requires_grad_(),
        w2.to(dtype).requires_grad_(),
    ]
    _poison_free_memory(dev)
    y = kernels.expert_mlp(ins[0], slots, ins[1], ins[2], ins[3])
    _poison_free_memory(dev)
    got = (y, *torch.autograd.grad(y, ins, dy))
    ref_ins = [t.detach().float().requires_grad_() for t in ins]
    y_ref = expert_mlp_reference(ref_ins[0], slots, ref_ins[1], ref_ins[2], ref_ins[3])
    ref = (y_ref, *torch.autograd.grad(y_ref, ref_ins, dy.float()))
    finite = {n: bool(torch.isfinite(t).all()) for n, t in zip(NAMES, got)}
    assert all(finite.values()), (dtype, finite)
    errors = {n: _rel(a, b) for n, a, b in zip(NAMES, got, ref)}
    assert max(errors.values()) < TOL[dtype], (dtype, errors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_one_program_per_tile_gives_the_persistent_launch_bit_for_bit(dtype, monkeypatch):
    """`OCCULT_KERNEL_GRID=tiles` (one program per tile of the bound, those past the device's count exiting)
    computes every tile as the persistent launch does, so the output and every gradient are the same bits; the
    grid is that many programs."""
    from occult.kernels import grouped_gemm

    R, K, E = 12288, 8, 16
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(int(torch.randint(0, 2**31, ())))
    slots = torch.randint(0, E, (R, K), device=dev, generator=g)
    slots[torch.rand(R, K, device=dev, generator=g) < 0.6] = -1
    ins = [
        torch.randn(R, H, device=dev, generator=g).to(dtype),
        torch.rand(R, K, device=dev, generator=g),
        (torch.randn(E, 2 * F, H, device=dev, generator=g) / H**0.5).to(dtype),
        (torch.randn(E, H, F, device=dev, generator=g) / F**0.5).to(dtype),
    ]
    dy = torch.randn(R, H, device=dev, generator=g).to(dtype)

    def run() -> tuple[torch.Tensor, ...]:
        leaves = [t.detach().clone().requires_grad_() for t in ins]
        y = kernels.expert_mlp(leaves[0], slots, leaves[1], leaves[2], leaves[3])
        return (y, *torch.autograd.grad(y, leaves, dy))

    monkeypatch.setenv("OCCULT_KERNEL_GRID", "persistent")
    persistent = run()
    assert grouped_gemm.num_programs(torch.device(dev), 10**6) < 10**6
    monkeypatch.setenv("OCCULT_KERNEL_GRID", "tiles")
    assert grouped_gemm.num_programs(torch.device(dev), 10**6) == 10**6
    tiles = run()
    for name, a, b in zip(NAMES, tiles, persistent):
        assert torch.equal(a, b), (name, dtype, (a.float() - b.float()).abs().max().item())
