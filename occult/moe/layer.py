"""The MoE layer: `OccultMoE` (expert parallel); its reference `DenseMoE` is in `occult.moe.dense`.

Forward on one rank, top to bottom:
  1. route     `self.router(x_TH) -> (weights_TK, ids_TK)`            (occult.moe.routing)
  2. plan      rows per destination: k copies or one per device        (occult.moe.plan)
  3. dispatch  counts, then all-to-all of rows, slots and gates        (occult.moe.dispatch, .comm)
  4. experts   SwiGLU experts on received rows, gate-weighted, summed  (occult.moe.experts)
  5. combine   one row back per sent row, summed per token in fp32     (occult.moe.dispatch, .comm)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from occult.moe import status as pending
from occult.moe.comm import CommStats
from occult.moe.config import ExecConfig, MoEConfig, RoutingConfig, configs_from_keywords
from occult.moe.contract import Schedule
from occult.moe.counts import RoutingError, routing_status
from occult.moe.dense import DenseMoE, expert_parameters
from occult.moe.device_exchange import agree_and_check, settle_step, step_bound
from occult.moe.expert_map import ExpertMap
from occult.moe.experts import LocalExperts
from occult.moe.graphs import GraphCache, call_key, has_hooks
from occult.moe.host_time import forward_range, time_backward
from occult.moe.layer_input import bad_input_error, input_status
from occult.moe.registry import make_dispatcher
from occult.moe.routing import TopKRouter
from occult.moe.train_graphs import TrainingCall, trainable
from occult.moe.two_batch import exchange_issued, interleaving
from occult.placement import Placement, check_divisible


class OccultMoE(nn.Module):
    """Expert-parallel MoE layer with deduplicated (or standard) all-to-all dispatch.

    Built from three config objects (`occult.moe.config`): `MoEConfig` (sizes, experts, top-k,
    dtype), `RoutingConfig` (the built-in router's rule and collaboration pruning) and
    `ExecConfig` (dispatcher, sync-free, expert backend, transport), or in the keyword form
    `OccultMoE(hidden_size, ffn_size, num_experts, top_k, dispatcher=..., max_devices=..., ...)`.

    Every rank of `group` holds the router (replicated, [E, H], expert-id order) and the experts
    the placement gives it, in local-slot order: `gate_up_proj` [E/D, 2F, H], `down_proj`
    [E/D, H, F]. Every dispatcher computes the same function as `DenseMoE`.

    The router's gradient is this rank's contribution: all-reduce it over the data-parallel
    group as for any replicated parameter. `init_weights=False` leaves the expert weights
    uninitialised, for callers that load them (`from_dense` does). `last_comm_stats` holds the
    rows and bytes sent by the last forward (and, after it, backward).

    `sync_free` may be changed at any time (`set_sync_free` walks a model): sync-free dispatch
    has no host wait (CUDA-graph capturable; every rank passes the same token count, bad input is
    not reported across ranks, unused capacity is sent: for small batches).
    """

    def __init__(
        self,
        config: MoEConfig | int | None = None,
        *sizes: int,
        routing: RoutingConfig | None = None,
        execution: ExecConfig | None = None,
        placement: Placement | None = None,
        layer_index: int = 0,
        group: Any = None,
        router: nn.Module | None = None,
        init_weights: bool = True,
        device: torch.device | str | None = None,
        **settings: Any,
    ) -> None:
        super().__init__()
        config, routing, execution = configs_from_keywords(config, sizes, settings, routing, execution)
        self.config, self.routing = config, routing
        # a name ("standard", "dedup", "dedup2": nodes from the placement) or a built Dispatcher
        self.dispatcher = make_dispatcher(
            execution.dispatcher, group, placement=placement, transport=execution.transport
        )
        if execution.sync_free_capacity < 1:  # refused when the layer is built, not at its first sync-free call
            self.dispatcher.check_schedule(Schedule(sync_free=True, sync_free_capacity=execution.sync_free_capacity))
        self.execution = execution
        num_ranks, rank = self.dispatcher.num_ranks, self.dispatcher.rank
        check_divisible(config.num_experts, num_ranks)
        if placement is None:
            placement, layer_index = Placement.contiguous(config.num_experts, num_ranks), 0
        placement.check_fits(config.num_experts, num_ranks)
        self.hidden_size, self.ffn_size = config.hidden_size, config.ffn_size
        self.num_experts, self.top_k, self.norm_topk_prob = config.num_experts, config.top_k, routing.norm_topk_prob
        self.num_ranks, self.rank = num_ranks, rank
        self.placement, self.layer_index = placement.layer(layer_index), layer_index
        self.router = router if router is not None else TopKRouter.from_config(config, routing, device=device)
        if router is not None and routing.limited:
            raise ValueError("max_devices applies to the built-in router; give your router its own device limit")
        expert_device_E, expert_slot_E = self.placement.tensors(0, device=device)
        self.register_buffer("expert_device_E", expert_device_E, persistent=False)
        self.register_buffer("expert_slot_E", expert_slot_E, persistent=False)
        local = torch.as_tensor(self.placement.experts_on_device(rank).copy(), device=device)
        self.register_buffer("local_expert_ids", local, persistent=False)
        if hasattr(self.router, "set_expert_device"):
            self.router.set_expert_device(expert_device_E)
        self.gate_up_proj, self.down_proj = expert_parameters(
            config.num_experts // num_ranks,
            config.hidden_size,
            config.ffn_size,
            config.dtype,
            device,
            init=init_weights,
        )
        # the routing status of the last call traced by torch.compile (occult.moe.status): the write that keeps
        # a compiled graph queueing it
        self.register_buffer("routing_status_1", torch.zeros(1, dtype=torch.int64, device=device), persistent=False)
        self.last_comm_stats = CommStats()
        self.graphs = GraphCache()  # this layer's captured calls (ExecConfig(graphs=True))

    # ------------------------------------------------------- execution settings
    @property
    def sync_free(self) -> bool:
        return self.execution.sync_free

    @sync_free.setter
    def sync_free(self, enabled: bool) -> None:
        self.execution = replace(self.execution, sync_free=enabled)

    @property
    def waits_for_gpu(self) -> bool:
        """Whether a forward waits on the host for the GPU (the count exchange's row counts: several
        ranks, not sync-free, not the device transport); such a forward cannot be captured."""
        return self.num_ranks > 1 and not self.sync_free and self.dispatcher.transport_name != "device"

    @property
    def expert_backend(self) -> str:
        return self.execution.expert_backend

    @property
    def expert_map(self) -> ExpertMap:
        """Device and local slot of every expert (a view of this layer's buffers)."""
        return ExpertMap(self.expert_device_E, self.expert_slot_E)

    def local_experts(self) -> LocalExperts:
        """This rank's experts as the function the dispatcher's received rows are run through."""
        return LocalExperts(self.gate_up_proj, self.down_proj, self.execution.expert_backend)

    # --------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor, while_waiting: Callable[[], None] | None = None) -> torch.Tensor:
        """x [..., H] -> [..., H]; every rank of the group must call it (any token count, even 0).

        `while_waiting` (optional) is called exactly once during the call: while the host waits
        for the row counts (the layer's one sync), so GPU work that does not depend on this
        layer's routing (e.g. a block's shared experts) keeps the GPU busy while the host then
        launches the all-to-alls and the experts; at once where there is no such wait.
        With `ExecConfig(graphs=True)` a call replays a CUDA graph where it can (`replays`).
        """
        with forward_range():  # the call's host time, named in profiles (occult.moe.host_time)
            y = self._replayed(x, while_waiting) if self.replays(x) else self._eager(x, while_waiting)
        time_backward(x, y)
        return y

    def _eager(
        self, x: torch.Tensor, while_waiting: Callable[[], None] | None = None, agreed_tokens: int | None = None
    ) -> torch.Tensor:
        """The forward, op by op (`agreed_tokens`: the ranks' agreement, made by the caller)."""
        x_TH, bad_input = self._tokens(x)
        weights_TK, ids_TK = self.router(x_TH)  # 1. route
        status = None  # the dispatcher's to make (with its plan, in one launch where it can; none when sync-free)
        if bad_input:  # tell the other ranks before raising, so none is left waiting in a collective
            ids_TK, status = routing_status(weights_TK, ids_TK, self.num_experts)
            status = status + bad_input
        schedule = Schedule(
            self.execution.sync_free,
            while_waiting,
            agreed_tokens,
            self.routing_status_1,
            self.execution.sync_free_capacity,
        )
        try:  # 2-3. plan and dispatch (the count exchange's host wait, or none: device transport, sync-free)
            received, handle = self.dispatcher.dispatch(
                x_TH, weights_TK, ids_TK, self.expert_map, schedule, status, bad_input
            )
        except RoutingError as exc:
            if bad_input:
                raise self._bad_input(x) from exc
            raise
        self.last_comm_stats = handle.stats
        self._exchange_issued()  # two-batch overlap: the other half runs while this dispatch is on the wire
        y = received.apply(self.local_experts())  # 4. experts, gate-weighted, pre-reduced per row
        y = self.dispatcher.combine(y, handle)  # 5. combine
        if bad_input:  # inside a step's agreement (occult.moe.step): the error travelled with this call's rows
            pending.clear()  # (its peers raise it at their next call; it is not raised here again)
            raise self._bad_input(x)
        self._exchange_issued()
        return y.reshape(x.shape)

    def _exchange_issued(self) -> None:
        """Hand the turn to the other half of a two-batch forward (`occult.moe.two_batch`) where this
        layer exchanges with other ranks."""
        if self.num_ranks > 1:
            exchange_issued()

    # -------------------------------------------------------- graph replays
    def replays(self, x: torch.Tensor) -> bool:
        """Whether a call on `x` goes through the layer's CUDA graphs: `ExecConfig(graphs=True)`, a CUDA
        input, not inside another capture or torch.compile, a layer that does not wait for the GPU
        (device transport, sync-free, one rank), no forward hooks on it or its modules (a replay would
        not call them) and an input it accepts, not one half of a two-batch forward (its recording would
        span the other half's turn), a group whose exchanges a graph can record (NCCL; gloo's run on the
        host). Under autograd the backward is replayed too (`occult.moe.train_graphs`)."""
        if not self.execution.graphs or not x.is_cuda or pending.capturing() or torch.compiler.is_compiling():
            return False
        if interleaving() or not self.dispatcher.capturable:  # (a gloo group's exchanges run on the host)
            return False
        if not self.execution.train_graphs and self._differentiable(x):
            return False
        return not self.waits_for_gpu and not self._input_status(x) and not has_hooks(self, *self._router_gate())

    def _replayed(self, x: torch.Tensor, while_waiting: Callable[[], None] | None) -> torch.Tensor:
        x_TH = x.reshape(-1, self.hidden_size)
        agreed, generation = None, None
        transport = self.dispatcher.transport if self.num_ranks > 1 and not self.sync_free else None
        if transport is not None:  # every rank agrees once a call, replaying or not (occult.moe.graphs)
            agreed, generation = agree_and_check(transport, x_TH.shape[0], 0), transport.generation
        elif self.num_ranks == 1:
            pending.check_routing()  # the previous call's status, as the one-rank schedule reads it
        Schedule(while_waiting=while_waiting).run_while_waiting()
        gate = self._router_gate()
        training = self._training_call(x_TH, transport, gate)
        key = self.graph_key(x_TH, agreed, training, gate)
        y_TH, stats = self.graphs.run(
            key, generation, x_TH, lambda x_: self._eager(x_, None, agreed), lambda: self.last_comm_stats, training
        )
        self.last_comm_stats = stats
        return y_TH.reshape(x.shape)

    def graph_key(
        self, x_TH: torch.Tensor, agreed: int | None, training: TrainingCall | None, gate: tuple | None = None
    ) -> tuple:
        """The signature a recorded call of `x_TH` serves (`occult.moe.graphs.call_key`; `gate`: `_router_gate()`)."""
        trains = None if training is None else (x_TH.requires_grad, len(training.params))
        gate = self._router_gate() if gate is None else gate
        schedule = (self.sync_free, self.execution.sync_free_capacity)
        return call_key(x_TH, agreed, trains, schedule, self.router, (self, *gate))

    def _router_gate(self) -> tuple[nn.Module, ...]:
        """The router's gate where the router holds it without owning it (a transformers block's gate):
        its parameters train with the layer's and its hooks count as the layer's."""
        gate = getattr(self.router, "gate", None)
        if not isinstance(gate, nn.Module) or any(child is gate for child in self.router.children()):
            return ()
        return (gate,)

    def _differentiable(self, x: torch.Tensor) -> bool:
        """Whether a call on `x` builds an autograd graph (grad mode on, and `x` or a parameter requires grad)."""
        return self._trained_by(x) is not None

    def _trained_by(self, x: torch.Tensor, gate: tuple | None = None) -> tuple[nn.Parameter, ...] | None:
        """The parameters a call on `x` trains (the layer's and its router gate's, `gate` where the caller has
        `_router_gate()`; possibly none where `x` requires grad), or None where the call builds no autograd graph."""
        if not torch.is_grad_enabled():
            return None
        params = trainable(self, *(self._router_gate() if gate is None else gate))
        return params if x.requires_grad or params else None

    def _training_call(self, x_TH: torch.Tensor, transport: Any, gate: tuple | None = None) -> TrainingCall | None:
        """A call under autograd with anything to differentiate: the parameters that train (the layer's
        and its router gate's, `gate`: `_router_gate()` where the caller has it) and the transport's buffer
        generation (what a recorded backward needs); None otherwise."""
        gate = self._router_gate() if gate is None else gate
        params = self._trained_by(x_TH, gate)
        if params is None:
            return None
        if transport is None:
            return TrainingCall((self, *gate), lambda: None, params)

        def generation() -> int:  # read before a recorded backward runs: the step's last call settled first
            settle_step(transport)
            return transport.generation

        return TrainingCall((self, *gate), generation, params)

    def _tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(x as [T, H], the status of a wrong hidden size or dtype, 0 if neither: then no rows,
        and the error travels to every rank)."""
        status = self._input_status(x)
        if not status:
            return x.reshape(-1, self.hidden_size), 0
        if self.sync_free or self.num_ranks == 1:  # no exchange to carry the error: raise on this rank
            raise self._bad_input(x)
        return self.gate_up_proj.new_zeros((0, self.hidden_size)), status

    def _input_status(self, x: torch.Tensor) -> int:
        return input_status(x, self.hidden_size, self.gate_up_proj.dtype, self._step_bound())

    def _step_bound(self) -> int | None:
        """The token bound of the step agreement this layer's transport is in (`occult.moe.step`), else None."""
        if self.num_ranks == 1 or self.sync_free:
            return None
        return step_bound(self.dispatcher.transport)

    def _bad_input(self, x: torch.Tensor) -> ValueError:
        return bad_input_error(x, self.hidden_size, self.gate_up_proj.dtype, self._step_bound())

    # ------------------------------------------------------ dense <-> sharded
    @classmethod
    def from_dense(
        cls,
        dense: DenseMoE,
        placement: Placement | None = None,
        layer_index: int = 0,
        dispatcher: Any = None,
        group: Any = None,
        **kwargs: Any,
    ) -> OccultMoE:
        """Shard a full set of expert weights onto this rank by `placement` (default contiguous).
        `dispatcher` and `kwargs` as for the constructor (settings or `routing=` / `execution=`)."""
        ref = dense.gate_up_proj
        config = MoEConfig(dense.hidden_size, dense.ffn_size, dense.num_experts, dense.top_k, ref.dtype)
        routing = replace(kwargs.pop("routing", None) or RoutingConfig(), norm_topk_prob=dense.norm_topk_prob)
        if dispatcher is not None:
            kwargs["dispatcher"] = dispatcher
        layer = cls(
            config,
            routing=routing,
            placement=placement,
            layer_index=layer_index,
            group=group,
            device=ref.device,
            init_weights=False,
            **kwargs,
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
            self.hidden_size,
            self.ffn_size,
            self.num_experts,
            self.top_k,
            self.norm_topk_prob,
            dtype=self.gate_up_proj.dtype,
            device=self.gate_up_proj.device,
        )
        with torch.no_grad():
            dense.router.gate.weight.copy_(self.router.gate.weight)
            dense.gate_up_proj.copy_(gate_up)
            dense.down_proj.copy_(down)
        return dense

    def _transport_memory(self) -> str:
        """', transport_memory=X MiB' where the layer's group holds device-transport buffers on this rank."""
        held = getattr(getattr(self.dispatcher, "transport", None), "memory_bytes", None)
        return f", transport_memory={held / 2**20:.1f} MiB" if held is not None else ""

    def extra_repr(self) -> str:
        return (
            f"hidden={self.hidden_size}, ffn={self.ffn_size}, experts={self.num_experts} "
            f"({self.num_experts // self.num_ranks} on rank {self.rank} of {self.num_ranks}), "
            f"top_k={self.top_k}, dispatcher={self.dispatcher.name}, transport={self.dispatcher.transport_name}"
            + self._transport_memory()
            + (", graphs=True" if self.execution.graphs else "")
        )
