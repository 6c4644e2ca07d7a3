"""Dispatch and combine over the device transport (`occult.moe.symm`): a layer call with no host wait.

The same plans as the count-exchange path (`occult.moe.dispatch`), kept at their capacity size
with their row counts on the device. One call:

  1. `agree`: the largest token count of any rank, and every rank's input status known on the host
     (wrong hidden size or dtype; and routing statuses of earlier calls the GPU has reached), over
     a host-only exchange (`occult.moe.agree`): bad input raises `RoutingError` on every rank at once;
  2. this call's routing status (ids out of range, NaN/inf gates) travels with the dispatch's rows
     to every rank (`occult.kernels.push`) and is queued there (`occult.moe.status`): raised on every
     rank by a later call or `check_routing()`;
  3. rows, their gate weights and local expert slots written side by side into one byte row
     (`RowLayout`), in plan order, and stored into the peers' receive regions by one all-to-all
     (`DeviceTransport.exchange`); received rows past their region's count are masked
     (slot -1, gate 0), so the experts skip them;
  4. combine: one row back per received row, by a second all-to-all, into regions at the source,
     read back in plan order (`region_index`); each token's rows summed.

Under CUDA-graph capture a call runs the same kernels; the host-side agreement runs at capture
time only (the captured shapes fix the bound; a caller that replays per call agrees itself and
passes `Schedule.agreed_tokens`, as `occult.moe.graphs` does), and routing statuses are queued only
where the capture records them (`occult.moe.status.recording`), else dropped.

Backward mirrors both all-to-alls with the same device counts. `CommStats` are filled from the
device counts when first read (`DeviceCommStats`): reading them is a host sync, at the reader's choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from occult import settings
from occult.moe import status as pending
from occult.moe.byte_rows import RowLayout, as_byte_rows, region_index, region_valid
from occult.moe.comm import CommStats, DeviceCommStats
from occult.moe.contract import Handle, Received
from occult.moe.counts import raise_on_bad_status
from occult.moe.gather import gather_gate_weights, gather_rows, scatter_gates, token_sum, triton_sums
from occult.moe.plan import DispatchPlan
from occult.moe.symm import DeviceTransport, token_bucket


@dataclass
class PackedRows:
    """A dispatch's send rows before they exist: plan row p is token `token_P[p]`'s activation, its
    gates (`weights_TK.flat[entry_PK[p]]`) and local slots, in `RowLayout` rows of `width` bytes
    (gates at byte `gate_byte`, slots at `slot_byte`); the transport gathers them straight into the
    peers' regions (`DeviceTransport.exchange_packed`), or `staged()` writes them out here."""

    x_TH: torch.Tensor
    token_P: torch.Tensor
    weights_TK: torch.Tensor
    entry_PK: torch.Tensor
    slot_PK: torch.Tensor
    gate_byte: int
    slot_byte: int
    width: int

    def staged(self) -> torch.Tensor:
        """The rows written into a local byte buffer [P, width] (`occult.kernels.pack.pack_rows`)."""
        from occult.kernels.pack import pack_rows

        buf = torch.empty((self.entry_PK.shape[0], self.width), dtype=torch.uint8, device=self.x_TH.device)
        pack_rows(
            buf, self.x_TH, self.token_P, self.weights_TK, self.entry_PK, self.slot_PK, self.gate_byte, self.slot_byte
        )
        return buf


