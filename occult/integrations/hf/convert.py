"""Make a transformers model expert-parallel in place (`convert`) and undo it (`unconvert`,
`hf_layout`); `occult.integrations.hf.save` writes it in the standard transformers layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn

from occult.integrations.hf.block import OccultMoeBlock, is_converted, moe_blocks
from occult.integrations.hf.families import (
    Family,
    UnsupportedModelError,
    check_block,
    check_transformers_version,
    group_size,
    model_family,
)
from occult.moe.config import ExecConfig, MoEConfig, RoutingConfig, merge_settings
from occult.moe.layer import OccultMoE
from occult.moe.status import check_routing
from occult.placement import Placement


def convert(
    model: nn.Module,
    group: Any = None,
    placement: Placement | str | None = None,
    dispatcher: Any = None,
    max_devices: int | None = None,
    *,
    routing: RoutingConfig | None = None,
    execution: ExecConfig | None = None,
    prune_method: str | None = None,
    similarity: Sequence[torch.Tensor] | torch.Tensor | None = None,
    expert_backend: str | None = None,
    expert_weights: Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> nn.Module:
    """Make `model` expert-parallel over `group` (default: the whole default group), in place.

    Every MoE block becomes an `OccultMoeBlock` whose `experts` hold only this rank's E/D
    experts, chosen and ordered by `placement` (a `Placement` with one layer per MoE layer or one for all, or
    its JSON path; default: contiguous). Routing is the model's own; `max_devices=N` limits
    each token to experts on N devices (collaboration pruning, approximate: fine-tune with it
    on), by `prune_method` "score" or "similarity" (then `similarity` holds one [E, E] matrix
    per MoE layer). Call on every rank, with the same full model loaded on each. With
    `expert_weights(i, local_ids) -> (gate_up_proj, down_proj)` this rank's experts of MoE layer i
    come from there instead (`load_sharded`: the blocks' own expert tensors are on the meta device).
    Settings as config objects: `routing` (`occult.RoutingConfig`: `max_devices`, `prune_method`;
    the model's own `norm_topk_prob` is kept) and `execution` (`occult.ExecConfig`: dispatcher,
    sync-free, expert backend, transport), or as the keywords above (default dedup, unpruned).
    """
    check_transformers_version()
    routing, execution = merge_settings(
        routing,
        execution,
        dispatcher=dispatcher,
        max_devices=max_devices,
        prune_method=prune_method,
        expert_backend=expert_backend,
    )
    family, blocks, shapes, placement = _checked_layers(model, group, placement, routing, similarity)
    for i, ((name, block), (E, k, H, F_)) in enumerate(zip(blocks, shapes)):
        ref = block.experts.gate_up_proj
        device = block.gate.weight.device if ref.is_meta else ref.device
        similarity_EE = None if similarity is None else torch.as_tensor(similarity[i], device=device)
        experts = OccultMoE(
            MoEConfig(H, F_, E, k, ref.dtype),
            routing=RoutingConfig(bool(getattr(block.gate, "norm_topk_prob", True))),
            execution=execution,
            placement=placement,
            layer_index=i,
            group=group,
            router=family.router(
                block.gate,
                max_devices=routing.max_devices,
                prune_method=routing.prune_method,
                similarity_EE=similarity_EE,
            ),
            device=device,
            init_weights=expert_weights is None,
        )
        ids = experts.local_expert_ids
        gate_up, down = (
            (block.experts.gate_up_proj[ids], block.experts.down_proj[ids])
            if expert_weights is None
            else expert_weights(i, ids)
        )
        with torch.no_grad():
            experts.gate_up_proj.copy_(gate_up)
            experts.down_proj.copy_(down)
        model.set_submodule(name, OccultMoeBlock(block, experts, family))
    model.occult_placement = placement
    if group_size(group)[0] == 1:  # one-rank layers report bad routing one layer late: the last layer's at the end
        model.occult_routing_check = model.register_forward_hook(_check_routing)
    return model


def _checked_layers(
    model: nn.Module,
    group: Any,
    placement: Placement | str | None,
    routing: RoutingConfig,
    similarity: Sequence[torch.Tensor] | torch.Tensor | None,
) -> tuple[Family, list[tuple[str, nn.Module]], list[tuple[int, int, int, int]], Placement]:
    """(family, MoE blocks, their (E, k, H, F) shapes, the placement for every layer) of a model
    `convert` can convert with these settings; a clear error for one it cannot."""
    if routing.max_nodes is not None:
        raise ValueError(
            "max_nodes (node-limited routing) is not supported for transformers models yet; "
            "use max_devices, or DeepSeek-V3's own group-limited routing (topk_group)"
        )
    max_devices = routing.max_devices
    family = model_family(model)
    if is_converted(model):
        raise ValueError("the model is already converted")
    blocks = moe_blocks(model)
    num_ranks, _ = group_size(group)
    shapes = [check_block(name, b, family) for name, b in blocks]
    E = shapes[0][0]
    if any(s[0] != E for s in shapes):
        raise UnsupportedModelError("MoE layers with different expert counts are not supported")
    if isinstance(placement, (str, bytes)) or hasattr(placement, "__fspath__"):
        placement = Placement.load(placement)
    if placement is None:
        placement = Placement.contiguous(E, num_ranks, len(blocks))
    placement = placement.for_layers(len(blocks))  # a one-layer placement serves every layer
    placement.check_fits(E, num_ranks, len(blocks))
    per_device, top_k = E // num_ranks, shapes[0][1]
    if max_devices is not None and max_devices * per_device < top_k:
        raise ValueError(
            f"max_devices={max_devices} devices hold {max_devices * per_device} experts ({per_device} per device), "
            f"fewer than top_k={top_k}: use max_devices >= {-(-top_k // per_device)}"
        )
    if similarity is not None and len(similarity) != len(blocks):
        raise ValueError(f"similarity holds {len(similarity)} matrices for {len(blocks)} MoE layers")
    return family, blocks, shapes, placement


def _check_routing(module: nn.Module, args: Any, output: Any) -> None:
    check_routing()


_check_routing.replay_safe = True  # a replayed step or call queues the statuses it makes and reads them itself


def _hf_blocks(model: nn.Module) -> list[tuple[str, OccultMoeBlock, nn.Module]]:
    """(name, converted block, rebuilt transformers block with all experts): a collective."""
    out = []
    for name, block in moe_blocks(model):
        if not isinstance(block, OccultMoeBlock):
            raise ValueError(f"{name} is not converted")
        dense = block.experts.to_dense()  # all-gathers every rank's experts, undoes the placement
        out.append((name, block, block.to_hf(model.config, dense.gate_up_proj.data, dense.down_proj.data)))
    return out


def unconvert(model: nn.Module) -> nn.Module:
    """Undo `convert` in place (a collective): the model's own blocks with all experts, id order."""
    for name, _, hf_block in _hf_blocks(model):
        model.set_submodule(name, hf_block)
    if hasattr(model, "occult_placement"):
        del model.occult_placement
    if hasattr(model, "occult_routing_check"):
        model.occult_routing_check.remove()
        del model.occult_routing_check
    return model


@contextlib.contextmanager
def hf_layout(model: nn.Module) -> Iterator[nn.Module]:
    """Temporarily put the model's own blocks (all experts, id order) back; a collective.

    Inside, `model` is a plain transformers model (e.g. for `save_pretrained` or a state dict);
    on exit the converted blocks, the very same parameter objects, return.
    """
    swapped = _hf_blocks(model)
    try:
        for name, _, hf_block in swapped:
            model.set_submodule(name, hf_block)
        yield model
    finally:
        for name, block, _ in swapped:
            model.set_submodule(name, block)
