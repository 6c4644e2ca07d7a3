"""The MoE layer: `OccultMoE` (expert parallel); its reference `DenseMoE` is in `occult.moe.dense`.

Forward on one rank, top to bottom:
  1. route     `self.router(x_TH) -> (weights_TK, ids_TK)`            (occult.moe.routing)
  2. plan      rows per destination: k copies or one per device        (occult.moe.plan)
  3. dispatch  counts, then all-to-all of rows, slots and gates        (occult.moe.dispatch, .comm)
  4. experts   SwiGLU experts on received rows, gate-weighted, summed  (occult.moe.experts)
  5. combine   one row back per sent row, summed per token in fp32     (occult.moe.dispatch, .comm)
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from occult.moe.comm import CommStats
from occult.moe.dense import DenseMoE, expert_parameters
from occult.moe.dispatch import RoutingError, make_dispatcher
from occult.moe.experts import expert_mlp
from occult.moe.overlap import pipelined_moe
from occult.moe.routing import TopKRouter
from occult.moe.two_batch import pause_point
from occult.placement import Placement, check_divisible


class OccultMoE(nn.Module):
    """Expert-parallel MoE layer with deduplicated (or standard) all-to-all dispatch.

    Every rank of `group` holds the router (replicated, [E, H], expert-id order) and the experts
    the placement gives it, in local-slot order: `gate_up_proj` [E/D, 2F, H], `down_proj`
    [E/D, H, F]. `dispatcher="dedup"` sends a token once per device holding any of its experts;
    `"standard"` once per expert. Both compute the same function as `DenseMoE`.

    The router's gradient is this rank's contribution: all-reduce it over the data-parallel
    group as for any replicated parameter. `init_weights=False` leaves the expert weights
    uninitialised, for callers that load them (`from_dense` does). `last_comm_stats` holds the
    rows and bytes sent by the last forward (and, after it, backward).

    `sync_free=True` (settable at any time, e.g. for decode; `set_sync_free` walks a model)
    dispatches fixed-capacity plans whose all-to-all sizes follow from shapes alone: no host
    wait, so a forward can be captured in a CUDA graph. Every rank must then pass the same
    number of tokens, and bad input is not reported across ranks (a wrong hidden size raises on
    its own rank only). It sends more rows (unused capacity) and is meant for small batches.

    `overlap_chunks=C > 1` (settable at any time; `set_overlap` walks a model) pipelines the
    layer over C chunks of the rank's tokens (`occult.moe.overlap`): the all-to-alls of one chunk
    run under the experts of another, forward and backward; the same rows, the same function,
    still one host sync. All ranks of the group must use the same C.

    Called inside `occult.two_batch_overlap`, the layer hands the turn to the other half of the
    batch after starting each all-to-all (pipelined layers raise there: use one or the other).
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_size: int,
        num_experts: int,
        top_k: int,
        *,
        norm_topk_prob: bool = False,
        placement: Placement | None = None,
        layer_index: int = 0,
        dispatcher: str = "dedup",
        group: Any = None,
        router: nn.Module | None = None,
        max_devices: int | None = None,
        prune_method: str = "score",
        similarity_EE: torch.Tensor | None = None,
        expert_backend: str = "auto",
        sync_free: bool = False,
        overlap_chunks: int = 1,
        init_weights: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        # a name ("standard", "dedup", "dedup2": nodes from the placement) or a built Dispatcher
        self.dispatcher = make_dispatcher(dispatcher, group, placement=placement)
        num_ranks, rank = self.dispatcher.num_ranks, self.dispatcher.rank
        check_divisible(num_experts, num_ranks)
        if placement is None:
            placement = Placement.contiguous(num_experts, num_ranks)
            layer_index = 0
        placement.check_fits(num_experts, num_ranks)
        self.hidden_size, self.ffn_size = hidden_size, ffn_size
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.num_ranks, self.rank = num_ranks, rank
        self.placement, self.layer_index = placement.layer(layer_index), layer_index
        self.expert_backend = expert_backend
        self.sync_free = sync_free
        if overlap_chunks < 1:
            raise ValueError(f"overlap_chunks must be >= 1 (1 = no pipelining), got {overlap_chunks}")
        self.overlap_chunks = overlap_chunks
        if router is None:
            router = TopKRouter(
                hidden_size, num_experts, top_k, norm_topk_prob,
                max_devices=max_devices, prune_method=prune_method, similarity_EE=similarity_EE,
                dtype=dtype, device=device,
            )
        elif max_devices is not None:
            raise ValueError("max_devices applies to the built-in router; give your router its own device limit")
        self.router = router
        expert_device_E, expert_slot_E = self.placement.tensors(0, device=device)
        self.register_buffer("expert_device_E", expert_device_E, persistent=False)
        self.register_buffer("expert_slot_E", expert_slot_E, persistent=False)
        local = torch.as_tensor(self.placement.experts_on_device(rank).copy(), device=device)
        self.register_buffer("local_expert_ids", local, persistent=False)
        if hasattr(self.router, "set_expert_device"):
            self.router.set_expert_device(expert_device_E)
        self.gate_up_proj, self.down_proj = expert_parameters(
            num_experts // num_ranks, hidden_size, ffn_size, dtype, device, init=init_weights
        )
        self.last_comm_stats = CommStats()

    # --------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor, while_waiting: Callable[[], None] | None = None) -> torch.Tensor:
        """x [..., H] -> [..., H]; every rank of the group must call it (any token count, even 0).

        `while_waiting` (optional) is called exactly once during the call: while the host waits
        for the row counts (the layer's one sync), so GPU work that does not depend on this
        layer's routing (e.g. a block's shared experts) keeps the GPU busy while the host then
        launches the all-to-alls and the experts; at once where there is no such wait.
        """
        if x.shape[-1] != self.hidden_size and self.sync_free:
            raise ValueError(f"input has hidden size {x.shape[-1]} but this MoE layer expects {self.hidden_size}")
        wrong_hidden = x.shape[-1] != self.hidden_size
        # Tell the other ranks before raising (status 3), so no rank is left waiting in a collective.
        x_TH = x.new_zeros((0, self.hidden_size)) if wrong_hidden else x.reshape(-1, self.hidden_size)

        # 1. route; the input status travels with the counts (`occult.moe.dispatch.STATUS_MESSAGES`):
        # 2 ids out of range, else 1 NaN/inf gates, else 0 (few launches: the forward is host-bound)
        weights_TK, ids_TK = self.router(x_TH)
        clamped_TK = ids_TK.clamp(0, self.num_experts - 1)
        status = torch.where((clamped_TK != ids_TK).any(), 2, (~torch.isfinite(weights_TK)).any().to(torch.int64))
        if wrong_hidden:
            status = status + 3
        ids_TK = clamped_TK

        # 2-5. plan, dispatch, experts, combine (the one host sync is the count exchange, unless
        # sync_free); pipelined over token chunks when overlap_chunks > 1
        try:
            if self.overlap_chunks > 1:
                if pause_point() is not None:
                    raise ValueError("a pipelined MoE layer (overlap_chunks > 1) cannot run inside two_batch_overlap: "
                                     "its backward collectives would not join the two halves' order; "
                                     "use set_overlap(model, 1) with two-batch overlap")
                if while_waiting is not None:
                    while_waiting()
                y_TH, self.last_comm_stats = pipelined_moe(
                    self.dispatcher, x_TH, weights_TK, ids_TK, self.expert_device_E, self.expert_slot_E, status,
                    self.gate_up_proj, self.down_proj, self.overlap_chunks, self.expert_backend, self.sync_free,
                )
                return y_TH.reshape(x.shape)
            pause = pause_point()  # inside `two_batch_overlap`: the other half runs while our exchanges fly
            self._check_not_recomputed_after_two_batch(pause is not None)
            x_RH, slots_RK, gates_RK, state = self.dispatcher.dispatch(
                x_TH, weights_TK, ids_TK, self.expert_device_E, self.expert_slot_E, status, sync_free=self.sync_free,
                pause=pause, while_waiting=while_waiting,
            )
        except RoutingError as exc:
            if x.shape[-1] != self.hidden_size:
                raise ValueError(
                    f"input has hidden size {x.shape[-1]} but this MoE layer expects {self.hidden_size}"
                ) from exc
            raise
        self.last_comm_stats = state.stats

        # 4. local experts, gate-weighted and pre-reduced per received row
        y_RH = expert_mlp(x_RH, slots_RK, gates_RK.to(torch.promote_types(x_RH.dtype, torch.float32)),
                          self.gate_up_proj, self.down_proj, backend=self.expert_backend)

        # 5. combine
        y_TH = self.dispatcher.combine(y_RH, state, pause=pause)
        return y_TH.reshape(x.shape)

    def _check_not_recomputed_after_two_batch(self, in_two_batch: bool) -> None:
        """A layer recomputed in backward (activation checkpointing) after a forward under
        `two_batch_overlap` would exchange outside the halves' fixed collective order, where ranks
        can mismatch collectives: raise instead, before any collective (every rank recomputes the
        same layers, so every rank raises). Skipped under torch.compile (no two-batch overlap there)."""
        if in_two_batch:
            self._two_batch_graph = True
            return
        if not getattr(self, "_two_batch_graph", False) or torch.compiler.is_compiling():
            return  # the usual case: one attribute read per forward
        if torch._C._current_graph_task_id() != -1:  # in backward: a recomputation
            raise RuntimeError(
                "this MoE layer is being recomputed during backward (activation checkpointing) after a forward "
                "under two_batch_overlap: its all-to-alls would run outside the two halves' fixed order, and the "
                "ranks could mismatch collectives. Use two-batch overlap without checkpointing the MoE layers "
                "(checkpoint only the attention), or checkpointing without two-batch overlap"
            )
        self._two_batch_graph = False  # a plain forward again

    # ------------------------------------------------------ dense <-> sharded
    @classmethod
    def from_dense(
        cls,
        dense: DenseMoE,
        placement: Placement | None = None,
        layer_index: int = 0,
        dispatcher: str = "dedup",
        group: Any = None,
        **kwargs: Any,
    ) -> "OccultMoE":
        """Shard a full set of expert weights onto this rank by `placement` (default contiguous)."""
        ref = dense.gate_up_proj
        layer = cls(
            dense.hidden_size, dense.ffn_size, dense.num_experts, dense.top_k,
            norm_topk_prob=dense.norm_topk_prob, placement=placement, layer_index=layer_index,
            dispatcher=dispatcher, group=group, dtype=ref.dtype, device=ref.device, init_weights=False, **kwargs,
        )
        with torch.no_grad():
            layer.router.gate.weight.copy_(dense.router.gate.weight)
            layer.gate_up_proj.copy_(dense.gate_up_proj[layer.local_expert_ids])
            layer.down_proj.copy_(dense.down_proj[layer.local_expert_ids])
        return layer

    def gather_experts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's experts in expert-id order: (gate_up_proj [E, 2F, H], down_proj [E, H, F]).

        A collective (all-gather): call it on all ranks of the group.
        """
        out = []
        for local in (self.gate_up_proj.detach(), self.down_proj.detach()):
            if self.dispatcher.group is not None:
                shards = [torch.empty_like(local) for _ in range(self.num_ranks)]
                dist.all_gather(shards, local.contiguous(), group=self.dispatcher.group)
                local = torch.cat(shards)
            out.append(self.placement.invert(local))
        return out[0], out[1]

    def to_dense(self) -> DenseMoE:
        """Gather every rank's experts (a collective: call on all ranks) into a `DenseMoE`."""
        gate_up, down = self.gather_experts()
        dense = DenseMoE(
            self.hidden_size, self.ffn_size, self.num_experts, self.top_k, self.norm_topk_prob,
            dtype=self.gate_up_proj.dtype, device=self.gate_up_proj.device,
        )
        with torch.no_grad():
            dense.router.gate.weight.copy_(self.router.gate.weight)
            dense.gate_up_proj.copy_(gate_up)
            dense.down_proj.copy_(down)
        return dense

    def extra_repr(self) -> str:
        return (
            f"hidden={self.hidden_size}, ffn={self.ffn_size}, experts={self.num_experts} "
            f"({self.num_experts // self.num_ranks} on rank {self.rank} of {self.num_ranks}), "
            f"top_k={self.top_k}, dispatcher={self.dispatcher.name}"
        )


def set_sync_free(module: nn.Module, enabled: bool = True) -> int:
    """Switch every `OccultMoE` inside `module` to (or from) sync-free dispatch; returns how many."""
    layers = [m for m in module.modules() if isinstance(m, OccultMoE)]
    for layer in layers:
        layer.sync_free = enabled
    return len(layers)


def set_overlap(module: nn.Module, chunks: int) -> int:
    """Pipeline every `OccultMoE` inside `module` over `chunks` token chunks (1 = off); returns how many."""
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1 (1 = no pipelining), got {chunks}")
    layers = [m for m in module.modules() if isinstance(m, OccultMoE)]
    for layer in layers:
        layer.overlap_chunks = chunks
    return len(layers)
