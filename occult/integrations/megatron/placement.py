"""Placements for Megatron-Core models: loading, which MoE layer a layer is, expert weights in placed order.

With a placement, local expert `j` of EP rank `r` in Megatron's experts module holds expert
`placement.experts_on_device(r)[j]` (the placed order: rank 0's experts in slot order, then rank
1's, ...), because Megatron's expert parallelism gives rank r the r-th contiguous block of experts.
Router columns, the expert bias and the aux-loss counts stay in the model's own expert order.

`to_placed_order` / `to_model_order` convert a full Megatron state dict with every expert local
(the keys of a model built with expert parallelism 1: `...mlp.experts.local_experts.{e}.*` of
`SequentialMLP`, `...mlp.experts.linear_fc1.weight{e}` of `TEGroupedMLP`, `...mlp.experts.weight1`
/ `weight2` of the legacy `GroupedMLP`) between the two orders. A distributed checkpoint of a
placed model stores expert `placed position` where Megatron's own model stores expert `id`.
`placed_local_experts` does the same for the state dicts of a running expert-parallel model: each
rank's contiguous experts become its placed ones (all-gathered over the EP group);
`model_order_local_experts` turns them back (a placed model's per-rank checkpoint -> what Megatron's
own `alltoall` model loads on that rank). `model_order_sharded_state_dict` points a placed model's
`sharded_state_dict()` (distributed checkpoints, `dist_checkpointing`) at each expert's model-order
index, so the checkpoint it saves is laid out as Megatron's own model's and it loads Megatron's.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from occult.integrations import placements
from occult.placement import Placement, PlacementError

# one expert's tensor: (prefix, layer number, expert index, rest of the key)
SEQUENTIAL_KEY = re.compile(
    r"^(?P<prefix>.*?layers\.)(?P<layer>\d+)(?P<mid>\.mlp\.experts\.local_experts\.)(?P<e>\d+)\."
)
TE_GROUPED_KEY = re.compile(
    r"^(?P<prefix>.*?layers\.)(?P<layer>\d+)(?P<mid>\.mlp\.experts\.linear_fc[12]\.(weight|bias))(?P<e>\d+)$"
)
# occult's GroupedLinear in a sharded state dict: all local experts in one sharded tensor
STACKED_KEY = re.compile(r"^.*?layers\.\d+\.mlp\.experts\.linear_fc[12]\.weight$")
# the legacy GroupedMLP: all local experts in one tensor, weight1 [H, E*2F] (columns), weight2 [E*F, H] (rows)
GROUPED_KEY = re.compile(r"^(?P<prefix>.*?layers\.)(?P<layer>\d+)\.mlp\.experts\.weight(?P<which>[12])$")


def load_placement(placement: str | Placement | None, num_experts: int, num_devices: int) -> Placement:
    """A `Placement` from a JSON path or object (None: Megatron's contiguous blocks), checked against the model."""
    return placements.load_placement(
        placement,
        num_experts,
        num_devices,
        framework="Megatron",
        experts_setting="num_moe_experts",
        ep_group="Megatron's expert-parallel group",
        ep_setting="expert_model_parallel_size",
    )


def moe_layer_pattern(config: Any) -> list[int]:
    """1 for each MoE layer of the decoder, 0 for each dense one (Megatron's `moe_layer_freq`)."""
    freq, num_layers = config.moe_layer_freq, config.num_layers
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(num_layers)]
    return list(freq)


def moe_layer_index(config: Any, layer_number: int | None) -> int:
    """Which MoE layer (0, 1, ...) Megatron's transformer layer `layer_number` (1-based) is; MTP layers count on."""
    if layer_number is None:
        return 0
    pattern = moe_layer_pattern(config)
    before = pattern[: layer_number - 1]
    return sum(before) + max(0, layer_number - 1 - len(pattern))


def _expert_positions(placement: Placement, layer: int, inverse: bool) -> list[int]:
    """new index of each old expert index: model id -> placed position (or back)."""
    position_E = placement.expert_device(layer) * placement.experts_per_device + placement.expert_slot(layer)
    if not inverse:
        return [int(p) for p in position_E]
    back = [0] * len(position_E)
    for e, p in enumerate(position_E):
        back[int(p)] = e
    return back


