"""Settings of one MoE layer as three config objects, each validated once with a clear error.

- `MoEConfig`: what the layer computes (sizes, experts, top-k, dtype);
- `RoutingConfig`: how the built-in router chooses experts (`norm_topk_prob`, collaboration
  pruning `max_devices` / `max_nodes`, `prune_method`, the similarity table);
- `ExecConfig`: how it runs (dispatcher, sync-free, expert backend, transport).

`OccultMoE`, `hf.convert`, `hf.load_sharded`, the CLI and the benchmarks pass these objects;
`configs_from_keywords` maps the older keyword form (`OccultMoE(2048, 1024, 64, 8, dispatcher=...)`)
onto them, so users' code keeps working.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

PRUNE_METHODS = ("score", "similarity", "mass")  # occult.moe.pruning.METHODS
EXPERT_BACKENDS = ("auto", "torch", "triton")
TRANSPORTS = ("auto", "device", "counts", "host")


def _positive(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1{' or None' if allow_none else ''}, got {value!r}")


@dataclass(frozen=True)
class MoEConfig:
    """What a MoE layer computes: `num_experts` SwiGLU experts of `hidden_size` -> `ffn_size` -> `hidden_size`,
    `top_k` of them per token; parameters in `dtype` (None: torch's default)."""

    hidden_size: int
    ffn_size: int
    num_experts: int
    top_k: int
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "ffn_size", "num_experts", "top_k"):
            _positive(name, getattr(self, name))
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) cannot exceed num_experts ({self.num_experts})")
        if self.dtype is not None and not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"dtype must be a torch.dtype or None, got {self.dtype!r}")


@dataclass(frozen=True)
class RoutingConfig:
    """How the built-in router (`TopKRouter`) chooses a token's experts.

    `norm_topk_prob` renormalises the top-k gate weights to sum to 1. `max_devices=N` limits
    every token to experts on at most N devices (collaboration pruning, approximate: fine-tune
    with it on), `max_nodes=M` to at most M nodes of `devices_per_node` GPUs (DeepSeek-V3's
    node-limited routing). `prune_method` "score" keeps the top-k among the allowed devices'
    experts; "similarity" replaces each dropped expert by its most similar allowed one and needs
    `similarity_EE` (`occult.moe.pruning.expert_similarity`; transformers models take one per
    layer: `hf.convert(..., similarity=[...])`).
    """

    norm_topk_prob: bool = False
    max_devices: int | None = None
    max_nodes: int | None = None
    devices_per_node: int | None = None
    prune_method: str = "score"
    similarity_EE: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        _positive("max_devices", self.max_devices, allow_none=True)
        _positive("max_nodes", self.max_nodes, allow_none=True)
        _positive("devices_per_node", self.devices_per_node, allow_none=True)
        if self.max_nodes is not None and self.devices_per_node is None:
            raise ValueError("max_nodes needs devices_per_node (GPUs per node; the node of device d is d // it)")
        if self.prune_method not in PRUNE_METHODS:
            raise ValueError(f"prune_method must be one of {PRUNE_METHODS}, got {self.prune_method!r}")

    @property
    def limited(self) -> bool:
        """Whether tokens are limited to a number of devices or nodes (collaboration pruning)."""
        return self.max_devices is not None or self.max_nodes is not None


@dataclass(frozen=True)
class ExecConfig:
    """How a MoE layer runs; none of it changes the function computed.

    `dispatcher`: "dedup" (one copy per device), "standard" (one per expert), "dedup2" (one per
    node, then per GPU; needs a node layout), or a built `Dispatcher`. `sync_free`: fixed-capacity
    plans, no host wait (CUDA-graph capturable; every rank passes the same token count).
    `expert_backend`: "auto" (Triton on GPUs), "torch" or "triton". `transport`: how the all-to-alls learn their sizes,
    chosen once when the layer is built: "counts" (the count exchange: one host wait a call),
    "device" (counts kept on the GPU, no host wait: NCCL groups of one host, peer-mapped symmetric memory;
    an error elsewhere), "host" (sizes as "counts", or none when sync-free; rows through shared pinned host memory
    by the GPUs' copy engines, `occult.moe.host_wire`: NCCL GPUs of one host without peer-to-peer, where NCCL's
    copy kernels are slower and take SMs; an error elsewhere) or "auto" (the device transport for the dedup
    dispatchers on NCCL GPUs of one host with peer-to-peer on, else the count exchange:
    `occult.moe.symm.choose_transport`).
    `graphs`: replay each forward signature (token counts, dtype) from a CUDA graph of the layer
    (`occult.moe.graphs`): a call's host cost becomes a copy in, one graph launch and a copy out.
    Inference on GPUs where the layer does not wait for the GPU (device transport, sync-free, one
    rank); elsewhere the layer runs eagerly. `train_graphs` (with `graphs`): under autograd too, the
    forward and its backward recorded and replayed (`occult.moe.train_graphs`); off, a training call
    runs eagerly. Experimental: docs/training.md, "Layer graphs in training", says where it failed.
    `sync_free_capacity` (0 < c <= 1; the dedup dispatcher, sync-free calls): each other rank's block of the
    fixed-capacity exchange holds ceil(c x T) rows (and a header row) instead of T, so that what placement and pruning
    save reaches the wire (a sync-free exchange sends its whole block, used or not). A token's copy past its block is
    dropped and reported by `check_routing()` after the call as a `RoutingError` naming that rank, on every rank
    (the blocks' header rows carry it; docs/overlap.md, "Bounded sync-free blocks");
    1.0, the default, is exact at any routing. Set it from the routing the layer will see (e.g. `occult place`'s
    report) with a margin.
    """

    dispatcher: Any = "dedup"
    sync_free: bool = False
    sync_free_capacity: float = 1.0
    expert_backend: str = "auto"
    transport: str = "auto"
    graphs: bool = False
    train_graphs: bool = False

    def __post_init__(self) -> None:
        if self.expert_backend not in EXPERT_BACKENDS:
            raise ValueError(f"expert_backend must be one of {EXPERT_BACKENDS}, got {self.expert_backend!r}")
        if not isinstance(self.sync_free, bool):
            raise ValueError(f"sync_free must be True or False, got {self.sync_free!r}")
        if not isinstance(self.graphs, bool):
            raise ValueError(f"graphs must be True or False, got {self.graphs!r}")
        if not isinstance(self.train_graphs, bool):
            raise ValueError(f"train_graphs must be True or False, got {self.train_graphs!r}")
        if self.train_graphs and not self.graphs:
            raise ValueError("train_graphs=True needs graphs=True (training calls are replayed from the same graphs)")
        capacity = self.sync_free_capacity
        if isinstance(capacity, bool) or not isinstance(capacity, (int, float)) or not 0 < capacity <= 1:
            raise ValueError(f"sync_free_capacity must be a number in (0, 1], got {capacity!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")


