"""Row combine: the local pre-reduction of a row's K pair outputs, in fp32, deterministic.

`y[r] = sum_k [slot[r,k] valid] * buf[r*K + k]` (the forward's pair outputs already carry the
gate weight, see `grouped_gemm`), accumulated in fp32 in slot order and written once in the
output dtype. `buf` rows of padding entries are never read (they were never written either).
It is the token-side row sum of `occult.kernels.rows` with the index `r*K + k` of valid slots.
"""

from __future__ import annotations

import torch

from occult.kernels.rows import gather_sum


def combine_rows(
    buf: torch.Tensor,
    slots_RK: torch.Tensor,
    num_experts: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Sum each row's valid pair rows of `buf` `[R*K, N]` in fp32."""
    num_rows, num_slots = slots_RK.shape
    flat_RK = torch.arange(num_rows * num_slots, device=slots_RK.device).view(num_rows, num_slots)
    valid = (slots_RK >= 0) & (slots_RK < num_experts)
    return gather_sum(buf, torch.where(valid, flat_RK, -1), out_dtype)
