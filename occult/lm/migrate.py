"""Move experts between the ranks of an EP group while training: weights and AdamW state together.

`migrate(model, optimizer, new_placement, parallel)` gives every rank the experts `new_placement`
assigns it, in local-slot order, with their AdamW moments (`exp_avg`, `exp_avg_sq`, and any
other per-element state) and step counts, in ONE `all_to_all_single` over the EP group (one
per dtype when weights of several dtypes are trained): every (layer, expert) that changes rank
is one row of a flat buffer holding the expert's `gate_up_proj` and `down_proj` slices and
their state, and the step count of its tensors. Each replica group (the same EP rank in every
EP group) does the same exchange inside its own EP group, so all copies stay equal.

Parameters stay the same objects (the optimizer keeps working): their data are overwritten in
place, shapes unchanged. Afterwards every layer's `placement`, `expert_device_E`,
`expert_slot_E`, `local_expert_ids` and its router's device map follow the new placement; with
device-limited routing (`model.routing.max_devices`), the routing rule is re-set on the new
placement too (so the routed experts follow it, and the function changes as pruning intends).
With plain top-k routing the model computes the same function (up to the order of the per-device
sums of the dedup dispatch, i.e. the last bits).

`apply_placement(model, placement)` only re-labels (no data move): for a model about to load
weights by global expert id (resuming a checkpoint written after a migration).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from occult.lm.model import OccultLM
from occult.lm.parallel import Parallel, per_layer
from occult.placement import Placement, PlacementError

EXPERT_TENSORS = ("gate_up_proj", "down_proj")


@dataclass
class MigrationStats:
    """What one migration moved (this rank's view) and how long it took."""

    experts_moved: int  # (layer, expert) pairs that changed rank, over the whole EP group
    bytes_sent: int  # bytes this rank sent to other ranks
    seconds: float


def current_placement(model: OccultLM) -> Placement:
    """The expert -> rank map the model's MoE layers use now, one row per layer."""
    layers = model.moe_layers()
    rows = np.stack([m.expert_device_E.detach().cpu().numpy() for m in layers])
    return Placement(rows, layers[0].num_ranks)


def check_placement(model: OccultLM, placement: Placement) -> Placement:
    """`placement` with one row per MoE layer, or a `PlacementError` saying why it does not fit."""
    if not isinstance(placement, Placement):
        raise PlacementError(f"expected an occult.Placement, got {type(placement).__name__}")
    layers = model.moe_layers()
    E, D = model.config.num_experts, layers[0].num_ranks
    if placement.num_experts != E:
        raise PlacementError(f"the new placement is for {placement.num_experts} experts, the model has {E} per layer")
    if placement.num_devices != D:
        raise PlacementError(f"the new placement has {placement.num_devices} devices, the EP group {D} ranks")
    return per_layer(placement, len(layers))


def follow_routing(model: OccultLM, placement: Placement) -> None:
    """A device-limited routing rule re-set on `placement` (plain top-k routing is left alone)."""
    spec = model.routing
    if spec.max_devices is not None:
        model.set_routing(spec.max_devices, placement, spec.method, spec.similarity)


def apply_placement(model: OccultLM, placement: Placement) -> None:
    """Point every layer (and its router, and a device-limited routing rule) at `placement`.

    Moves no data: the local expert weights are then those of the old slots under new labels,
    so call it only before loading weights by global expert id (or after moving them).
    """
    placement = check_placement(model, placement)
    for i, m in enumerate(model.moe_layers()):
        dev_E, slot_E = placement.tensors(i, device=m.expert_device_E.device)
        m.placement = placement.layer(i)
        m.expert_device_E.copy_(dev_E)
        m.expert_slot_E.copy_(slot_E)
        m.local_expert_ids.copy_(torch.as_tensor(placement.experts_on_device(m.rank, i).copy()))
        if hasattr(m.router, "set_expert_device"):
            m.router.set_expert_device(m.expert_device_E)
    follow_routing(model, placement)


def _kinds(model: OccultLM, opt: torch.optim.Optimizer | None) -> list[list[tuple[torch.Tensor, torch.Tensor | None]]]:
    """Per layer: (per-expert tensor [E_local, ...], step tensor or None), weights then their state."""
    out = []
    for m in model.moe_layers():
        kinds: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        for attr in EXPERT_TENSORS:
            p = getattr(m, attr)
            kinds.append((p.data, None))
            state = opt.state.get(p, {}) if opt is not None else {}
            step = state.get("step")
            for key in sorted(state):
                v = state[key]
                if isinstance(v, torch.Tensor) and v.shape == p.shape:
                    kinds.append((v, step if isinstance(step, torch.Tensor) else None))
        out.append(kinds)
    return out


def _moves(old_E: np.ndarray, new_E: np.ndarray, rank: int, D: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Experts this rank sends to each rank, and receives from each, in ascending global id."""
    send = [np.flatnonzero((old_E == rank) & (new_E == d)) for d in range(D)]
    recv = [np.flatnonzero((old_E == s) & (new_E == rank)) for s in range(D)]
    return send, recv


def migrate(model: OccultLM, optimizer: torch.optim.Optimizer | None, new_placement: Placement,
            parallel: Parallel | None) -> MigrationStats:
    """Re-place the experts of every MoE layer by `new_placement` (see the module docstring).

    Every rank of the world calls it with the same placement. Expert gradients are dropped
    (migrate between steps). Raises `PlacementError` (on every rank alike) when the placement
    does not fit the model.
    """
    t0 = time.perf_counter()
    new = check_placement(model, new_placement)
    layers = model.moe_layers()
    D = layers[0].num_ranks
    group: Any = layers[0].dispatcher.group
    if parallel is not None and D != parallel.ep_size:
        raise PlacementError(f"the model's experts are over {D} ranks, the EP size is {parallel.ep_size}")
    old = current_placement(model)
    rank = layers[0].rank
    plans = [_moves(old.expert_device(i), new.expert_device(i), rank, D) for i in range(len(layers))]
    moved = int(sum((old.expert_device(i) != new.expert_device(i)).sum() for i in range(len(layers))))
    kinds = _kinds(model, optimizer)
    bytes_sent = 0
    if moved and D > 1:
        bytes_sent = _exchange(layers, kinds, plans, old, new, rank, D, group)
    for m in layers:
        for attr in EXPERT_TENSORS:
            getattr(m, attr).grad = None
    apply_placement(model, new)
    return MigrationStats(moved, bytes_sent, time.perf_counter() - t0)


def _exchange(layers, kinds, plans, old: Placement, new: Placement, rank: int, D: int, group: Any) -> int:
    """The all-to-all(s): rows [(layer, expert) that moves] x [weights | state | step], by dtype."""
    by_dtype: dict[torch.dtype, list[tuple[int, int]]] = {}  # dtype -> [(layer, kind index)]
    for i, ks in enumerate(kinds):
        for j, (t, _) in enumerate(ks):
            by_dtype.setdefault(t.dtype, []).append((i, j))
    sent = 0
    for dtype, members in by_dtype.items():
        carries_step = dtype in (torch.float32, torch.float64)
        per_layer_kinds = {i: [j for (li, j) in members if li == i] for i in range(len(layers))}
        row_len = {i: sum(kinds[i][j][0][0].numel() + (1 if carries_step else 0) for j in js)
                   for i, js in per_layer_kinds.items()}
        device = kinds[0][0][0].device

        def rows(i: int, slots: np.ndarray) -> torch.Tensor:
            idx = torch.as_tensor(slots, device=device, dtype=torch.long)
            parts = []
            for j in per_layer_kinds[i]:
                t, step = kinds[i][j]
                parts.append(t.index_select(0, idx).reshape(len(slots), -1))
                if carries_step:
                    s = float(step) if step is not None else -1.0
                    parts.append(torch.full((len(slots), 1), s, dtype=dtype, device=device))
            return torch.cat(parts, 1) if parts else torch.empty(len(slots), 0, dtype=dtype, device=device)

        old_slot = [old.expert_slot(i) for i in range(len(layers))]
        send_chunks, send_splits, recv_splits = [], [], []
        for d in range(D):
            n = 0
            for i, (send, recv) in enumerate(plans):
                if len(send[d]):
                    send_chunks.append(rows(i, old_slot[i][send[d]]).reshape(-1))
                n += len(send[d]) * row_len[i]
            send_splits.append(n)
            recv_splits.append(sum(len(recv[d]) * row_len[i] for i, (_, recv) in enumerate(plans)))
        flat = torch.cat(send_chunks) if send_chunks else torch.empty(0, dtype=dtype, device=device)
        out = flat.new_empty(sum(recv_splits))
        dist.all_to_all_single(out, flat, recv_splits, send_splits, group=group)
        sent += (sum(send_splits) - send_splits[rank]) * flat.element_size()
        _unpack(out, plans, kinds, per_layer_kinds, row_len, new, carries_step, D)
    return sent


def _unpack(out: torch.Tensor, plans, kinds, per_layer_kinds, row_len, new: Placement, carries_step: bool, D: int) -> None:
    """Write the received rows into their new local slots, tensor by tensor (in place)."""
    offset = 0
    fresh: dict[tuple[int, int], torch.Tensor] = {}
    for s in range(D):
        for i, (_, recv) in enumerate(plans):
            n = len(recv[s])
            if not n:
                continue
            block = out[offset : offset + n * row_len[i]].view(n, row_len[i])
            offset += n * row_len[i]
            slots = torch.as_tensor(new.expert_slot(i)[recv[s]], device=out.device, dtype=torch.long)
            col = 0
            for j in per_layer_kinds[i]:
                t, step = kinds[i][j]
                width = t[0].numel()
                if (i, j) not in fresh:
                    fresh[(i, j)] = t.clone()
                fresh[(i, j)].index_copy_(0, slots, block[:, col : col + width].reshape(n, *t.shape[1:]))
                col += width
                if carries_step:
                    got = block[:, col]
                    col += 1
                    want = float(step) if step is not None else -1.0
                    if not bool((got == want).all()):
                        raise RuntimeError(
                            f"layer {i}: experts arrived with AdamW step counts {sorted(set(got.tolist()))}, "
                            f"this rank's tensors are at step {want}: the ranks' optimizers are out of step")
    for (i, j), t in fresh.items():
        kinds[i][j][0].copy_(t)
