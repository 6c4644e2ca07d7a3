"""occult: expert-parallel Mixture-of-Experts with deduplicated all-to-all.

Each token is sent once per *device* that holds any of its chosen experts (not once per
expert); co-activated experts are placed on the same device; optionally each token is limited
to N devices (collaboration pruning). See README.md and docs/design.md.
"""

from occult._rank_signals import ignore_interrupts_in_ranks

ignore_interrupts_in_ranks()  # first, before torch loads: a rank process leaves Ctrl-C to its parent

from occult.moe.comm import CommStats
from occult.moe.config import ExecConfig, MoEConfig, RoutingConfig
from occult.moe.contract import Capabilities, Dispatcher, Received, Schedule
from occult.moe.counts import RoutingError
from occult.moe.dense import DenseMoE
from occult.moe.dispatch import DedupDispatcher, StandardDispatcher
from occult.moe.expert_map import ExpertMap
from occult.moe.layer import OccultMoE
from occult.moe.model_layers import set_graphs, set_sync_free
from occult.moe.registry import DISPATCHERS, make_dispatcher
from occult.moe.routing import TopKRouter
from occult.moe.status import check_routing
from occult.moe.step import agreed_step
from occult.moe.symm import release_transports
from occult.moe.transport_buffers import TransportMemoryError
from occult.moe.two_level import TwoLevelDispatcher
from occult.placement import Placement, PlacementError

__version__ = "0.1.0"

__all__ = [
    "Capabilities",
    "CommStats",
    "DISPATCHERS",
    "ExecConfig",
    "ExpertMap",
    "MoEConfig",
    "Received",
    "RoutingConfig",
    "Schedule",
    "DedupDispatcher",
    "DenseMoE",
    "Dispatcher",
    "OccultMoE",
    "Placement",
    "PlacementError",
    "RoutingError",
    "StandardDispatcher",
    "TopKRouter",
    "TransportMemoryError",
    "TwoLevelDispatcher",
    "agreed_step",
    "check_routing",
    "make_dispatcher",
    "release_transports",
    "set_graphs",
    "set_sync_free",
]
