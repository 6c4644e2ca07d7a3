"""The dispatcher name table: `"standard"`, `"dedup"`, `"dedup2"` -> classes, and `make_dispatcher`."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from occult.moe.contract import Capabilities, Dispatcher
from occult.moe.dispatch import DedupDispatcher, StandardDispatcher
from occult.moe.two_level import TwoLevelDispatcher

DISPATCHERS: dict[str, type[Dispatcher]] = {
    "standard": StandardDispatcher,
    "dedup": DedupDispatcher,
    "dedup2": TwoLevelDispatcher,
}


def dispatcher_class(name: str | Dispatcher) -> type[Dispatcher]:
    """The class behind a dispatcher name (or a built dispatcher's class), with a clear error."""
    if isinstance(name, Dispatcher):
        return type(name)
    try:
        return DISPATCHERS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown dispatcher {name!r}; choose one of {sorted(DISPATCHERS)}") from None


def capabilities(name: str | Dispatcher) -> Capabilities:
    """What the named dispatcher honours (`Capabilities`): ask this instead of comparing names."""
    return dispatcher_class(name).capabilities


def _group_size(group: Any) -> int:
    if group is not None:
        return dist.get_world_size(group)
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def make_dispatcher(
    name: str | Dispatcher,
    group: Any = None,
    *,
    devices_per_node: int | None = None,
    placement: Any = None,
    transport: str = "auto",
) -> Dispatcher:
    """Build a dispatcher by name ("standard", "dedup" or "dedup2"), or check and return a built one.

    The node layout (G GPUs per node, ranks node-major) is `devices_per_node`, else that of
    `placement` (a `Placement` with `num_nodes` > 1 over as many devices as the group has ranks).
    Two-level dispatchers need it; the flat ones use it to split `CommStats` by link.
    `transport` ("auto", "device", "counts"): see `ExecConfig.transport`.
    """
    built = isinstance(name, Dispatcher)
    size = name.num_ranks if built else _group_size(group)
    placed = None
    if placement is not None and placement.num_nodes > 1:
        if placement.num_devices != size and not built and dispatcher_class(name).capabilities.two_level:
            raise ValueError(
                f"the placement has {placement.num_devices} devices on {placement.num_nodes} nodes "
                f"but the group has {size} ranks: give it one device per rank"
            )
        placed = placement.devices_per_node if placement.num_devices == size else None
    if built:
        if group is not None and name.group is not None and group is not name.group:
            raise ValueError("the dispatcher was built for another process group than the `group` given")
        if placed is not None and name.devices_per_node not in (None, placed):
            raise ValueError(
                f"the dispatcher has {name.devices_per_node} GPUs per node but the placement has "
                f"{placed} ({placement.num_nodes} nodes); make them agree"
            )
        return name
    cls = dispatcher_class(name)
    return cls(
        group, devices_per_node=devices_per_node if devices_per_node is not None else placed, transport=transport
    )
