"""occult inside Megatron-Core (0.16.1 on Python 3.11, 0.19.2 on the GPU image): a token dispatcher switched on
by one call on the model spec.

- `OccultTokenDispatcher` (a Megatron `MoETokenDispatcher`): occult's deduplicated all-to-all (one
  row per token and EP rank), expanded to expert-major rows for Megatron's own experts
  (`SequentialMLP`, `TEGroupedMLP`, `GroupedMLP`), pre-reduced per (token, rank) before the combine.
- `OccultMoELayer`: Megatron's `MoELayer` with that dispatcher (and `OccultRouter` for `max_devices`).
- `OccultRouter`: Megatron's `TopKRouter` with occult's collaboration pruning (`max_devices`).
- `install(spec, ...)`: all of it into every MoE layer of a layer or block spec, before the model is built.
- `GroupedLinear`, `use_grouped_experts(spec)`: Megatron's `TEGroupedMLP` without Transformer Engine, all local
  experts' fc1 (and fc2) as one grouped GEMM; `to_grouped_expert_keys` / `to_sequential_expert_keys` rename
  expert weights between its state-dict keys and `SequentialMLP`'s.
- `to_placed_order` / `to_model_order`: expert weights of a full state dict for a placement.
- `RoutingTrace`: a model's routing recorded through its own routers, for `occult place`.

Import it explicitly (it imports Megatron-Core); docs/integrations.md has the recipe.
"""

from occult.integrations.megatron.dispatcher import OccultTokenDispatcher
from occult.integrations.megatron.expert_keys import to_grouped_expert_keys, to_sequential_expert_keys
from occult.integrations.megatron.experts import GroupedLinear
from occult.integrations.megatron.install import install, use_grouped_experts
from occult.integrations.megatron.layer import OccultMoELayer
from occult.integrations.megatron.options import OccultOptions
from occult.integrations.megatron.placement import load_placement, to_model_order, to_placed_order
from occult.integrations.megatron.router import OccultRouter
from occult.integrations.megatron.trace import RoutingTrace

__all__ = [
    "GroupedLinear",
    "OccultTokenDispatcher",
    "OccultMoELayer",
    "OccultOptions",
    "OccultRouter",
    "RoutingTrace",
    "install",
    "use_grouped_experts",
    "to_grouped_expert_keys",
    "to_sequential_expert_keys",
    "load_placement",
    "to_placed_order",
    "to_model_order",
]
