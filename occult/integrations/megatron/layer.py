"""`OccultMoELayer`: Megatron-Core's `MoELayer` with occult's token dispatcher (and, for `max_devices`, router).

Megatron's `MoELayer.__init__` picks its dispatcher from `moe_token_dispatcher_type` (allgather,
alltoall, flex; anything else is an error), so this subclass lets Megatron build its layer as
configured (keep `alltoall`) and then replaces the dispatcher by `OccultTokenDispatcher`. Router,
experts (`SequentialMLP`, `TEGroupedMLP`, `GroupedMLP`), shared experts, recomputation and the
forward are Megatron's own. `install` puts this class into a layer or block spec; its options
travel as the spec's `occult` parameter.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.moe.router import TopKRouter

from occult.integrations.megatron.dispatcher import OccultTokenDispatcher
from occult.integrations.megatron.options import OccultOptions
from occult.integrations.megatron.router import OccultRouter


class OccultMoELayer(MoELayer):
    """`MoELayer` whose token dispatcher is occult's (module docstring); `occult`: the options."""

    def __init__(self, *args: Any, occult: OccultOptions | None = None, **kwargs: Any) -> None:
        options = occult if occult is not None else OccultOptions()
        bound = inspect.signature(MoELayer.__init__).bind(self, *args, **kwargs)
        config, submodules = bound.arguments["config"], bound.arguments.get("submodules")
        if config.moe_token_dispatcher_type != "alltoall":
            raise ValueError(
                "occult replaces Megatron's token dispatcher: keep moe_token_dispatcher_type='alltoall' "
                f"(got {config.moe_token_dispatcher_type!r}) and switch occult on with "
                "occult.integrations.megatron.install(spec, ...)"
            )
        if options.max_devices is not None and submodules is not None:
            router = submodules.router
            if not (isinstance(router, type) and issubclass(router, TopKRouter)):
                raise ValueError(f"occult max_devices needs Megatron's TopKRouter in the MoE spec, found {router!r}")
            if not issubclass(router, OccultRouter):
                bound.arguments["submodules"] = dataclasses.replace(submodules, router=OccultRouter)
        super().__init__(*bound.args[1:], **bound.kwargs)
        pg_collection = bound.arguments.get("pg_collection") or get_default_pg_collection()
        self.token_dispatcher = OccultTokenDispatcher(
            self.num_local_experts, self.local_expert_indices, self.config, pg_collection, options
        )
        if hasattr(self, "_training_token_dispatcher"):  # 0.19 inference_optimized: forward swaps back to it
            self._training_token_dispatcher = self.token_dispatcher
        self.occult_options = options
        if self.use_shared_expert and self.shared_expert_overlap:
            self.token_dispatcher.set_shared_experts(self.shared_experts)  # refused with a clear error
        self.set_layer_number(self.layer_number)

    def set_layer_number(self, layer_number: int | None) -> None:
        """Megatron's layer number -> the router's and the dispatcher's placement layer."""
        if layer_number is not None:
            super().set_layer_number(layer_number)
        self.token_dispatcher.set_layer_number(layer_number)
        if self.occult_options.max_devices is not None:
            self.router.set_device_limit(self.occult_options.max_devices, self.token_dispatcher.expert_device_E())