def _reorder(state_dict: Mapping[str, Any], placement: str | Placement, inverse: bool) -> dict[str, Any]:
    placement = placement if isinstance(placement, Placement) else Placement.load(placement)
    layers = sorted(
        {(m["prefix"], int(m["layer"])) for k in state_dict for m in [_match(k)] if m is not None},
        key=lambda b: (b[0], b[1]),
    )
    if placement.num_layers not in (1, len(layers)):
        raise PlacementError(
            f"the placement has {placement.num_layers} layers, but the state dict has {len(layers)} MoE layers"
        )
    index = {block: i if placement.num_layers > 1 else 0 for i, block in enumerate(layers)}
    out: dict[str, Any] = {}
    for key, value in state_dict.items():
        m = _match(key)
        if m is None:
            out[key] = value
            continue
        new_E = _expert_positions(placement, index[(m["prefix"], int(m["layer"]))], inverse)
        if "which" in m.groupdict():  # GroupedMLP: experts are blocks of one tensor
            t = torch.as_tensor(value)
            dim = 1 if m["which"] == "1" else 0
            blocks = t.chunk(placement.num_experts, dim=dim)
            order = [0] * len(new_E)
            for e, p in enumerate(new_E):
                order[p] = e
            out[key] = torch.cat([blocks[e] for e in order], dim=dim)
        else:
            e = int(m["e"])
            out[key[: m.start("e")] + str(new_E[e]) + key[m.end("e") :]] = value
    return out


def _match(key: str) -> re.Match | None:
    return SEQUENTIAL_KEY.match(key) or TE_GROUPED_KEY.match(key) or GROUPED_KEY.match(key)


def to_placed_order(state_dict: Mapping[str, Any], placement: str | Placement) -> dict[str, Any]:
    """A full Megatron state dict (every expert local, model order) with the experts in placed order.
    MoE layer i (the i-th decoder layer with expert weights, in layer order) uses the placement's
    layer i (or its only layer). Other keys are passed through."""
    return _reorder(state_dict, placement, inverse=False)


def to_model_order(state_dict: Mapping[str, Any], placement: str | Placement) -> dict[str, Any]:
    """The inverse of `to_placed_order`."""
    return _reorder(state_dict, placement, inverse=True)


def placed_local_experts(
    state_dict: Mapping[str, Any], placement: str | Placement, group: Any = None
) -> dict[str, Any]:
    """This rank's state dict of an EP model with Megatron's contiguous experts (rank r: experts r*L..r*L+L-1)
    -> the same keys holding this rank's placed experts (`placement.experts_on_device(rank)`).

    A collective over the EP `group`: call it on every rank. MoE layer i (in layer order) uses the
    placement's layer i (or its only layer); `SequentialMLP` and `TEGroupedMLP` keys."""
    return _move_local_experts(state_dict, placement, group, to_placed=True)


def model_order_local_experts(state_dict: Mapping[str, Any], placement: Placement, group: Any = None) -> dict[str, Any]:
    """The inverse of `placed_local_experts`: this rank's state dict of a placed EP model (what its
    `state_dict()` / a per-rank checkpoint holds) -> the same keys holding Megatron's contiguous experts
    (rank r: experts r*L..r*L+L-1), what a model with Megatron's own dispatcher loads on this rank.

    A collective over the EP `group` (same EP size as the placement): call it on every rank."""
    return _move_local_experts(state_dict, placement, group, to_placed=False)


def _move_local_experts(
    state_dict: Mapping[str, Any], placement: str | Placement, group: Any, to_placed: bool
) -> dict[str, Any]:
    """Gather each MoE layer's experts over the EP group and keep the ones this rank holds in the other layout."""
    placement = placement if isinstance(placement, Placement) else Placement.load(placement)
    rank = dist.get_rank(group)
    tensors: dict[tuple[str, str, int, str], dict[int, str]] = {}
    for key in state_dict:
        m = SEQUENTIAL_KEY.match(key) or TE_GROUPED_KEY.match(key)
        if m is not None and torch.is_tensor(state_dict[key]):
            stem = (key[: m.start("e")], key[m.end("e") :], int(m["layer"]), m["prefix"])
            tensors.setdefault(stem, {})[int(m["e"])] = key
    layers = sorted({(prefix, layer) for _, _, layer, prefix in tensors})
    if placement.num_layers not in (1, len(layers)):
        raise PlacementError(
            f"the placement has {placement.num_layers} layers, but the model has {len(layers)} MoE layers"
        )
    world = dist.get_world_size(group)
    local_counts = {len(keys) for keys in tensors.values()}
    if placement.num_devices != world or local_counts - {placement.experts_per_device}:
        raise PlacementError(
            f"the placement is for {placement.num_devices} EP ranks with {placement.experts_per_device} experts "
            f"each, but this state dict is one of {world} EP ranks with {sorted(local_counts)} local experts: "
            "convert with the placement the model was trained with, on every rank of its EP group"
        )
    out = dict(state_dict)
    # NCCL gathers device tensors: each parameter travels through the current GPU, one at a time
    via = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    for (_, _, layer, prefix), keys in sorted(tensors.items()):
        local = torch.stack([state_dict[keys[j]] for j in range(len(keys))])
        home = local.device
        local = local.to(via) if via is not None else local
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local.contiguous(), group=group)
        full = torch.cat(parts).to(home)  # rank r's block at r*L..: model order, or placed order if placed
        del parts, local
        index = layers.index((prefix, layer)) if placement.num_layers > 1 else 0
        if to_placed:
            wanted = placement.experts_on_device(rank, index)  # local slot j <- expert wanted[j] (model order)
        else:  # local slot j <- expert rank*L+j, found at its placed position
            position_E = _expert_positions(placement, index, inverse=False)
            wanted = [position_E[rank * len(keys) + j] for j in range(len(keys))]
        for j, e in enumerate(wanted):
            out[keys[j]] = full[int(e)].clone()
    return out


