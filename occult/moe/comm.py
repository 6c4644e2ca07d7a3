"""The all-to-all of one exchange: rows out and back, with their metadata, and what it cost.

`all_to_all(x, send_splits, recv_splits, group)` is the primitive (rows per destination out,
rows per source in; a copy on one rank). `exchange` sends a plan's rows, optionally with each
row's gate weights and local expert slots, as one autograd node (`_Exchange`): its backward
sends the gradients of rows and gates along the same splits reversed, so every rank issues its
backward collectives in the same order. A row's gates and slots travel in the same all-to-all as
the row (`pack_rows`: one byte row each, the activation then `pack_metadata`'s bytes), and so do the
backward's gate gradients: one collective per exchange, not two (on a slow link each costs a round trip).
`CommStats` counts the rows and bytes each rank sends, forward and backward, activations and
metadata apart (the byte convention of docs/design.md).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from occult.moe.host_wire import HostWire
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
    rank: a copy; a `HostWire` (a dispatcher's `link` under transport="host"): through its shared host memory.
    Not differentiable (the dispatchers wrap it in one autograd node per exchange)."""
    if isinstance(group, HostWire):  # traced: one opaque operator in the graph, the wire called at run time
        if torch.compiler.is_compiling():
            return group.traced_all_to_all(x, send_splits, recv_splits)
        return group.all_to_all(x, send_splits, recv_splits)
    if group is not None and torch.compiler.is_compiling():  # traced: the functional collective, which returns
        # its result (the in-place one's was lost in a compiled backward on NCCL: docs/training.md, "GPU truth")
        return funcol.wait_tensor(funcol.all_to_all_single(x.contiguous(), recv_splits, send_splits, group))
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


_ALIGN = 16  # bytes: every part of a packed row starts 16-byte aligned (vector loads of the rows' view)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def as_bytes(t_PX: torch.Tensor) -> torch.Tensor:
    """[P, X] -> its rows' bytes [P, X * itemsize] (uint8: every backend carries it, NCCL and gloo)."""
    if not t_PX.is_contiguous() or t_PX.stride(-1) != 1:  # (a size-1 dim may keep stride 0: an expanded grad)
        t_PX = t_PX.new_empty(t_PX.shape).copy_(t_PX)
    return t_PX.view(torch.uint8).view(t_PX.shape[0], t_PX.shape[1] * t_PX.element_size())


