"""One launch each way for the device transport's byte rows (`occult.moe.byte_rows.RowLayout`).

`pack_rows`: send row p = token `token_P[p]`'s activation, its gates (`weights.flat[entry_PK[p]]`,
0 where entry is -1; fp32) and local slots (int32), side by side in one buffer row; rows with token
-1 (the plan's unused capacity) are left as they are (never sent). It replaces the row gather, the
gate gather and three strided copies: the host launches one kernel instead of about a dozen ops.

`unpack_rows`: the R received rows (regions of `stride` rows, one per source rank) back into an
activation tensor [R, H], gates [R, K] (in the gates' dtype) and slots [R, K] (int64); rows past
their region's count (read by the kernel from the device counts) are masked: activation 0, gate 0,
slot -1, so the experts skip them; the row counts and statuses copied out of the buffer's head by
the same launch.

`pack_push_rows`: `pack_rows` and the device transport's push (`occult.kernels.push`) in one launch:
each sent row is gathered straight into its destination rank's receive region (the peer's memory,
region `rank`, row p - start_d), the row counts and this rank's status stored beside them; no staging
rows. One launch and one pass over the bytes fewer per dispatch (decode steps make 16 of them).

The buffer is passed three times, viewed as the activations' dtype, as float32 and as int32 (the
same bytes); row strides and column offsets are in those views' elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _pack_kernel(
    x_ptr,
    token_ptr,
    w_ptr,
    entry_ptr,
    slot_ptr,
    bx_ptr,
    bg_ptr,
    bs_ptr,
    K,
    x_stride,
    bx_stride,
    bw_stride,
    gate_col,
    slot_col,
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,
    K_POW2: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    tok = tl.load(token_ptr + row)
    used = tok >= 0
    tok = tl.maximum(tok, 0)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        x = tl.load(x_ptr + tok * x_stride + h, mask=(h < H) & used)
        tl.store(bx_ptr + row * bx_stride + h, x, mask=(h < H) & used)
    k = tl.arange(0, K_POW2)
    entry = tl.load(entry_ptr + row * K + k, mask=k < K, other=-1)
    gate = tl.load(w_ptr + tl.maximum(entry, 0), mask=(k < K) & (entry >= 0), other=0.0).to(tl.float32)
    slot = tl.load(slot_ptr + row * K + k, mask=k < K, other=-1)
    tl.store(bg_ptr + row * bw_stride + gate_col + k, gate, mask=(k < K) & used)
    tl.store(bs_ptr + row * bw_stride + slot_col + k, slot.to(tl.int32), mask=(k < K) & used)


@triton.jit
def _unpack_kernel(
    bx_ptr,
    bg_ptr,
    bs_ptr,
    counts_ptr,
    x_ptr,
    gates_ptr,
    slots_ptr,
    counts_out_ptr,
    statuses_ptr,
    statuses_out_ptr,
    K,
    stride,
    bx_stride,
    bw_stride,
    gate_col,
    slot_col,
    D,
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,
    K_POW2: tl.constexpr,
    D_POW2: tl.constexpr,
    HAS_STATUS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    if row == 0:  # the counts (and statuses) out of the buffer's head, which the next all-to-all reuses
        r = tl.arange(0, D_POW2)
        tl.store(counts_out_ptr + r, tl.load(counts_ptr + r, mask=r < D), mask=r < D)
        if HAS_STATUS:
            tl.store(statuses_out_ptr + r, tl.load(statuses_ptr + r, mask=r < D), mask=r < D)
    source = row // stride
    valid = (row - source * stride) < tl.load(counts_ptr + source)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        x = tl.load(bx_ptr + row * bx_stride + h, mask=(h < H) & valid, other=0.0)
        tl.store(x_ptr + row * H + h, x, mask=h < H)
    k = tl.arange(0, K_POW2)
    gate = tl.load(bg_ptr + row * bw_stride + gate_col + k, mask=(k < K) & valid, other=0.0)
    slot = tl.load(bs_ptr + row * bw_stride + slot_col + k, mask=(k < K) & valid, other=-1)
    tl.store(gates_ptr + row * K + k, gate.to(gates_ptr.dtype.element_ty), mask=k < K)
    tl.store(slots_ptr + row * K + k, slot.to(tl.int64), mask=k < K)


@triton.jit
def _pack_push_kernel(
    x_ptr,
    token_ptr,
    w_ptr,
    entry_ptr,
    slot_ptr,
    counts_ptr,
    status_ptr,
    peer_rows_ptr,
    peer_counts_ptr,
    K,
    x_stride,
    rank,
    stride_rows,
    row_bytes,
    gate_byte,
    slot_byte,
    D,
    status_slot,
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,
    K_POW2: tl.constexpr,
    D_POW2: tl.constexpr,
    HAS_STATUS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    ranks = tl.arange(0, D_POW2)
    counts = tl.load(counts_ptr + ranks, mask=ranks < D, other=0)
    if row == 0:  # every destination's count (and this rank's status) into its slot `rank` there
        for d in range(0, D):
            dst_counts = tl.load(peer_counts_ptr + d).to(tl.pointer_type(tl.int64))
            tl.store(dst_counts + rank, tl.load(counts_ptr + d))
            if HAS_STATUS:
                tl.store(dst_counts + status_slot + rank, tl.load(status_ptr).to(tl.int64))
    ends = tl.cumsum(counts, axis=0)
    if row < tl.sum(counts, axis=0):
        dest = tl.sum(((ends <= row) & (ranks < D)).to(tl.int64), axis=0)
        start = tl.sum(tl.where(ranks < dest, counts, 0), axis=0)
        tok = tl.maximum(tl.load(token_ptr + row), 0)
        # each peer's receive rows start 16-byte aligned (symm.DeviceTransport checks): with rows of whole
        # 16-byte units, 16-byte stores instead of one per element
        rows_at = tl.multiple_of(tl.load(peer_rows_ptr + dest).to(tl.pointer_type(tl.int8)), 16)
        row_at = rows_at + (rank * stride_rows + row - start) * row_bytes
        dst_x = row_at.to(tl.pointer_type(x_ptr.dtype.element_ty))
        for h0 in range(0, H, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            tl.store(dst_x + h, tl.load(x_ptr + tok * x_stride + h, mask=h < H), mask=h < H)
        k = tl.arange(0, K_POW2)
        entry = tl.load(entry_ptr + row * K + k, mask=k < K, other=-1)
        gate = tl.load(w_ptr + tl.maximum(entry, 0), mask=(k < K) & (entry >= 0), other=0.0).to(tl.float32)
        slot = tl.load(slot_ptr + row * K + k, mask=k < K, other=-1)
        tl.store((row_at + gate_byte).to(tl.pointer_type(tl.float32)) + k, gate, mask=k < K)
        tl.store((row_at + slot_byte).to(tl.pointer_type(tl.int32)) + k, slot.to(tl.int32), mask=k < K)


def pack_push_rows(
    x_TH: torch.Tensor,
    token_P: torch.Tensor,
    weights_TK: torch.Tensor,
    entry_PK: torch.Tensor,
    slot_PK: torch.Tensor,
    gate_byte: int,
    slot_byte: int,
    row_bytes: int,
    counts_D: torch.Tensor,
    peer_rows_D: torch.Tensor,
    peer_counts_D: torch.Tensor,
    rank: int,
    stride_rows: int,
    status: torch.Tensor | None,
    status_slot: int,
) -> None:
    """`pack_rows` into the peers' receive regions directly (module docstring): plan rows packed by
    destination (`counts_D[d]` rows to rank d, int64 on the device), rows of `row_bytes` there;
    `peer_rows_D`, `peer_counts_D`, `status_slot` as for `occult.kernels.push.push_rows`."""
    num_rows, num_k = entry_PK.shape
    D = counts_D.shape[0]
    x_TH, weights = x_TH.contiguous(), weights_TK.contiguous()
    _pack_push_kernel[(max(num_rows, 1),)](
        x_TH,
        token_P.contiguous(),
        weights,
        entry_PK.contiguous(),
        slot_PK.contiguous(),
        counts_D,
        counts_D if status is None else status,
        peer_rows_D,
        peer_counts_D,
        num_k,
        x_TH.stride(0),
        rank,
        stride_rows,
        row_bytes,
        gate_byte,
        slot_byte,
        D,
        status_slot,
        H=x_TH.shape[1],
        BLOCK_H=_block_h(x_TH.shape[1]),
        K_POW2=triton.next_power_of_2(max(num_k, 1)),
        D_POW2=triton.next_power_of_2(D),
        HAS_STATUS=status is not None,
    )


def _views(buf_NW: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return buf_NW.view(dtype), buf_NW.view(torch.float32), buf_NW.view(torch.int32)


def _block_h(hidden: int) -> int:
    return min(1024, triton.next_power_of_2(max(hidden, 16)))


def pack_rows(
    buf_NW: torch.Tensor,
    x_TH: torch.Tensor,
    token_P: torch.Tensor,
    weights_TK: torch.Tensor,
    entry_PK: torch.Tensor,
    slot_PK: torch.Tensor,
    gate_byte: int,
    slot_byte: int,
) -> None:
    """Write plan rows (activation, fp32 gates at byte `gate_byte`, int32 slots at `slot_byte`) into
    the first rows of the byte buffer `buf_NW` [N, W] (module docstring)."""
    num_rows, num_k = entry_PK.shape
    if num_rows == 0:
        return
    bx, bg, bs = _views(buf_NW, x_TH.dtype)
    x_TH, weights = x_TH.contiguous(), weights_TK.contiguous()
    _pack_kernel[(num_rows,)](
        x_TH,
        token_P.contiguous(),
        weights,
        entry_PK.contiguous(),
        slot_PK.contiguous(),
        bx,
        bg,
        bs,
        num_k,
        x_TH.stride(0),
        bx.stride(0),
        bg.stride(0),
        gate_byte // 4,
        slot_byte // 4,
        H=x_TH.shape[1],
        BLOCK_H=_block_h(x_TH.shape[1]),
        K_POW2=triton.next_power_of_2(num_k),
    )


def unpack_rows(
    buf_NW: torch.Tensor,
    num_rows: int,
    hidden: int,
    num_k: int,
    dtype: torch.dtype,
    gates_dtype: torch.dtype,
    counts_D: torch.Tensor,
    stride: int,
    gate_byte: int,
    slot_byte: int,
    statuses_D: torch.Tensor | None = None,
):
    """(x [R, H], gates [R, K], slots [R, K] int64, a copy of `counts_D`, a copy of `statuses_D` or None)
    from the first R rows of `buf_NW`, regions of `stride` rows, row i valid while
    i % stride < counts_D[i // stride] (module docstring); the copies in the same launch (the
    counts and statuses are views of the transport's buffer, which the next all-to-all reuses)."""
    dev = buf_NW.device
    x = torch.empty((num_rows, hidden), dtype=dtype, device=dev)
    gates = torch.empty((num_rows, num_k), dtype=gates_dtype, device=dev)
    slots = torch.empty((num_rows, num_k), dtype=torch.int64, device=dev)
    if num_rows == 0:
        return x, gates, slots, counts_D.clone(), None if statuses_D is None else statuses_D.clone()
    counts_out, statuses_out = torch.empty_like(counts_D), None if statuses_D is None else torch.empty_like(statuses_D)
    bx, bg, bs = _views(buf_NW, dtype)
    D = counts_D.shape[0]
    _unpack_kernel[(num_rows,)](
        bx,
        bg,
        bs,
        counts_D,
        x,
        gates,
        slots,
        counts_out,
        counts_D if statuses_D is None else statuses_D,
        counts_out if statuses_out is None else statuses_out,
        num_k,
        stride,
        bx.stride(0),
        bg.stride(0),
        gate_byte // 4,
        slot_byte // 4,
        D,
        H=hidden,
        BLOCK_H=_block_h(hidden),
        K_POW2=triton.next_power_of_2(num_k),
        D_POW2=triton.next_power_of_2(D),
        HAS_STATUS=statuses_D is not None,
    )
    return x, gates, slots, counts_out, statuses_out