def model_order_sharded_state_dict(
    sharded_state_dict: Mapping[str, Any], placement: str | Placement, group: Any = None
) -> dict[str, Any]:
    """A placed model's `sharded_state_dict()` with every local expert at its model-order global index.

    Megatron's experts give local expert `j` of EP rank `r` the global index `r * L + j` in a
    distributed checkpoint (`dist_checkpointing`); in a placed model that slot holds expert
    `placement.experts_on_device(r)[j]`, so its entries are moved to that index (the expert axis of
    each `ShardedTensor`, `ShardedObject` and `ShardedTensorFactory`: the last one Megatron prepends).
    Saved through it, the checkpoint is Megatron's own layout (Megatron's `alltoall` model loads it
    as is); loaded through it, the placed model reads a checkpoint in that layout. No collective;
    `group` is the EP group (its rank and size are checked against the placement). `SequentialMLP` and
    `TEGroupedMLP` keys (occult's `GroupedLinear` experts are refused); MoE layer i (in layer order) uses the
    placement's layer i (or its only layer)."""
    placement = placement if isinstance(placement, Placement) else Placement.load(placement)
    stacked = [k for k in sharded_state_dict if STACKED_KEY.match(k)]
    if stacked:
        raise PlacementError(
            f"{stacked[0]}: occult's grouped experts (GroupedLinear) are one sharded tensor per layer, not one "
            "entry per expert: convert the placed model's per-rank state_dict() with model_order_local_experts"
        )
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    matches = {k: m for k in sharded_state_dict for m in [SEQUENTIAL_KEY.match(k) or TE_GROUPED_KEY.match(k)] if m}
    layers = sorted({(m["prefix"], int(m["layer"])) for m in matches.values()})
    if placement.num_layers not in (1, len(layers)):
        raise PlacementError(
            f"the placement has {placement.num_layers} layers, but the model has {len(layers)} MoE layers"
        )
    if placement.num_devices != world:
        raise PlacementError(f"the placement is for {placement.num_devices} EP ranks, but the EP group has {world}")
    out = dict(sharded_state_dict)
    for key, m in matches.items():
        index = layers.index((m["prefix"], int(m["layer"]))) if placement.num_layers > 1 else 0
        j = int(m["e"])
        if j >= placement.experts_per_device:
            raise PlacementError(f"{key}: local expert {j}, but the placement has {placement.experts_per_device}")
        slot = rank * placement.experts_per_device + j  # Megatron's global index for this local expert
        expert = int(placement.experts_on_device(rank, index)[j])
        out[key] = _at_expert(out[key], (slot, expert, placement.num_experts), key)
    return out


def _at_expert(entry: Any, move: tuple[int, int, int], key: str) -> Any:
    """`entry` (a ShardedTensor, ShardedObject or ShardedTensorFactory) moved from expert index `slot` to `expert`
    (`move`: slot, expert, experts), on the expert axis: the last prepended one, of global size `experts`."""
    if hasattr(entry, "build_fn"):  # a factory (GLU fc1): the tensors it builds are moved
        build = entry.build_fn

        def moved(*args, **kwargs):
            built = build(*args, **kwargs)
            if isinstance(built, Mapping):
                return {k: _at_expert(v, move, key) for k, v in built.items()}
            if isinstance(built, (list, tuple)):  # Megatron's SwiGLU factory: [w, v]
                return type(built)(_at_expert(v, move, key) for v in built)
            return _at_expert(built, move, key)

        return dataclasses.replace(entry, build_fn=moved)
    if not dataclasses.is_dataclass(entry) or not hasattr(entry, "global_offset"):
        raise PlacementError(f"{key}: {type(entry).__name__} is not a sharded tensor or object this can move")
    axis = entry.prepend_axis_num - 1 if hasattr(entry, "prepend_axis_num") else len(entry.global_offset) - 1
    slot, expert, experts = move
    if axis < 0 or entry.global_offset[axis] != slot or entry.global_shape[axis] != experts:
        raise PlacementError(
            f"{key}: expected expert {slot} of {experts} on the last prepended axis, but its global offset is "
            f"{entry.global_offset} of {entry.global_shape} (singleton_local_shards checkpoints are not converted)"
        )
    offset = (*entry.global_offset[:axis], expert, *entry.global_offset[axis + 1 :])
    return dataclasses.replace(entry, global_offset=offset)
