"""Placements for TorchTitan models: loading, and expert weights in placed order.

With a placement, a TorchTitan model's expert weight tensors (`GroupedExperts.w1_EFD`, `w2_EDF`,
`w3_EFD`, `[E, ...]`) hold the experts in *placed order* (`Placement.apply`: rank 0's experts in
slot order, then rank 1's, ...), because TorchTitan's expert parallelism cuts them into
contiguous blocks. The router's columns, the load-balancing bias and the per-expert token counts
stay in the model's own expert order. `to_placed_order` / `to_model_order` convert a full
(unsharded) TorchTitan state dict between the two, e.g. a converted Hugging Face checkpoint
before training with a placement, or a trained one before handing it back.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from occult.integrations import placements
from occult.placement import Placement, PlacementError

EXPERT_KEY = re.compile(r"^(?P<prefix>.*?)(?P<layer>\d+)\.moe\.routed_experts\.inner_experts\.(w1_EFD|w2_EDF|w3_EFD)$")


def load_placement(placement: str | Placement | None, num_experts: int, num_devices: int) -> Placement:
    """A `Placement` from a JSON path or object (None: contiguous), checked against the model."""
    return placements.load_placement(placement, num_experts, num_devices, framework="TorchTitan")


def _moe_layers(state_dict: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(prefix, block id) of every MoE block with expert weights, in order (MoE layer 0, 1, ...)."""
    blocks = {}
    for key in state_dict:
        m = EXPERT_KEY.match(key)
        if m:
            blocks[(m["prefix"], int(m["layer"]))] = None
    return [(p, str(i)) for p, i in sorted(blocks, key=lambda b: (b[0] != "layers.", b[0], b[1]))]


def _reorder(state_dict: Mapping[str, Any], placement: str | Placement, inverse: bool) -> dict[str, Any]:
    placement = placement if isinstance(placement, Placement) else Placement.load(placement)
    layers = _moe_layers(state_dict)
    if placement.num_layers not in (1, len(layers)):
        raise PlacementError(
            f"the placement has {placement.num_layers} layers, but the state dict has {len(layers)} MoE layers"
        )
    out = dict(state_dict)
    for i, (prefix, block) in enumerate(layers):
        layer = i if placement.num_layers > 1 else 0
        for name in ("w1_EFD", "w2_EDF", "w3_EFD"):
            key = f"{prefix}{block}.moe.routed_experts.inner_experts.{name}"
            if key in out:
                t = torch.as_tensor(out[key])
                out[key] = placement.invert(t, layer) if inverse else placement.apply(t, layer)
    return out


def to_placed_order(state_dict: Mapping[str, Any], placement: str | Placement) -> dict[str, Any]:
    """A full TorchTitan state dict (experts in the model's order) with the experts in placed order.
    MoE layer i (the i-th block with expert weights; `layers.*` before `mtp_layers.*`) uses the
    placement's layer i (or its only layer). Other keys are passed through."""
    return _reorder(state_dict, placement, inverse=False)


def to_model_order(state_dict: Mapping[str, Any], placement: str | Placement) -> dict[str, Any]:
    """The inverse of `to_placed_order`."""
    return _reorder(state_dict, placement, inverse=True)
