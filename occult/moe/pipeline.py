"""The pipelined schedule (`Schedule.chunks = C > 1`) of a flat dispatcher: the layer's tokens in
chunks, all-to-alls hidden behind experts.

`dispatch_chunks` is what `FlatDispatcher.dispatch` does under this schedule: the same plans
(`plan_rows` of each chunk), the same sums, the same rows and bytes in `CommStats`, but over C
chunks of the rank's tokens so that communication and compute of different chunks run at the
same time (`ChunkedReceived.apply(experts)` runs the pipeline; `combine` returns its output):

  forward   plans of all chunks; their row counts in ONE all-to-all and one host read (as
            unchunked); then, per chunk c: start dispatch(c+1), wait dispatch(c), experts(c),
            start combine(c); finally wait the combines and sum each token's rows.
  backward  the mirror image: start combine-backward(c+1), wait combine-backward(c), expert
            backward(c), start dispatch-backward(c); wait, sum.

On NCCL a started all-to-all (`occult.moe.comm.all_to_all_start`) runs on the communicator's
stream while the compute stream runs another chunk's experts; on gloo it runs on gloo's thread.
The whole pipeline is one autograd node with an explicit backward schedule, so every rank issues
its collectives in the same order (autograd's own order over independent chunks is not a
schedule one can rely on for overlap). Each chunk's experts are differentiated with
`torch.autograd.grad` on the subgraph recorded in forward.

Ranks must agree on C (a layer attribute); their token counts may differ, chunks may be empty.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from occult.moe.comm import CommStats, all_to_all_start, all_to_all_wait, metadata_bytes, pack_metadata, record_sent, unpack_metadata
from occult.moe.contract import ExpertFn, Handle, Schedule
from occult.moe.counts import exchange_counts
from occult.moe.expert_map import ExpertMap
from occult.moe.gather import gather_gates, scatter_gates, token_sum
from occult.moe.plan import DispatchPlan, trim


def chunk_bounds(num_tokens: int, num_chunks: int) -> list[tuple[int, int]]:
    """[lo, hi) token ranges of `num_chunks` nearly equal chunks (empty ones when T < C)."""
    if num_chunks < 1:
        raise ValueError(f"overlap needs at least 1 chunk, got {num_chunks}")
    edges = [num_tokens * c // num_chunks for c in range(num_chunks + 1)]
    return list(zip(edges[:-1], edges[1:]))


@dataclass
class Chunk:
    """One chunk's plan, splits and what its backward needs."""

    lo: int
    hi: int
    plan: DispatchPlan
    send: list[int]
    recv: list[int]
    x_RH: torch.Tensor | None = None  # received rows (a leaf when differentiated)
    gates_RK: torch.Tensor | None = None  # received gates (a leaf when differentiated)
    y_RH: torch.Tensor | None = None  # expert output with its subgraph


@dataclass
class ChunkedHandle(Handle):
    """The pipelined call's state, shared by its forward and backward (and `record_sent`'s target)."""

    chunks: list[Chunk]
    group: Any
    rank: int
    peer_level: list[int] | None
    stats: CommStats = field(default_factory=CommStats)
    differentiable: bool = False
    experts: Any = None  # the experts, with their weights as detached leaves when differentiated
    weights: tuple[torch.Tensor, ...] = ()

    def output(self, y_TH: torch.Tensor) -> torch.Tensor:
        """`combine` under this schedule: the pipeline already combined every chunk."""
        return y_TH


class ChunkedReceived:
    """The received side of a pipelined dispatch: `apply(experts)` runs the whole pipeline."""

    def __init__(self, x_TH: torch.Tensor, weights_TK: torch.Tensor, handle: ChunkedHandle) -> None:
        self.x_TH, self.weights_TK, self.handle = x_TH, weights_TK, handle

    def apply(self, experts: ExpertFn) -> torch.Tensor:
        """y_TH: dispatch, `experts` and combine of every chunk, overlapped. `experts` with
        `weights` and `with_weights` (`occult.moe.experts.LocalExperts`) are differentiated
        w.r.t. those weights too."""
        pipe, x_TH, weights_TK = self.handle, self.x_TH, self.weights_TK
        weights = tuple(getattr(experts, "weights", ()))
        pipe.differentiable = torch.is_grad_enabled() and any(t.requires_grad for t in (x_TH, weights_TK, *weights))
        if not pipe.differentiable:
            pipe.experts = experts
            return _forward(x_TH, weights_TK, pipe)
        pipe.weights = tuple(w.detach().requires_grad_() for w in weights)
        pipe.experts = experts.with_weights(*pipe.weights) if weights else experts
        return _PipelinedMoE.apply(x_TH, weights_TK, pipe, *weights)