def metadata_width(gates_dtype: torch.dtype, top_k: int) -> int:
    """Bytes of one row's packed metadata: K gates in their own dtype, K int32 slots, padded."""
    return _aligned(top_k * (torch.finfo(gates_dtype).bits // 8 + 4))


def pack_metadata(gates_PK: torch.Tensor, slots_PK: torch.Tensor) -> torch.Tensor:
    """[P, metadata_width] bytes: the gates' own bits, then the slots as int32 (bit-exact)."""
    parts = [as_bytes(gates_PK), as_bytes(slots_PK.to(torch.int32))]
    return _padded(torch.cat(parts, dim=1), metadata_width(gates_PK.dtype, gates_PK.shape[1]))


def metadata_bytes(gates_PK: torch.Tensor) -> int:
    """Bytes `pack_metadata` sends for these gates (and as many slots)."""
    return gates_PK.shape[0] * metadata_width(gates_PK.dtype, gates_PK.shape[1])


def unpack_metadata(meta_RW: torch.Tensor, gates_dtype: torch.dtype, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `pack_metadata` on received rows: (gates [R, K] in `gates_dtype`, slots [R, K] int64)."""
    g = top_k * torch.finfo(gates_dtype).bits // 8
    gates_RK = meta_RW[:, :g].contiguous().view(gates_dtype)
    return gates_RK, meta_RW[:, g : g + 4 * top_k].contiguous().view(torch.int32).to(torch.int64)


def _padded(bytes_PB: torch.Tensor, width: int) -> torch.Tensor:
    pad = width - bytes_PB.shape[1]
    return bytes_PB if pad == 0 else torch.cat([bytes_PB, bytes_PB.new_zeros((bytes_PB.shape[0], pad))], dim=1)


def pack_rows(rows_PH: torch.Tensor, tail_PW: torch.Tensor) -> torch.Tensor:
    """One byte row per row: its activation (padded to 16 bytes), then `tail_PW` (16-byte multiple)."""
    row_bytes = as_bytes(rows_PH)
    return torch.cat([_padded(row_bytes, _aligned(row_bytes.shape[1])), tail_PW], dim=1)


def unpack_rows(out_RB: torch.Tensor, like_PH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `pack_rows`: (the activations [R, H], a strided view of `out_RB`; the tail bytes)."""
    hidden = like_PH.shape[1]
    start = _aligned(hidden * like_PH.element_size())
    rows_RH = out_RB[:, : hidden * like_PH.element_size()].view(like_PH.dtype)
    return rows_RH, out_RB[:, start:]


def send_with_metadata(rows_PH, gates_PK, slots_PK, send_splits, recv_splits, group, packed=None):
    """Rows, gates and slots in one all-to-all (one byte row each): (rows, gates in their dtype, slots int64).
    `packed`: `pack_metadata(gates_PK, slots_PK)` made earlier (before the host sync)."""
    meta_PW = pack_metadata(gates_PK, slots_PK) if packed is None else packed
    out_RB = all_to_all(pack_rows(rows_PH, meta_PW), send_splits, recv_splits, group)
    out_rows, meta_RW = unpack_rows(out_RB, rows_PH)
    return (out_rows, *unpack_metadata(meta_RW, gates_PK.dtype, gates_PK.shape[1]))


def gate_grad_bytes(grad_gates_RK: torch.Tensor) -> int:
    """Bytes `send_with_gates` sends for these gate gradients (padded like every part of a byte row)."""
    return grad_gates_RK.shape[0] * _aligned(grad_gates_RK.shape[1] * grad_gates_RK.element_size())


def send_with_gates(grad_rows_RH, grad_gates_RK, send_splits, recv_splits, group):
    """The backward's rows and gate gradients in one all-to-all: (rows [P, H], gates [P, K])."""
    gate_bytes = as_bytes(grad_gates_RK)
    tail = _padded(gate_bytes, _aligned(gate_bytes.shape[1]))
    out_PB = all_to_all(pack_rows(grad_rows_RH, tail), send_splits, recv_splits, group)
    back_rows, tail_PW = unpack_rows(out_PB, grad_rows_RH)
    return back_rows, tail_PW[:, : gate_bytes.shape[1]].contiguous().view(grad_gates_RK.dtype)


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
        if gates is None:
            return all_to_all(rows, send_splits, recv_splits, group), None, None
        out_rows, out_gates, out_slots = send_with_metadata(rows, gates, slots, send_splits, recv_splits, group, packed)
        ctx.mark_non_differentiable(out_slots)
        return out_rows, out_gates, out_slots

    @staticmethod
    def backward(ctx, grad_rows, grad_gates, _grad_slots):
        if ctx.state is not None:  # (None: booked with the forward, `exchange` under torch.compile)
            meta_bytes = gate_grad_bytes(grad_gates) if ctx.has_gates else 0
            record_sent(ctx.state, ctx.recv_splits, grad_rows, meta_bytes, backward=True)
        if ctx.has_gates:
            back_rows, back_gates = send_with_gates(grad_rows, grad_gates, ctx.recv_splits, ctx.send_splits, ctx.group)
        else:
            back_rows, back_gates = all_to_all(grad_rows, ctx.recv_splits, ctx.send_splits, ctx.group), None
        backward_exchange_issued()  # combined 1F1B: the paired forward runs while these are on the wire
        return back_rows, back_gates, None, None, None, None, None, None


def exchange(rows, gates, slots, send_splits, recv_splits, group, state, packed=None):
    """Send rows (with gates and slots, when given); record what was sent in `state.stats`.

    `packed`: `pack_metadata(gates, slots)` made earlier (the dispatcher queues it before the
    host waits for the counts, so it is not launched after the wait).

    Differentiable (one `_Exchange` node) when rows or gates need gradients; returns
    (rows, gates, slots) as received, gates and slots None when not given. Traced by torch.compile
    (a sync-free layer: its splits follow from shapes), the backward's rows are booked with the forward: a
    compiled backward cannot change Python state.
    """
    meta_bytes = 0 if gates is None else metadata_bytes(gates)
    record_sent(state, send_splits, rows, meta_bytes, backward=False)
    differentiable = torch.is_grad_enabled() and (rows.requires_grad or (gates is not None and gates.requires_grad))
    if differentiable:  # (inside a two-batch step, chained to the other exchanges: occult.moe.two_batch)
        if torch.compiler.is_compiling():
            book_backward(state, recv_splits, rows, gates)
            state = None
        rows, gates = chain_inputs(rows, gates)
        return chain_outputs(*_Exchange.apply(rows, gates, slots, send_splits, recv_splits, group, state, packed))
    if gates is None:
        return all_to_all(rows, send_splits, recv_splits, group), None, None
    return send_with_metadata(rows, gates, slots, send_splits, recv_splits, group, packed)


def book_backward(state: Any, recv_splits: list[int], rows: torch.Tensor, gates: torch.Tensor | None) -> None:
    """Record now what this exchange's backward will send (`_Exchange.backward`: the received rows' gradients, and
    the gates' where the rows came with gates, back along `recv_splits`), for a traced exchange."""
    received = sum(recv_splits)
    meta_bytes = 0 if gates is None else received * _aligned(gates.shape[1] * gates.element_size())
    record_sent(state, recv_splits, rows, meta_bytes, backward=True)


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
