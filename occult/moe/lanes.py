"""A second lane of expert-parallel exchanges: two micro-batches of one model in flight at once.

Two micro-batches can only hide each other's all-to-alls if their exchanges are independent: on one
process group, NCCL runs every collective on the group's one stream in the order the host issued
them, so the second micro-batch's first dispatch would wait behind the first micro-batch's last
combine; on the device transport both would share receive buffers and barrier signals. A `Lane`
gives every expert-parallel layer of a model a second dispatcher over another process group of the
same ranks (its own communicator and transport buffers) and switches the layers to it while the
second micro-batch's forward is issued (`with lane.active(): ...`). The host still issues the two
forwards one after the other; what runs them side by side is the GPU, on two streams, inside one
captured graph (`occult.integrations.hf.GraphedForward(micro_batches=2)`).

Every rank builds its lane at the same point (new process groups are made collectively), and every
rank issues the two micro-batches in the same order. The lane's groups (and a device transport's
buffers for them) live until the process groups are destroyed (`occult.finish_distributed`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
import torch.nn as nn

from occult.moe.contract import Dispatcher
from occult.moe.layer import OccultMoE


class Lane:
    """Every expert-parallel `OccultMoE` of `model` with a second dispatcher over a group of its own
    (one new group per distinct group of the layers, same ranks). `active()` switches them in."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = [m for m in model.modules() if isinstance(m, OccultMoE) and m.num_ranks > 1]
        if not self.layers:
            raise ValueError("the model has no expert-parallel MoE layers (several ranks) to run a second lane of")
        twins: dict[Any, Any] = {}
        for layer in self.layers:  # in module order: the same on every rank
            group = layer.dispatcher.group
            if group not in twins:
                twins[group] = dist.new_group(dist.get_process_group_ranks(group))
        self.groups = list(twins.values())
        self.dispatchers: list[Dispatcher] = [
            layer.dispatcher_over(twins[layer.dispatcher.group]) for layer in self.layers
        ]

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The layers' calls go through this lane's dispatchers inside the block; theirs again after."""
        own = [layer.dispatcher for layer in self.layers]
        for layer, dispatcher in zip(self.layers, self.dispatchers):
            layer.dispatcher = dispatcher
        try:
            yield
        finally:
            for layer, dispatcher in zip(self.layers, own):
                layer.dispatcher = dispatcher
