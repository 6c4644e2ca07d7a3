"""Pipelined expert parallelism: the layer's tokens in chunks, all-to-alls hidden behind experts.

`pipelined_moe` computes exactly what dispatch -> experts -> combine computes (the same plans,
the same sums), but over C chunks of the rank's tokens so that communication and compute of
different chunks run at the same time:

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

from occult.moe.comm import CommStats, _metadata_bytes, pack_metadata, _record, _unpack_metadata, all_to_all_start, all_to_all_wait
from occult.moe.dispatch import Dispatcher, gather_gates, scatter_gates, token_sum
from occult.moe.experts import expert_mlp
from occult.moe.plan import DispatchPlan, trim


def chunk_bounds(num_tokens: int, num_chunks: int) -> list[tuple[int, int]]:
    """[lo, hi) token ranges of `num_chunks` nearly equal chunks (empty ones when T < C)."""
    if num_chunks < 1:
        raise ValueError(f"overlap needs at least 1 chunk, got {num_chunks}")
    edges = [num_tokens * c // num_chunks for c in range(num_chunks + 1)]
    return list(zip(edges[:-1], edges[1:]))


@dataclass
class _Chunk:
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
class _Pipeline:
    """Python-side state shared by forward and backward of one pipelined call."""

    chunks: list[_Chunk]
    group: Any
    rank: int
    backend: str
    differentiable: bool
    stats: CommStats = field(default_factory=CommStats)
    weights: tuple[torch.Tensor, torch.Tensor] | None = None  # detached leaves of gate_up, down


def _forward(x_TH, weights_TK, gate_up_EFH, down_EHF, pipe: _Pipeline) -> torch.Tensor:
    """The forward schedule (module docstring); records each chunk's expert subgraph when differentiable."""
    group, chunks = pipe.group, pipe.chunks
    if pipe.differentiable:
        pipe.weights = (gate_up_EFH.detach().requires_grad_(), down_EHF.detach().requires_grad_())
        w1, w2 = pipe.weights
    else:
        w1, w2 = gate_up_EFH, down_EHF
    gate_dtype = weights_TK.dtype
    # Rows and metadata of every chunk first: a started exchange then waits for nothing but them.
    outgoing = []
    for ch in chunks:
        rows_PH = x_TH[ch.lo : ch.hi][ch.plan.token_P]
        gates_PK = gather_gates(weights_TK[ch.lo : ch.hi], ch.plan.entry_PK)
        _record(pipe, ch.send, rows_PH, _metadata_bytes(gates_PK), backward=False)
        pipe.stats.dispatch_rows += ch.plan.num_rows
        outgoing.append((rows_PH, pack_metadata(gates_PK, ch.plan.slot_PK)))

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
        gates_RK, slots_RK = _unpack_metadata(meta_R2K, gate_dtype)
        acc = torch.promote_types(x_RH.dtype, torch.float32)
        if pipe.differentiable:
            with torch.enable_grad():
                ch.x_RH, ch.gates_RK = x_RH.requires_grad_(), gates_RK.requires_grad_()
                ch.y_RH = expert_mlp(ch.x_RH, slots_RK, ch.gates_RK.to(acc), w1, w2, backend=pipe.backend)
            y_RH = ch.y_RH.detach()
        else:
            y_RH = expert_mlp(x_RH, slots_RK, gates_RK.to(acc), w1, w2, backend=pipe.backend)
        _record(pipe, ch.recv, y_RH, 0, backward=False)
        pipe.stats.combine_rows += y_RH.shape[0]
        combines.append(all_to_all_start(y_RH, ch.recv, ch.send, group))
        pending = following
    outs = []
    for ch, (y_PH, work) in zip(chunks, combines):
        all_to_all_wait(work)
        outs.append(token_sum(y_PH, ch.plan.token_P, ch.plan.row_TJ, x_TH.dtype))
    return torch.cat(outs) if outs else x_TH.new_zeros(x_TH.shape)