def dispatch_chunks(dispatcher: Any, x_TH: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor,
                    expert_map: ExpertMap, schedule: Schedule, status: torch.Tensor) -> tuple[ChunkedReceived, ChunkedHandle]:
    """Plans of every chunk (`dispatcher.plan_rows`) and their counts in ONE exchange (one host
    wait, none when sync-free); the rows move when `apply` runs the pipeline."""
    bounds = chunk_bounds(x_TH.shape[0], schedule.chunks)
    plans = [dispatcher.plan_rows(ids_TK[lo:hi], expert_map, schedule.sync_free) for lo, hi in bounds]
    if schedule.sync_free:
        schedule.run_while_waiting()
        D = dispatcher.num_ranks
        sends = recvs = [[plan.num_rows // D] * D for plan in plans]
    else:
        sends, recvs = exchange_counts(torch.stack([p.send_counts_D for p in plans]), status, dispatcher.group,
                                       schedule.while_waiting)
        plans = [trim(plan, sum(send)) for plan, send in zip(plans, sends)]
    chunks = [Chunk(lo, hi, plan, send, recv) for (lo, hi), plan, send, recv in zip(bounds, plans, sends, recvs)]
    handle = ChunkedHandle(chunks, dispatcher.group, dispatcher.rank, dispatcher.peer_level, CommStats())
    return ChunkedReceived(x_TH, weights_TK, handle), handle


def _send_rows(x_TH: torch.Tensor, weights_TK: torch.Tensor, pipe: ChunkedHandle) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rows and packed metadata of every chunk, made first: a started exchange then waits for nothing but them."""
    outgoing = []
    for ch in pipe.chunks:
        rows_PH = x_TH[ch.lo : ch.hi][ch.plan.token_P]
        gates_PK = gather_gates(weights_TK[ch.lo : ch.hi], ch.plan.entry_PK)
        record_sent(pipe, ch.send, rows_PH, metadata_bytes(gates_PK), backward=False)
        pipe.stats.dispatch_rows += ch.plan.num_rows
        outgoing.append((rows_PH, pack_metadata(gates_PK, ch.plan.slot_PK)))
    return outgoing


def _run_experts(ch: Chunk, x_RH: torch.Tensor, gates_RK: torch.Tensor, slots_RK: torch.Tensor,
                 pipe: ChunkedHandle) -> torch.Tensor:
    """One chunk's experts; records their subgraph (received rows and gates as leaves) when differentiable."""
    if not pipe.differentiable:
        return pipe.experts(x_RH, slots_RK, gates_RK)
    with torch.enable_grad():
        ch.x_RH, ch.gates_RK = x_RH.requires_grad_(), gates_RK.requires_grad_()
        ch.y_RH = pipe.experts(ch.x_RH, slots_RK, ch.gates_RK)
    return ch.y_RH.detach()


def _forward(x_TH: torch.Tensor, weights_TK: torch.Tensor, pipe: ChunkedHandle) -> torch.Tensor:
    """The forward schedule (module docstring)."""
    group, chunks = pipe.group, pipe.chunks
    outgoing = _send_rows(x_TH, weights_TK, pipe)

    def start_dispatch(c):
        ch, (rows_PH, meta_P2K) = chunks[c], outgoing[c]
        return all_to_all_start(rows_PH, ch.send, ch.recv, group), all_to_all_start(meta_P2K, ch.send, ch.recv, group)

    pending = start_dispatch(0) if chunks else None
    combines = []
    for c, ch in enumerate(chunks):
        following = start_dispatch(c + 1) if c + 1 < len(chunks) else None
        (x_RH, work_x), (meta_R2K, work_meta) = pending
        all_to_all_wait(work_x)
        all_to_all_wait(work_meta)
        gates_RK, slots_RK = unpack_metadata(meta_R2K, weights_TK.dtype)
        y_RH = _run_experts(ch, x_RH, gates_RK, slots_RK, pipe)
        record_sent(pipe, ch.recv, y_RH, 0, backward=False)
        pipe.stats.combine_rows += y_RH.shape[0]
        combines.append(all_to_all_start(y_RH, ch.recv, ch.send, group))
        pending = following
    outs = []
    for ch, (y_PH, work) in zip(chunks, combines):
        all_to_all_wait(work)
        outs.append(token_sum(y_PH, ch.plan.token_P, ch.plan.row_TJ, x_TH.dtype))
    return torch.cat(outs) if outs else x_TH.new_zeros(x_TH.shape)


def _expert_backward(ch: Chunk, grad_y_RH: torch.Tensor, grad_weights: list[torch.Tensor],
                     pipe: ChunkedHandle) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's expert backward: (grad of received rows, of received gates); weight grads accumulated."""
    leaves = (ch.x_RH, ch.gates_RK, *pipe.weights)
    grads = (None,) * len(leaves)
    if ch.y_RH.requires_grad:
        grads = torch.autograd.grad(ch.y_RH, leaves, grad_y_RH, allow_unused=True)
    for acc, g in zip(grad_weights, grads[2:]):
        if g is not None:
            acc += g
    gx_RH = grads[0] if grads[0] is not None else torch.zeros_like(ch.x_RH)
    gg_RK = grads[1] if grads[1] is not None else torch.zeros_like(ch.gates_RK)
    ch.x_RH = ch.gates_RK = ch.y_RH = None  # free the subgraph
    return gx_RH, gg_RK


class _PipelinedMoE(torch.autograd.Function):
    """(x_TH, weights_TK, *expert weights) -> y_TH through the chunked pipeline; explicit backward."""

    @staticmethod
    def forward(ctx, x_TH, weights_TK, pipe: ChunkedHandle, *expert_weights):
        ctx.pipe = pipe
        ctx.shapes = (x_TH.shape, weights_TK.shape)
        return _forward(x_TH, weights_TK, pipe)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y_TH):
        pipe = ctx.pipe
        group, chunks = pipe.group, pipe.chunks
        x_shape, w_shape = ctx.shapes
        grad_y_TH = grad_y_TH.contiguous()
        grad_weights = [torch.zeros_like(w) for w in pipe.weights]

        def start_combine_backward(c):
            ch = chunks[c]
            rows_PH = grad_y_TH[ch.lo : ch.hi][ch.plan.token_P]  # each row gets its token's gradient
            record_sent(pipe, ch.send, rows_PH, 0, backward=True)
            return all_to_all_start(rows_PH, ch.send, ch.recv, group)

        pending = start_combine_backward(0) if chunks else None
        returns = []
        for c, ch in enumerate(chunks):
            following = start_combine_backward(c + 1) if c + 1 < len(chunks) else None
            grad_y_RH, work = pending
            all_to_all_wait(work)
            gx_RH, gg_RK = _expert_backward(ch, grad_y_RH, grad_weights, pipe)
            record_sent(pipe, ch.recv, gx_RH, gg_RK.numel() * gg_RK.element_size(), backward=True)
            returns.append((all_to_all_start(gx_RH, ch.recv, ch.send, group), all_to_all_start(gg_RK, ch.recv, ch.send, group)))
            pending = following
        grad_x, grad_w = [], []
        for ch, ((gx_PH, work_x), (gg_PK, work_g)) in zip(chunks, returns):
            all_to_all_wait(work_x)
            all_to_all_wait(work_g)
            grad_x.append(token_sum(gx_PH, ch.plan.token_P, ch.plan.row_TJ, gx_PH.dtype))
            grad_w.append(scatter_gates(gg_PK, ch.plan.entry_PK, torch.Size((ch.hi - ch.lo, w_shape[1]))))
        pipe.weights = ()
        return torch.cat(grad_x).view(x_shape), torch.cat(grad_w).view(w_shape), None, *grad_weights
