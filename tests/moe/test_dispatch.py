"""Dispatch metadata: gates and slots travel with their rows as bytes (uint8: every backend carries it)."""

from __future__ import annotations

import pytest
import torch

from occult.moe.comm import metadata_bytes, pack_metadata, send_with_gates, send_with_metadata

# Integer dtypes NCCL's all-to-all accepts (ncclInt8/Uint8/Int32/Uint32/Int64/Uint64).
NCCL_INTS = {torch.int8, torch.uint8, torch.int32, torch.int64}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_metadata_roundtrip_is_bit_exact_in_an_nccl_dtype(dtype):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    rows, k = 37, 5
    gates = torch.rand(rows, k, generator=gen).to(dtype)
    gates[0, 0] = torch.finfo(dtype).tiny  # smallest normal survives the carrier
    gates[1, 1] = 0.0
    slots = torch.randint(-1, 9, (rows, k), generator=gen)
    packed = pack_metadata(gates, slots)
    assert packed.dtype in NCCL_INTS, f"{dtype} gates packed as {packed.dtype}, which NCCL cannot send"
    assert packed.shape[0] == rows and packed.shape[1] % 16 == 0
    assert packed.shape[1] >= k * (gates.element_size() + 4)
    assert metadata_bytes(gates) == packed.numel() * packed.element_size()
    hidden = int(torch.randint(1, 40, (), generator=gen))
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    out_x, out_gates, out_slots = send_with_metadata(x, gates, slots, [rows], [rows], None)
    assert out_gates.dtype == dtype and out_x.dtype == dtype and out_x.shape == x.shape
    assert out_x.stride(0) * out_x.element_size() % 16 == 0, "row starts must stay 16-byte aligned"
    assert torch.equal(out_x.contiguous().view(torch.uint8), x.view(torch.uint8))
    assert torch.equal(out_gates.view(-1).view(torch.uint8), gates.view(-1).view(torch.uint8))
    assert torch.equal(out_slots, slots)
    back_x, back_gates = send_with_gates(x, gates, [rows], [rows], None)
    assert torch.equal(back_x.contiguous().view(torch.uint8), x.view(torch.uint8))
    assert torch.equal(back_gates.view(torch.uint8), gates.view(torch.uint8))