@dataclass
class DeviceHandle(Handle):
    """One call's state: the plan, the device counts each way, the layout and the transport.

    Rows go out packed by destination (the plan's order) and arrive in regions of `stride` rows, one
    per source rank; rows coming back land in the same kind of regions at their source, which finds
    them through `region_index`."""

    transport: DeviceTransport
    layout: RowLayout
    plan: DispatchPlan
    send_counts_D: torch.Tensor
    stride: int  # rows one source can send to one rank, at most (the regions' size)
    stats: CommStats = field(default_factory=CommStats)
    recv_counts_D: torch.Tensor | None = None
    status: torch.Tensor | None = None  # this call's routing status (device scalar), sent with the rows

    @property
    def num_recv(self) -> int:
        """Rows of the received buffer handed to the experts (every region; the gaps masked)."""
        return self.transport.num_ranks * self.stride

    def byte_rows(self, num_rows: int, width: int, write) -> torch.Tensor:
        """Staging rows [num_rows, width] filled by `write(rows)`."""
        rows = torch.empty((num_rows, width), dtype=torch.uint8, device=self.send_counts_D.device)
        write(rows)
        return rows

    def send_out(self, rows_PW: torch.Tensor) -> torch.Tensor:
        """Rows in plan order to their ranks; the received regions. The first call (the dispatch)
        carries the routing status and queues every rank's."""
        first = self.recv_counts_D is None
        recv, recv_counts_D, statuses_D = self.transport.exchange(
            rows_PW, self.send_counts_D, self.stride, status=self.status if first else None
        )
        if first:
            self.recv_counts_D = recv_counts_D
            if statuses_D is not None:
                pending.queue(statuses_D)  # (kept by a recording capture: occult.moe.graphs)
        return recv

    def send_back(self, rows_RW: torch.Tensor) -> torch.Tensor:
        """Received rows (region layout) back to their sources; the regions there (read them at once)."""
        recv, _, _ = self.transport.exchange(
            rows_RW, self.recv_counts_D, self.stride, src_stride=self.stride, copy_counts=False
        )
        return recv

    def in_plan_order(self, back_RW: torch.Tensor) -> torch.Tensor:
        """Rows come back in regions, read in plan order [P, W] (a copy)."""
        rows_P = torch.arange(self.plan.num_rows, device=back_RW.device)
        return back_RW.index_select(0, region_index(rows_P, self.send_counts_D, self.stride).clamp_(min=0))

    def dispatch_packed(self, x_TH: torch.Tensor, weights_TK: torch.Tensor):
        """`dispatch_rows` from the tokens themselves, in two kernels (`occult.kernels.pack`): the
        rows, gates and slots gathered straight into the peers' receive regions, the received ones
        unpacked and masked in one pass (which also copies out the counts and statuses)."""
        from occult.kernels.pack import unpack_rows

        L, plan = self.layout, self.plan
        g0, s0 = L.x_bytes, L.x_bytes + L.gate_bytes
        rows = PackedRows(x_TH, plan.token_P, weights_TK, plan.entry_PK, plan.slot_PK, g0, s0, L.width)
        recv, counts_D, statuses_D = self.transport.exchange_packed(
            rows, self.send_counts_D, self.stride, self.status, copy_counts=False
        )
        x_RH, gates_RK, slots_RK, self.recv_counts_D, statuses_D = unpack_rows(
            recv, self.num_recv, L.hidden, L.top_k, L.dtype, L.gates_dtype, counts_D, self.stride, g0, s0, statuses_D
        )
        if statuses_D is not None:
            pending.queue(statuses_D)  # (kept by a recording capture: occult.moe.graphs)
        self.stats.add(
            self.send_counts_D, L.hidden * x_TH.element_size(), L.gate_bytes + 4 * L.top_k, False, "dispatch"
        )
        return x_RH, gates_RK, slots_RK

    def dispatch_rows(self, rows_PH, gates_PK, slots_PK):
        """Rows out with gates and slots; (x_RH, gates_RK, slots_RK) received, the gaps masked."""
        L = self.layout
        recv = self.send_out(
            self.byte_rows(
                self.plan.num_rows,
                L.width,
                lambda buf: L.write(buf, rows_PH, gates_PK.to(L.carrier), slots_PK.to(torch.int32)),
            )
        )
        valid_R1 = region_valid(self.num_recv, self.stride, self.recv_counts_D)
        x_RH = torch.where(valid_R1, L.read_x(recv, self.num_recv), 0)
        gates_RK = torch.where(valid_R1, L.read_gates(recv, self.num_recv), 0)
        slots_RK = torch.where(valid_R1, L.read_slots(recv, self.num_recv), -1)
        self.stats.add(
            self.send_counts_D, x_RH.shape[1] * x_RH.element_size(), L.gate_bytes + 4 * L.top_k, False, "dispatch"
        )
        return x_RH, gates_RK, slots_RK

    def dispatch_grads(self, grad_x_RH, grad_gates_RK):
        """The gradients of the received rows and gates back to their sources (plan order)."""
        L, n = self.layout, self.plan.num_rows
        back = self.send_back(
            self.byte_rows(self.num_recv, L.width, lambda buf: L.write(buf, grad_x_RH, grad_gates_RK.to(L.carrier)))
        )
        back = self.in_plan_order(back)
        self.stats.add(self.recv_counts_D, grad_x_RH.shape[1] * grad_x_RH.element_size(), L.gate_bytes, True)
        return L.read_x(back, n), L.read_gates(back, n)

    def combine_sum(self, y_RH: torch.Tensor) -> torch.Tensor:
        """Each received row's result back to its source, and each token's rows summed there: y_TH."""
        L, plan = self.layout, self.plan
        rows_RW = as_byte_rows(y_RH, L.back_width)
        if rows_RW is None:
            rows_RW = self.byte_rows(self.num_recv, L.back_width, lambda buf: L.write(buf, y_RH))
        back = self.send_back(rows_RW)
        self.stats.add(self.recv_counts_D, y_RH.shape[1] * y_RH.element_size(), 0, False, "combine")
        if triton_sums(y_RH):
            from occult.kernels.rows import gather_sum  # one pass over the regions, fp32 sums

            return gather_sum(
                back.view(L.dtype)[:, : L.hidden], plan.row_TJ, L.dtype, regions=(self.send_counts_D, self.stride)
            )
        y_PH = self.in_plan_order(back).view(L.dtype)[:, : L.hidden]
        return token_sum(y_PH, plan.token_P, plan.row_TJ, L.dtype)

    def combine_grads(self, grad_y_PH: torch.Tensor) -> torch.Tensor:
        """The combine's gradient: each plan row's gradient out to its rank again [num_recv, H], gaps zero."""
        settle_step(self.transport)  # a backward's first all-to-all: every rank finished the forward's calls
        L = self.layout
        rows_PW = as_byte_rows(grad_y_PH, L.back_width)
        if rows_PW is None:
            rows_PW = self.byte_rows(self.plan.num_rows, L.back_width, lambda buf: L.write(buf, grad_y_PH))
        recv = self.send_out(rows_PW)
        self.stats.add(self.send_counts_D, grad_y_PH.shape[1] * grad_y_PH.element_size(), 0, True)
        grad_RH = recv.view(L.dtype)[:, : L.hidden]
        return torch.where(region_valid(self.num_recv, self.stride, self.recv_counts_D), grad_RH, 0)