_MOE_POSITIONAL = ("hidden_size", "ffn_size", "num_experts", "top_k")
_ROUTING_KEYS = {f.name for f in fields(RoutingConfig)}
_EXEC_KEYS = {f.name for f in fields(ExecConfig)}


def configs_from_keywords(
    config: MoEConfig | int | None,
    positional: tuple,
    keywords: dict[str, Any],
    routing: RoutingConfig | None,
    execution: ExecConfig | None,
) -> tuple[MoEConfig, RoutingConfig, ExecConfig]:
    """(MoEConfig, RoutingConfig, ExecConfig) from a config object or the keyword form.

    The keyword form is `(hidden_size, ffn_size, num_experts, top_k, **keywords)` with the
    fields of the three configs as keywords (`dtype`, `norm_topk_prob`, `max_devices`,
    `dispatcher`, `sync_free`, ...); a keyword may not also be set by a config object given.
    """
    keywords = dict(keywords)
    if not isinstance(config, MoEConfig):
        values = (config, *positional) if config is not None else positional
        if len(values) > len(_MOE_POSITIONAL):
            raise TypeError(
                f"expected at most {len(_MOE_POSITIONAL)} positional sizes {_MOE_POSITIONAL}, got {len(values)}"
            )
        sizes = dict(zip(_MOE_POSITIONAL, values))
        for name in _MOE_POSITIONAL:
            if name in keywords:
                if name in sizes:
                    raise TypeError(f"{name} given twice (positionally and as a keyword)")
                sizes[name] = keywords.pop(name)
        missing = [n for n in _MOE_POSITIONAL if n not in sizes]
        if missing:
            raise TypeError(f"missing the layer's sizes {missing}: pass a MoEConfig or {_MOE_POSITIONAL}")
        config = MoEConfig(**sizes, dtype=keywords.pop("dtype", None))
    elif positional:
        raise TypeError("sizes given both as a MoEConfig and positionally")
    routing = _merge(routing or RoutingConfig(), keywords, _ROUTING_KEYS, "routing")
    execution = _merge(execution or ExecConfig(), keywords, _EXEC_KEYS, "execution")
    if keywords:
        raise TypeError(f"unknown MoE layer settings {sorted(keywords)}; see MoEConfig, RoutingConfig and ExecConfig")
    return config, routing, execution


def _merge(base: Any, keywords: dict[str, Any], keys: set[str], name: str) -> Any:
    """`base` with the keywords named in `keys` applied (and removed from `keywords`)."""
    chosen = {k: keywords.pop(k) for k in list(keywords) if k in keys}
    if not chosen:
        return base
    default = type(base)()
    clash = [
        k for k in chosen if getattr(base, k) is not getattr(default, k) and getattr(base, k) != getattr(default, k)
    ]
    if clash:
        raise TypeError(f"{clash} set both in the {name} config and as keywords; set them in one place")
    return replace(base, **chosen)


def merge_settings(
    routing: RoutingConfig | None, execution: ExecConfig | None, **keywords: Any
) -> tuple[RoutingConfig, ExecConfig]:
    """(RoutingConfig, ExecConfig) from config objects and the keyword form of an API that takes
    both (`hf.convert(..., dispatcher=..., max_devices=...)`); keywords given as None are unset."""
    given = {k: v for k, v in keywords.items() if v is not None}
    routing = _merge(routing or RoutingConfig(), given, _ROUTING_KEYS, "routing")
    execution = _merge(execution or ExecConfig(), given, _EXEC_KEYS, "execution")
    if given:
        raise TypeError(f"unknown MoE settings {sorted(given)}; see RoutingConfig and ExecConfig")
    return routing, execution
