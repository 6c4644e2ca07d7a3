"""The all-to-all of one exchange: rows out and back, with their metadata, and what it cost.

`all_to_all(x, send_splits, recv_splits, group)` is the primitive (rows per destination out,
rows per source in; a copy on one rank). `exchange` sends a plan's rows, optionally with each
row's gate weights and local expert slots, as one autograd node (`_Exchange`): its backward
sends the gradients of rows and gates along the same splits reversed, so every rank issues its
backward collectives in the same order. Gates and slots travel packed in one integer tensor
(`pack_metadata`: NCCL has no 16-bit integers, so half-precision gates go as float32 bits).
`CommStats` counts the rows and bytes each rank sends, forward and backward, activations and
metadata apart (the byte convention of docs/design.md).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist

from occult.moe.two_batch import backward_exchange_issued, chain_inputs, chain_outputs


@dataclass
class CommStats:
    """Rows and bytes this rank sent in the last call (activations; metadata apart).

    `rows` count every row sent, including those a rank sends to itself; `remote_rows` only
    those to other ranks. Forward = dispatch + combine; backward = their mirror images.
    Where the dispatcher knows the node layout (`devices_per_node`), the remote rows are also
    split by link: `*_internode_*` to a rank on another node, `*_intranode_*` to another GPU
    of the same node (activation rows and their bytes; 0 when the layout is unknown).
    """

    forward_rows: int = 0
    forward_remote_rows: int = 0
    forward_bytes: int = 0
    forward_metadata_bytes: int = 0
    backward_rows: int = 0
    backward_remote_rows: int = 0
    backward_bytes: int = 0
    backward_metadata_bytes: int = 0
    dispatch_rows: int = 0
    combine_rows: int = 0
    forward_internode_rows: int = 0
    forward_internode_bytes: int = 0
    forward_intranode_rows: int = 0
    forward_intranode_bytes: int = 0
    backward_internode_rows: int = 0
    backward_internode_bytes: int = 0
    backward_intranode_rows: int = 0
    backward_intranode_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)

    def snapshot(self) -> CommStats:
        """A copy of these figures as they stand, apart from later changes to the tensors behind them
        (a CUDA graph's replays rewrite the device counts its captured call read): a shallow copy, its fields
        plain numbers (`copy.copy`, not `dataclasses.replace`: this runs at every replay)."""
        return copy.copy(self)


def all_to_all(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    """Rows of `x` [P, ...] out along `send_splits` (rows per destination rank), rows in along
    `recv_splits`: the received [sum(recv_splits), ...] in source-rank order. `group=None` is one
    rank: a copy. Not differentiable (the dispatchers wrap it in one autograd node per exchange)."""
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    if group is None:
        out.copy_(x)
    else:
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
    return out


def record_sent(state: Any, splits: list[int], rows_PH: torch.Tensor, meta_bytes: int, backward: bool) -> None:
    """Account the rows and bytes this rank sends (activation rows, and metadata apart).

    `state` is anything with `.stats` (a `CommStats`) and `.rank` (this rank in the group),
    e.g. a dispatcher's `Handle`; with a `.peer_level` list (per rank of the group:
    0 self, 1 same node, 2 another node) the remote rows are also counted per link.
    """
    one_row = rows_PH[0].numel() * rows_PH.element_size() if rows_PH.shape[0] else 0
    count_sent(state.stats, splits, state.rank, getattr(state, "peer_level", None), one_row, meta_bytes, backward)


def count_sent(
    stats: CommStats,
    splits: list[int],
    rank: int,
    levels: list[int] | None,
    row_bytes: int,
    meta_bytes: int,
    backward: bool,
) -> None:
    """Add `splits[d]` rows of `row_bytes` each sent to rank d (and `meta_bytes` of metadata) to `stats`."""
    rows = sum(splits)
    direction = "backward" if backward else "forward"
    if levels is not None:
        for level, name in ((1, "intranode"), (2, "internode")):
            count = sum(n for n, lv in zip(splits, levels) if lv == level)
            setattr(stats, f"{direction}_{name}_rows", getattr(stats, f"{direction}_{name}_rows") + count)
            setattr(stats, f"{direction}_{name}_bytes", getattr(stats, f"{direction}_{name}_bytes") + count * row_bytes)
    for name, value in (
        ("rows", rows),
        ("remote_rows", rows - splits[rank]),
        ("bytes", rows * row_bytes),
        ("metadata_bytes", meta_bytes),
    ):
        setattr(stats, f"{direction}_{name}", getattr(stats, f"{direction}_{name}") + value)


def _metadata_int(gates_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """(carrier float dtype, int dtype of its size) for packing gates beside slots.

    NCCL has no 16-bit integer type, so half-precision gates travel as float32 (exact: every
    bf16/fp16 value is a float32) bit-cast to int32; float32 and float64 gates are bit-cast to
    ints of their own size. Every backend (NCCL, gloo) carries int32 and int64.
    """
    if gates_dtype == torch.float64:
        return torch.float64, torch.int64
    return torch.float32, torch.int32


def pack_metadata(gates_PK: torch.Tensor, slots_PK: torch.Tensor) -> torch.Tensor:
    """[P, 2K] ints: the gates' bits (as float32 or float64), then the slots."""
    carrier, as_int = _metadata_int(gates_PK.dtype)
    return torch.cat([gates_PK.to(carrier).contiguous().view(as_int), slots_PK.to(as_int)], dim=1)