class _DeviceDispatch(torch.autograd.Function):
    """Rows, gates and slots out by the device transport; backward sends the row and gate gradients back."""

    @staticmethod
    def forward(ctx, rows_PH, gates_PK, slots_PK, handle):
        ctx.handle = handle
        x_RH, gates_RK, slots_RK = handle.dispatch_rows(rows_PH, gates_PK, slots_PK)
        ctx.mark_non_differentiable(slots_RK)
        return x_RH, gates_RK, slots_RK

    @staticmethod
    def backward(ctx, grad_x_RH, grad_gates_RK, _grad_slots):
        grad_rows_PH, grad_gates_PK = _dispatch_grads(ctx.handle, grad_x_RH, grad_gates_RK)
        return grad_rows_PH, grad_gates_PK, None, None


def _dispatch_grads(handle: DeviceHandle, grad_x_RH, grad_gates_RK) -> tuple[torch.Tensor, torch.Tensor]:
    """The received rows' and gates' gradients back to their sources (zeros where autograd gave none)."""
    if grad_x_RH is None:
        grad_x_RH = torch.zeros(
            (handle.num_recv, handle.layout.hidden), dtype=handle.layout.dtype, device=handle.send_counts_D.device
        )
    if grad_gates_RK is None:
        grad_gates_RK = grad_x_RH.new_zeros((grad_x_RH.shape[0], handle.layout.top_k), dtype=torch.float32)
    return handle.dispatch_grads(grad_x_RH, grad_gates_RK)


class _DevicePackedDispatch(torch.autograd.Function):
    """`_DeviceDispatch` fused with the row and gate gathers (GPU kernels); backward sums each
    token's row gradients and scatters the gate gradients back to the top-k entries."""

    @staticmethod
    def forward(ctx, x_TH, weights_TK, handle):
        ctx.handle, ctx.weights_shape = handle, weights_TK.shape
        x_RH, gates_RK, slots_RK = handle.dispatch_packed(x_TH, weights_TK)
        ctx.mark_non_differentiable(slots_RK)
        return x_RH, gates_RK, slots_RK

    @staticmethod
    def backward(ctx, grad_x_RH, grad_gates_RK, _grad_slots):
        grad_rows_PH, grad_gates_PK = _dispatch_grads(ctx.handle, grad_x_RH, grad_gates_RK)
        plan = ctx.handle.plan
        grad_x_TH = token_sum(grad_rows_PH, plan.token_P, plan.row_TJ, grad_rows_PH.dtype)
        return grad_x_TH, scatter_gates(grad_gates_PK, plan.entry_PK, torch.Size(ctx.weights_shape)), None


class _DeviceCombine(torch.autograd.Function):
    """One row back per received row, each token's rows summed at its source; backward hands each
    plan row its token's gradient and sends it out again."""

    @staticmethod
    def forward(ctx, y_RH, handle):
        ctx.handle = handle
        return handle.combine_sum(y_RH)

    @staticmethod
    def backward(ctx, grad_y_TH):
        handle = ctx.handle
        grad_PH = grad_y_TH[handle.plan.token_P]  # (unused plan rows take any token's: they are not sent)
        return handle.combine_grads(grad_PH.contiguous()), None