class _PipelinedMoE(torch.autograd.Function):
    """(x_TH, weights_TK, gate_up, down) -> y_TH through the chunked pipeline; explicit backward."""

    @staticmethod
    def forward(ctx, x_TH, weights_TK, gate_up_EFH, down_EHF, pipe: _Pipeline):
        ctx.pipe = pipe
        ctx.shapes = (x_TH.shape, weights_TK.shape)
        return _forward(x_TH, weights_TK, gate_up_EFH, down_EHF, pipe)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y_TH):
        pipe = ctx.pipe
        group, chunks = pipe.group, pipe.chunks
        x_shape, w_shape = ctx.shapes
        grad_y_TH = grad_y_TH.contiguous()
        w1, w2 = pipe.weights
        grad_w1, grad_w2 = torch.zeros_like(w1), torch.zeros_like(w2)

        def start_combine_backward(c):
            ch = chunks[c]
            rows_PH = grad_y_TH[ch.lo : ch.hi][ch.plan.token_P]  # each row gets its token's gradient
            _record(pipe, ch.send, rows_PH, 0, backward=True)
            return all_to_all_start(rows_PH, ch.send, ch.recv, group)

        pending = start_combine_backward(0) if chunks else None
        returns = []
        for c, ch in enumerate(chunks):
            following = start_combine_backward(c + 1) if c + 1 < len(chunks) else None
            grad_y_RH, work = pending
            all_to_all_wait(work)
            grads = (None, None, None, None)
            if ch.y_RH.requires_grad:
                grads = torch.autograd.grad(ch.y_RH, (ch.x_RH, ch.gates_RK, w1, w2), grad_y_RH, allow_unused=True)
            gx_RH = grads[0] if grads[0] is not None else torch.zeros_like(ch.x_RH)
            gg_RK = grads[1] if grads[1] is not None else torch.zeros_like(ch.gates_RK)
            if grads[2] is not None:
                grad_w1 += grads[2]
            if grads[3] is not None:
                grad_w2 += grads[3]
            ch.x_RH = ch.gates_RK = ch.y_RH = None  # free the subgraph
            _record(pipe, ch.recv, gx_RH, gg_RK.numel() * gg_RK.element_size(), backward=True)
            returns.append((all_to_all_start(gx_RH, ch.recv, ch.send, group), all_to_all_start(gg_RK, ch.recv, ch.send, group)))
            pending = following
        grad_x, grad_w = [], []
        for ch, ((gx_PH, work_x), (gg_PK, work_g)) in zip(chunks, returns):
            all_to_all_wait(work_x)
            all_to_all_wait(work_g)
            grad_x.append(token_sum(gx_PH, ch.plan.token_P, ch.plan.row_TJ, gx_PH.dtype))
            grad_w.append(scatter_gates(gg_PK, ch.plan.entry_PK, torch.Size((ch.hi - ch.lo, w_shape[1]))))
        pipe.weights = None
        return torch.cat(grad_x).view(x_shape), torch.cat(grad_w).view(w_shape), grad_w1, grad_w2, None


def pipelined_moe(
    dispatcher: Dispatcher,
    x_TH: torch.Tensor,
    weights_TK: torch.Tensor,
    ids_TK: torch.Tensor,
    expert_device_E: torch.Tensor,
    expert_slot_E: torch.Tensor,
    status: torch.Tensor,
    gate_up_EFH: torch.Tensor,
    down_EHF: torch.Tensor,
    num_chunks: int,
    backend: str = "auto",
    sync_free: bool = False,
) -> tuple[torch.Tensor, CommStats]:
    """Dispatch, experts and combine of `num_chunks` token chunks, overlapped; returns (y_TH, stats).

    The same function (and the same rows) as `dispatcher.dispatch` -> `expert_mlp` ->
    `dispatcher.combine`; raises `RoutingError` on every rank when any rank reports bad input
    (not with `sync_free`, which exchanges no counts: see `Dispatcher.dispatch`).
    """
    bounds = chunk_bounds(x_TH.shape[0], num_chunks)
    plan_of = dispatcher.static_plan if sync_free else dispatcher.plan
    plans = [plan_of(ids_TK[lo:hi], expert_device_E, expert_slot_E) for lo, hi in bounds]
    if sync_free:
        D = dispatcher.num_ranks
        sends = recvs = [[plan.num_rows // D] * D for plan in plans]
    else:
        sends, recvs = dispatcher.exchange_chunk_counts(torch.stack([p.send_counts_D for p in plans]), status)
        plans = [trim(plan, sum(send)) for plan, send in zip(plans, sends)]
    chunks = [_Chunk(lo, hi, plan, send, recv) for (lo, hi), plan, send, recv in zip(bounds, plans, sends, recvs)]
    differentiable = torch.is_grad_enabled() and any(
        t.requires_grad for t in (x_TH, weights_TK, gate_up_EFH, down_EHF)
    )
    pipe = _Pipeline(chunks, dispatcher.group, dispatcher.rank, backend, differentiable)
    if differentiable:
        y_TH = _PipelinedMoE.apply(x_TH, weights_TK, gate_up_EFH, down_EHF, pipe)
    else:
        y_TH = _forward(x_TH, weights_TK, gate_up_EFH, down_EHF, pipe)
    return y_TH, pipe.stats