def metadata_bytes(gates_PK: torch.Tensor) -> int:
    """Bytes `pack_metadata` sends for these gates (and as many slots)."""
    carrier, _ = _metadata_int(gates_PK.dtype)
    return 2 * gates_PK.numel() * torch.finfo(carrier).bits // 8


def unpack_metadata(meta_R2K: torch.Tensor, gates_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `pack_metadata` on received rows: (gates [R, K] in `gates_dtype`, slots [R, K] int64)."""
    carrier, _ = _metadata_int(gates_dtype)
    num_k = meta_R2K.shape[1] // 2
    gates_RK = meta_R2K[:, :num_k].contiguous().view(carrier).to(gates_dtype)
    return gates_RK, meta_R2K[:, num_k:].to(torch.int64)


def send_metadata(gates_PK, slots_PK, send_splits, recv_splits, group, packed=None):
    """Gates and slots in one all-to-all; gates come back in their own dtype, bit-exact.
    `packed`: `pack_metadata(gates_PK, slots_PK)` made earlier (before the host sync)."""
    out = all_to_all(pack_metadata(gates_PK, slots_PK) if packed is None else packed, send_splits, recv_splits, group)
    return unpack_metadata(out, gates_PK.dtype)


class _Exchange(torch.autograd.Function):
    """All-to-all of rows plus optional per-row gates and slots, in one autograd node.

    Forward sends `rows` (and the metadata) along `send_splits`; backward returns the gradients
    of rows and gates along the same splits reversed. One node per exchange keeps the order of
    collectives in backward identical on every rank.
    """

    @staticmethod
    def forward(ctx, rows, gates, slots, send_splits, recv_splits, group, state, packed=None):
        ctx.send_splits, ctx.recv_splits, ctx.group, ctx.state = send_splits, recv_splits, group, state
        ctx.has_gates = gates is not None
        out_rows = all_to_all(rows, send_splits, recv_splits, group)
        if gates is None:
            return out_rows, None, None
        out_gates, out_slots = send_metadata(gates, slots, send_splits, recv_splits, group, packed)
        ctx.mark_non_differentiable(out_slots)
        return out_rows, out_gates, out_slots

    @staticmethod
    def backward(ctx, grad_rows, grad_gates, _grad_slots):
        meta_bytes = grad_gates.numel() * grad_gates.element_size() if ctx.has_gates else 0
        record_sent(ctx.state, ctx.recv_splits, grad_rows, meta_bytes, backward=True)
        back_rows = all_to_all(grad_rows, ctx.recv_splits, ctx.send_splits, ctx.group)
        back_gates = all_to_all(grad_gates, ctx.recv_splits, ctx.send_splits, ctx.group) if ctx.has_gates else None
        backward_exchange_issued()  # combined 1F1B: the paired forward runs while these are on the wire
        return back_rows, back_gates, None, None, None, None, None, None


def exchange(rows, gates, slots, send_splits, recv_splits, group, state, packed=None):
    """Send rows (with gates and slots, when given); record what was sent in `state.stats`.

    `packed`: `pack_metadata(gates, slots)` made earlier (the dispatcher queues it before the
    host waits for the counts, so it is not launched after the wait).

    Differentiable (one `_Exchange` node) when rows or gates need gradients; returns
    (rows, gates, slots) as received, gates and slots None when not given.
    """
    meta_bytes = 0 if gates is None else metadata_bytes(gates)
    record_sent(state, send_splits, rows, meta_bytes, backward=False)
    differentiable = torch.is_grad_enabled() and (rows.requires_grad or (gates is not None and gates.requires_grad))
    if differentiable:  # (inside a two-batch step, chained to the other exchanges: occult.moe.two_batch)
        rows, gates = chain_inputs(rows, gates)
        return chain_outputs(*_Exchange.apply(rows, gates, slots, send_splits, recv_splits, group, state, packed))
    out_rows = all_to_all(rows, send_splits, recv_splits, group)
    if gates is None:
        return out_rows, None, None
    return (out_rows, *send_metadata(gates, slots, send_splits, recv_splits, group, packed))


_FIELDS = tuple(f.name for f in fields(CommStats))


class DeviceCommStats(CommStats):
    """`CommStats` whose row counts are still on the device; filled (one host sync) at the first read."""

    def __init__(self, rank: int, levels: list[int] | None) -> None:
        super().__init__()
        object.__setattr__(self, "_pending", [])
        object.__setattr__(self, "_where", (rank, levels))

    def add(
        self, counts_D: torch.Tensor, row_bytes: int, meta_bytes_per_row: int, backward: bool, end: str | None = None
    ) -> None:
        """Count rows sent to each rank (`counts_D`, device) later; `end`: also set `dispatch_rows`
        ("dispatch") or `combine_rows` ("combine") to the total."""
        object.__getattribute__(self, "_pending").append((counts_D, row_bytes, meta_bytes_per_row, backward, end))

    def __getattribute__(self, name: str) -> Any:
        if name in _FIELDS and object.__getattribute__(self, "_pending"):
            object.__getattribute__(self, "_resolve")()
        return object.__getattribute__(self, name)

    def _resolve(self) -> None:
        rank, levels = object.__getattribute__(self, "_where")
        queued = object.__getattribute__(self, "_pending")
        object.__setattr__(self, "_pending", [])
        for counts_D, width, meta, backward, end in queued:
            splits = [int(v) for v in counts_D.tolist()]
            count_sent(self, splits, rank, levels, width, meta * sum(splits), backward)
            if end is not None:
                setattr(self, f"{end}_rows", sum(splits))

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in _FIELDS}

    def snapshot(self) -> DeviceCommStats:
        """The same figures, their device counts copied now (on the stream: no host wait)."""
        rank, levels = object.__getattribute__(self, "_where")
        copy = DeviceCommStats(rank, levels)
        for name in _FIELDS:
            object.__setattr__(copy, name, object.__getattribute__(self, name))
        copies: dict[int, torch.Tensor] = {}
        for counts_D, *rest in object.__getattribute__(self, "_pending"):
            cloned = copies.setdefault(id(counts_D), counts_D.clone())
            object.__getattribute__(copy, "_pending").append((cloned, *rest))
        return copy