def agree_and_check(transport: DeviceTransport, num_tokens: int, host_status: int) -> int:
    """The largest token count of any rank; raises `RoutingError` on every rank when any rank
    reports bad input (now, or a routing status of an earlier call the GPU has reached).

    Inside a step's agreement (`occult.moe.step`) nothing waits for this call: the bound is the
    step's, this call's statuses are posted for the next call to read, and the previous call's are
    read (and raised on every rank) here, one call late. A rank whose own input is bad still takes
    part in this call's all-to-alls, with no rows, and raises after them (`OccultMoE`), so no rank
    is left inside an all-to-all that a peer never enters.

    Under CUDA-graph capture the queue is not read (that would query events on a capturing
    stream): the earlier calls' statuses wait for the next eager call or `check_routing()`."""
    statuses = [0] * transport.num_ranks if pending.capturing() else pending.take_ready(transport.num_ranks)
    statuses[transport.rank] = max(statuses[transport.rank], host_status)
    if transport.step_tokens is not None:
        if num_tokens > transport.step_tokens:
            raise ValueError(
                f"a call of {num_tokens} tokens inside a step whose agreement allows {transport.step_tokens}: "
                "pass agreed_step the largest token count of any call in the step"
            )
        settle_step(transport)
        transport.post(num_tokens, statuses)
        return transport.step_tokens
    max_tokens, statuses = transport.agree(num_tokens, statuses)
    if any(statuses):
        pending.clear()
        raise_on_bad_status(statuses)
    return max_tokens


def settle_step(transport: DeviceTransport) -> None:
    """Inside a step's agreement: read the last posted call's statuses (waiting for every rank to
    post them) and raise `RoutingError` on every rank if one is bad. A backward's first all-to-all
    and the step's end call it too, so a rank never starts an all-to-all after a call a peer failed."""
    if transport.step_tokens is None:
        return  # outside a step every call read its own round
    statuses = transport.posted()
    if statuses is not None and any(statuses):
        pending.clear()
        raise_on_bad_status(statuses)


def step_bound(transport: DeviceTransport | None) -> int | None:
    """The token bound of the step `transport` is agreeing on now (`occult.moe.step`), else None."""
    return None if transport is None else transport.step_tokens


def reserve(transport: DeviceTransport, num_bytes: int) -> None:
    """`transport.reserve`; a growth is a blocking round of the ranks' board, so inside a step the
    posted call's statuses are read (and raised) first instead of being passed over."""
    if not transport.fits(num_bytes):
        settle_step(transport)
        transport.reserve(num_bytes)


def dispatch_device(
    dispatcher: Any,
    x_TH: torch.Tensor,
    weights_TK: torch.Tensor,
    plan: DispatchPlan,
    status: torch.Tensor,
    host_status: int,
    schedule: Any,
    experts_per_device: int,
) -> tuple[Received, DeviceHandle]:
    """The flat dispatch over the device transport (module docstring); `plan` at capacity size."""
    transport: DeviceTransport = dispatcher.transport
    D, top_k = transport.num_ranks, weights_TK.shape[1]
    max_tokens = schedule.agreed_tokens
    if max_tokens is None:
        max_tokens = agree_and_check(transport, x_TH.shape[0], host_status)
    schedule.run_while_waiting()
    per_rank, _ = dispatcher.rows_per_token(top_k, D, experts_per_device)
    layout = RowLayout(x_TH.shape[1], x_TH.dtype, plan.slot_PK.shape[1], weights_TK.dtype)
    bucket = token_bucket(max_tokens)
    reserve(transport, D * per_rank * bucket * layout.width)
    stats = DeviceCommStats(dispatcher.rank, dispatcher.peer_level)
    handle = DeviceHandle(
        transport,
        layout,
        plan,
        plan.send_counts_D,
        per_rank * max_tokens,
        stats,
        status=status.to(torch.int64).reshape(()),
    )
    if packable(x_TH, weights_TK):
        x_RH, gates_RK, slots_RK = _DevicePackedDispatch.apply(x_TH, weights_TK, handle)
    else:
        rows_PH = gather_rows(x_TH, plan.token_P, plan.row_TJ)
        gates_PK = gather_gate_weights(weights_TK, plan.entry_PK)
        x_RH, gates_RK, slots_RK = _DeviceDispatch.apply(rows_PH, gates_PK, plan.slot_PK, handle)
    return Received(x_RH, slots_RK, gates_RK), handle


def packable(x_TH: torch.Tensor, weights_TK: torch.Tensor) -> bool:
    """Whether the pack/unpack kernels serve these tensors (CUDA, or Triton's interpreter; fp32 gates carrier)."""
    if x_TH.dtype not in (torch.bfloat16, torch.float16, torch.float32) or weights_TK.dtype == torch.float64:
        return False
    from occult import kernels

    return kernels.available(x_TH.device) and (x_TH.is_cuda or settings.current().triton_interpret)


def combine_device(y_RH: torch.Tensor, handle: DeviceHandle) -> torch.Tensor:
    """Each received row's result back to its source; y_TH with each token's rows summed."""
    return _DeviceCombine.apply(y_RH, handle)
