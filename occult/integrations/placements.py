"""The placement a framework integration (TorchTitan, Megatron-Core) is given: loaded and checked.

A framework's MoE layer takes its placement as a `Placement`, a JSON path, or None (the framework's
own contiguous blocks of experts). `load_placement` turns any of them into a `Placement` and checks
it against the layer, naming the framework's own settings in its errors; each integration's
`placement.py` calls it with those names.
"""

from __future__ import annotations

from occult.placement import Placement, PlacementError


def load_placement(
    placement: str | Placement | None,
    num_experts: int,
    num_devices: int,
    *,
    framework: str,
    experts_setting: str | None = None,
    ep_group: str | None = None,
    ep_setting: str | None = None,
) -> Placement:
    """A `Placement` from a JSON path or object (None: contiguous blocks), checked against the model.

    Its expert count must be `num_experts` ("this {framework} MoE layer has ..."); with `ep_group`
    (e.g. "Megatron's expert-parallel group") its device count must also be `num_devices`.
    `experts_setting` / `ep_setting` name the framework's config fields in those errors."""
    if placement is None:
        return Placement.contiguous(num_experts, num_devices)
    if not isinstance(placement, Placement):
        placement = Placement.load(placement)
    if placement.num_experts != num_experts:
        setting = f" ({experts_setting})" if experts_setting else ""
        raise PlacementError(
            f"the placement is for {placement.num_experts} experts, but this {framework} MoE layer has "
            f"{num_experts}{setting}: make a placement from a trace of this model (occult place)"
        )
    if ep_group is not None and placement.num_devices != num_devices:
        setting = f" ({ep_setting})" if ep_setting else ""
        raise PlacementError(
            f"the placement is for {placement.num_devices} devices, but {ep_group} has {num_devices} "
            f"ranks{setting}: make one with `occult place --devices {num_devices}`"
        )
    return placement
