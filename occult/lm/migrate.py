"""Move experts between the ranks of an EP group while training: weights and AdamW state together.

`migrate(model, optimizer, new_placement, parallel)` gives every rank the experts `new_placement`
assigns it, in local-slot order, with their AdamW moments (`exp_avg`, `exp_avg_sq`, and any
other per-element state) and step counts, in ONE `all_to_all_single` over the EP group (one
per dtype when weights of several dtypes are trained, and one per bucket of layers when the
moving rows exceed `bucket_bytes` per rank, to bound the extra memory): every (layer, expert)
that changes rank is one row of a flat buffer holding the expert's `gate_up_proj` and
`down_proj` slices and their state, and the step count of its tensors (checked: a step count is
per tensor, equal on every rank). Each replica group (the same EP rank in every
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
BUCKET_BYTES = 1 << 30  # moving rows per rank per all-to-all (more layers are split over several)


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


def migrate(
    model: OccultLM,
    optimizer: torch.optim.Optimizer | None,
    new_placement: Placement,
    parallel: Parallel | None,
    bucket_bytes: int = BUCKET_BYTES,
) -> MigrationStats:
    """Re-place the experts of every MoE layer by `new_placement` (see the module docstring).

    Every rank of the world calls it with the same placement. Layers whose placement is unchanged
    are skipped; the others travel in as few all-to-alls as keep each rank's send buffer near
    `bucket_bytes` (one in total for a small model). Expert gradients are dropped
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
    bytes_sent, problems = 0, []
    if moved and D > 1:
        bytes_sent, problems = _exchange(kinds, plans, old, new, rank, D, group, bucket_bytes)
    for m in layers:
        for attr in EXPERT_TENSORS:
            getattr(m, attr).grad = None
    apply_placement(model, new)
    if problems:  # after every collective, so no rank is left waiting
        raise RuntimeError("the ranks' optimizers are out of step: " + "; ".join(problems[:3]))
    return MigrationStats(moved, bytes_sent, time.perf_counter() - t0)


def _buckets(moved_L: list[int], row_bytes_L: list[int], D: int, bucket_bytes: int) -> list[list[int]]:
    """Layers that change, grouped so each group's moving rows stay near `bucket_bytes` per rank.

    Computed from the placements alone, so every rank forms the same groups (the same collectives)."""
    out: list[list[int]] = []
    size = 0
    for i, (n, b) in enumerate(zip(moved_L, row_bytes_L)):
        if not n:
            continue
        if out and size + n * b / D <= bucket_bytes:
            out[-1].append(i)
            size += n * b / D
        else:
            out.append([i])
            size = n * b / D
    return out


def _exchange(
    kinds, plans, old: Placement, new: Placement, rank: int, D: int, group: Any, bucket_bytes: int
) -> tuple[int, list[str]]:
    """The all-to-all(s): rows [(layer, expert) that moves] x [weights | state | step], one per dtype
    and bucket of layers. Returns (bytes sent to other ranks, step-count mismatches)."""
    L = len(plans)
    moved_L = [int((old.expert_device(i) != new.expert_device(i)).sum()) for i in range(L)]
    row_bytes_L = [sum(t[0].numel() * t.element_size() for t, _ in kinds[i]) for i in range(L)]
    dtypes = sorted({t.dtype for ks in kinds for t, _ in ks}, key=str)
    sent, problems = 0, []
    for layers in _buckets(moved_L, row_bytes_L, D, bucket_bytes):
        for dtype in dtypes:
            carries_step = dtype in (torch.float32, torch.float64)
            members = {i: [j for j, (t, _) in enumerate(kinds[i]) if t.dtype == dtype] for i in layers}
            row_len = {i: sum(kinds[i][j][0][0].numel() + carries_step for j in js) for i, js in members.items()}
            device = kinds[layers[0]][0][0].device
            chunks, send_splits, recv_splits = [], [], []
            for d in range(D):
                for i in layers:
                    slots = plans[i][0][d]
                    if len(slots):
                        chunks.append(_rows(kinds[i], members[i], old.expert_slot(i)[slots], dtype, carries_step))
                send_splits.append(sum(len(plans[i][0][d]) * row_len[i] for i in layers))
                recv_splits.append(sum(len(plans[i][1][d]) * row_len[i] for i in layers))
            flat = torch.cat(chunks) if chunks else torch.empty(0, dtype=dtype, device=device)
            out = flat.new_empty(sum(recv_splits))
            dist.all_to_all_single(out, flat, recv_splits, send_splits, group=group)
            sent += (sum(send_splits) - send_splits[rank]) * flat.element_size()
            problems += _unpack(out, plans, kinds, members, row_len, new, carries_step, layers, D)
    return sent, problems


def _rows(kinds, js: list[int], slots: np.ndarray, dtype: torch.dtype, carries_step: bool) -> torch.Tensor:
    """The flat rows of the experts in `slots` (a copy): each kind's slice, then its step count."""
    device = kinds[0][0].device
    idx = torch.as_tensor(slots, device=device, dtype=torch.long)
    parts = []
    for j in js:
        t, step = kinds[j]
        parts.append(t.index_select(0, idx).reshape(len(slots), -1))
        if carries_step:
            parts.append(
                torch.full((len(slots), 1), float(step) if step is not None else -1.0, dtype=dtype, device=device)
            )
    return torch.cat(parts, 1).reshape(-1)


def _unpack(
    out: torch.Tensor, plans, kinds, members, row_len, new: Placement, carries_step: bool, layers: list[int], D: int
) -> list[str]:
    """Write the received rows into their new local slots, in place (every row sent was copied
    out before the exchange). Returns the step-count mismatches found."""
    offset, problems = 0, []
    for s in range(D):
        for i in layers:
            recv = plans[i][1][s]
            n = len(recv)
            if not n:
                continue
            block = out[offset : offset + n * row_len[i]].view(n, row_len[i])
            offset += n * row_len[i]
            slots = torch.as_tensor(new.expert_slot(i)[recv], device=out.device, dtype=torch.long)
            col = 0
            for j in members[i]:
                t, step = kinds[i][j]
                width = t[0].numel()
                t.index_copy_(0, slots, block[:, col : col + width].reshape(n, *t.shape[1:]))
                col += width
                if carries_step:
                    want = float(step) if step is not None else -1.0
                    if not bool((block[:, col] == want).all()):
                        problems.append(
                            f"layer {i}: experts from rank {s} arrived with AdamW step counts "
                            f"{sorted(set(block[:, col].tolist()))}, this rank's are at {want}"
                        )
                    col += 1
    return problems
