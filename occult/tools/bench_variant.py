"""One variant of one layer in `occult bench`: what a variant name means (dispatcher, transport,
sync-free, CUDA graphs), the layer built with this rank's share of the full weights and a preset
router (every variant sees the same routing), its output checked against a float32 dense
reference, then timed: forward, forward+backward, host time and syncs, and the pieces alone (the
expert compute on the received rows, the dispatch + combine all-to-alls) for its floor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from occult.moe.comm import all_to_all
from occult.moe.config import ExecConfig, MoEConfig
from occult.moe.device_exchange import as_byte_rows
from occult.moe.experts import expert_mlp
from occult.moe.graphs import EAGER_CALLS
from occult.moe.layer import OccultMoE
from occult.moe.symm import DeviceTransport, row_bytes
from occult.tools.bench_timing import count_host_syncs
from occult.tools.bench_timing import host_ms as measure_host_ms


def variant_dispatcher(variant: str) -> str:
    """The dispatcher a variant runs ('dedup+placement': dedup on the solved placement)."""
    return variant.split("/")[0].split("@")[0].removesuffix("+placement")


def variant_sync_free(variant: str) -> bool:
    """'@syncfree': sync-free, fixed-capacity dispatch over NCCL (`ExecConfig(sync_free=True)`: no host wait);
    '@host': the same through shared pinned host memory (`ExecConfig(sync_free=True, transport="host")`)."""
    return variant.split("/")[0].partition("@")[2] in ("syncfree", "host")


def variant_transport(variant: str) -> str:
    """The transport a variant asks for: "@device" the device transport (`occult.moe.symm`), "@host" the host
    transport (`occult.moe.host_wire`), else "auto"."""
    how = variant.split("/")[0].partition("@")[2]
    return how if how in ("device", "host") else "auto"


def variant_graphs(variant: str) -> bool:
    """'.../graph': forwards replayed from the layer's CUDA graphs (`ExecConfig(graphs=True)`; autograd runs
    eagerly)."""
    return variant.endswith("/graph")


class PresetRouter(nn.Module):
    """A router whose expert choice is given (to compare dispatchers on identical routing).

    Gate weights are the softmax of the real gate at the preset ids, so gradients reach the gate.
    """

    def __init__(self, gate: nn.Linear, ids_TK: torch.Tensor) -> None:
        super().__init__()
        self.gate = gate
        self.ids_TK = ids_TK

    def forward(self, x_TH: torch.Tensor):
        scores_TE = torch.softmax(self.gate(x_TH).float(), dim=-1)
        return scores_TE.gather(1, self.ids_TK), self.ids_TK


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float32 (b the reference)."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def dense_reference(x, ids, weights, w1_full, w2_full) -> torch.Tensor:
    """float32 reference for a few tokens: y_t = sum_k w_tk * expert_{id_tk}(x_t), expert by expert."""
    x = x.float()
    y = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        token, col = (ids == e).nonzero(as_tuple=True)
        g, u = (x[token] @ w1_full[e].float().t()).chunk(2, dim=-1)
        out = (torch.nn.functional.silu(g) * u) @ w2_full[e].float().t()
        y.index_add_(0, token, weights[token, col, None].float() * out)
    return y


def _variant_layer(variant, shape, placement, w1_full, w2_full, gate_w, ids_sets, device, args):
    """The variant's layer with this rank's share of the full weights, and one preset router per batch."""
    layer = OccultMoE(
        MoEConfig(shape.hidden, shape.ffn, shape.experts, shape.top_k, w1_full.dtype),
        placement=placement,
        execution=ExecConfig(
            variant_dispatcher(variant),
            expert_backend=args["expert_backend"],
            transport=variant_transport(variant),
            graphs=variant_graphs(variant),
            sync_free=variant_sync_free(variant),
        ),
        device=device,
    )
    with torch.no_grad():
        layer.gate_up_proj.copy_(w1_full[layer.local_expert_ids])
        layer.down_proj.copy_(w2_full[layer.local_expert_ids])
        layer.router.gate.weight.copy_(gate_w)
    return layer, [PresetRouter(layer.router.gate, ids) for ids in ids_sets]


def _time_pieces(layer, router, x_TH, timer, warmup, iters, args):
    """(expert ms, all-to-all ms, pairs): the expert compute on one batch's received rows, and its
    dispatch + combine all-to-alls alone (0 for the two-level dispatch: four exchanges on two
    groups, not timed alone; its floor is the experts)."""
    layer.router = router
    with torch.no_grad():
        weights_TK, ids_TK = layer.router(x_TH)
        received, st = layer.dispatcher.dispatch(x_TH, weights_TK, ids_TK, layer.expert_map)
    n = sum(_splits(st)[1]) if hasattr(st, "plan") else received.x_RH.shape[0]  # the received rows, not the masked tail
    x_RH, slots_RK, gates_RK = received.x_RH[:n], received.slots_RK[:n], received.gates_RK[:n].float()
    expert_ms = timer(
        lambda: expert_mlp(
            x_RH,
            slots_RK,
            gates_RK,
            layer.gate_up_proj.detach(),
            layer.down_proj.detach(),
            backend=args["expert_backend"],
        ),
        warmup,
        iters,
    )
    a2a_ms = 0.0
    if hasattr(st, "plan"):
        send, recv = _splits(st)
        rows_out = x_TH[st.plan.token_P[: sum(send)]]
        y_back = x_RH[: sum(recv)].clone()
        a2a_ms = timer(_round_trip(layer.dispatcher, rows_out, y_back, send, recv), warmup, iters)
    return expert_ms, a2a_ms, int((slots_RK >= 0).sum())


def _round_trip(dispatcher, rows_out, y_back, send: list[int], recv: list[int]):
    """One dispatch and one combine of these rows over the dispatcher's own transport: the device
    transport's push where it has one (`symm.DeviceTransport.exchange`), else NCCL/gloo
    `all_to_all_single` (the count exchange's)."""
    transport, group = getattr(dispatcher, "transport", None), dispatcher.group
    if not isinstance(transport, DeviceTransport):
        return lambda: (all_to_all(rows_out, send, recv, group), all_to_all(y_back, recv, send, group))
    out_NW, back_NW = _as_byte_rows(rows_out), _as_byte_rows(y_back)
    stride = torch.tensor([max(send + recv)], device=rows_out.device)
    dist.all_reduce(stride, op=dist.ReduceOp.MAX, group=group)  # every rank passes the same stride
    stride = int(stride.item())
    transport.reserve(transport.num_ranks * stride * out_NW.shape[1])
    send_D, recv_D = (torch.tensor(c, dtype=torch.int64, device=rows_out.device) for c in (send, recv))
    return lambda: (transport.exchange(out_NW, send_D, stride), transport.exchange(back_NW, recv_D, stride))


def _as_byte_rows(rows_NH: torch.Tensor) -> torch.Tensor:
    """Rows as the device transport's byte rows (padded to its row width; no copy where they fit)."""
    width = row_bytes(rows_NH.shape[1] * rows_NH.element_size())
    exact_NW = as_byte_rows(rows_NH, width)
    if exact_NW is not None:
        return exact_NW
    raw_NB = rows_NH.contiguous().view(torch.uint8)
    padded_NW = raw_NB.new_zeros((raw_NB.shape[0], width))
    padded_NW[:, : raw_NB.shape[1]] = raw_NB
    return padded_NW


def _splits(handle) -> tuple[list[int], list[int]]:
    """(send, receive) rows per rank of a flat dispatch: on the host already (count exchange), or
    read from the device (device transport)."""
    if hasattr(handle, "send_splits"):
        return handle.send_splits, handle.recv_splits
    return handle.send_counts_D.tolist(), handle.recv_counts_D.tolist()


def bench_variant(
    variant, shape, placement, w1_full, w2_full, gate_w, xs, gs, ids_sets, timer, warmup, iters, world, device, args
) -> dict:
    """One variant on this rank: its output checked against the float32 dense reference, then timed
    (forward, forward+backward, host ms and syncs, the expert compute and the all-to-alls alone;
    each time the slowest rank's median): the run's row of the table."""
    layer, routers = _variant_layer(
        variant, shape, placement, w1_full, w2_full, gate_w, ids_sets[: len(xs)], device, args
    )

    # 1. correctness first: a slice of tokens against a float32 dense reference
    layer.router = routers[0]
    with torch.no_grad():
        y = layer(xs[0])
        n = min(256, xs[0].shape[0])
        w, ids = routers[0](xs[0])
        ref = dense_reference(xs[0][:n], ids[:n], w[:n], w1_full, w2_full)
    err = rel_error(y[:n], ref)
    stats = layer.last_comm_stats
    step = lambda: layer(xs[0].detach().requires_grad_()).backward(gs[0])  # noqa: E731
    step()  # warm: a first backward compiles and autotunes kernels, whose synchronisations are not the layer's
    syncs = count_host_syncs(step, device)
    layer.zero_grad(set_to_none=True)

    state = {"i": 0}

    def forward():
        i = state["i"] = (state["i"] + 1) % len(xs)
        layer.router = routers[i]
        with torch.no_grad():
            layer(xs[i])

    def forward_backward():
        i = state["i"] = (state["i"] + 1) % len(xs)
        layer.router = routers[i]
        x = xs[i].detach().requires_grad_()
        layer(x).backward(gs[i])

    if variant_graphs(variant):  # every input set captured before timing, and a replay checked
        for _ in range((EAGER_CALLS + 1) * len(xs)):
            forward()
        layer.router = routers[0]
        with torch.no_grad():
            err = max(err, rel_error(layer(xs[0])[:n], ref))
    fwd_ms = timer(forward, warmup, iters)
    host_ms = measure_host_ms(forward, device, iters)
    step_ms = timer(forward_backward, warmup, iters)
    layer.zero_grad(set_to_none=True)

    # 2. the pieces alone: expert compute on the received rows, and the all-to-alls
    expert_ms, a2a_ms, pairs = _time_pieces(layer, routers[0], xs[0], timer, warmup, iters, args)
    flops = 2 * pairs * 3 * shape.hidden * shape.ffn  # GEMM1 (2F x H) + GEMM2 (H x F)
    tot = torch.tensor(
        [flops, stats.forward_remote_rows, stats.dispatch_rows, xs[0].shape[0], stats.forward_bytes],
        dtype=torch.float64,
        device=device,
    )
    if world > 1:
        dist.all_reduce(tot)
    remote_bytes_rank = stats.forward_remote_rows * shape.hidden * xs[0].element_size()
    return {
        "rel_error": err,
        "forward_ms": fwd_ms,
        "fwd_bwd_ms": step_ms,
        "expert_ms": expert_ms,
        "all_to_all_ms": a2a_ms,
        "floor_ms": expert_ms + a2a_ms,
        "mean_ct": float(tot[2] / tot[3]),
        "forward_bytes_per_rank": stats.forward_bytes,
        "forward_remote_bytes_per_rank": remote_bytes_rank,
        "all_to_all_GBps": remote_bytes_rank / a2a_ms / 1e6 if a2a_ms > 0 else 0.0,
        "expert_tflops": flops / expert_ms / 1e9 if expert_ms > 0 else 0.0,
        "expert_gflop_fwd": flops / 1e9,  # this rank's expert GEMMs in one forward; a backward does twice as many
        "pairs_per_rank": pairs,
        "host_syncs_fwd_bwd": syncs,
        "host_ms_fwd": host_ms,
        "transport": "sync-free" if layer.sync_free else layer.dispatcher.transport_name,
        "graphs": len(layer.graphs),
    }
