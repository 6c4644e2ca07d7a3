"""Switching occult on in a Megatron-Core model spec: `install`.

`install(spec, dispatcher=..., placement=..., max_devices=..., transport=...)` walks a layer spec
(`get_gpt_layer_local_spec(...)`, `get_gpt_layer_with_transformer_engine_spec(...)`), a decoder
block spec (`get_gpt_decoder_block_spec(...)`: its `layer_specs`) or an MoE spec
(a `ModuleSpec` of `MoELayer` in 0.16, a `functools.partial` of it in 0.19) and makes every
`MoELayer` in it an `OccultMoELayer` with the options as its `occult` parameter. Call it on the
spec before the model is built (`GPTModel(config, transformer_layer_spec=spec, ...)`); the model config keeps
`moe_token_dispatcher_type="alltoall"`. Transformer layer `layer_number` uses the placement's
MoE layer counted by `moe_layer_freq` (one placement layer: every MoE layer uses it).

`use_grouped_experts(spec)` makes every MoE layer's experts Megatron's `TEGroupedMLP` over occult's
`GroupedLinear` (occult/integrations/megatron/experts.py): grouped GEMMs without Transformer Engine.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec

from occult.integrations.megatron.experts import GroupedLinear
from occult.integrations.megatron.layer import OccultMoELayer
from occult.integrations.megatron.options import OccultOptions
from occult.placement import Placement


def is_moe_layer(node: Any) -> bool:
    """A spec of an `MoELayer`: a `ModuleSpec` of it (0.16) or a `functools.partial` of it (0.19)."""
    module = node.module if isinstance(node, ModuleSpec) else node.func if isinstance(node, partial) else None
    return isinstance(module, type) and issubclass(module, MoELayer)


def moe_specs(spec: Any) -> list[tuple[Any, Any, Any]]:
    """(container, key, MoE layer spec) of every MoE layer spec inside `spec`, once each, in order."""
    found: list[tuple[Any, Any, Any]] = []
    seen: set[int] = set()

    def visit(container: Any, key: Any, node: Any) -> None:
        if id(node) in seen or node is None or isinstance(node, (str, int, float, bool, type)):
            return
        seen.add(id(node))
        if is_moe_layer(node):
            found.append((container, key, node))
            return
        if isinstance(node, list):
            for i, item in enumerate(node):
                visit(node, i, item)
        elif isinstance(node, ModuleSpec):
            visit(node, "submodules", node.submodules)
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
            for field in dataclasses.fields(node):
                visit(node, field.name, getattr(node, field.name))

    visit(None, None, spec)
    return found


def with_occult(node: Any, options: OccultOptions) -> Any:
    """The MoE layer spec `node` building `OccultMoELayer` with `options` instead."""
    if isinstance(node, ModuleSpec):
        node.module, node.params = OccultMoELayer, {**node.params, "occult": options}
        return node
    return partial(OccultMoELayer, *node.args, **{**node.keywords, "occult": options})


def install(
    spec: Any,
    *,
    dispatcher: str = "dedup",
    placement: str | Placement | None = None,
    max_devices: int | None = None,
    transport: str = "auto",
) -> int:
    """Put occult's dispatcher (and, with `max_devices`, router) into every MoE layer of `spec`; returns how many.

    `placement`: a JSON path or `occult.Placement` (None: Megatron's contiguous blocks); the expert
    weights must then be in placed order (`to_placed_order`). `max_devices`: limit each token to
    experts on that many EP ranks (collaboration pruning, approximate: fine-tune with it).
    `transport`: how rows travel, as `ExecConfig.transport` ("device": counts kept on the GPU, no
    host wait; NCCL GPUs of one host, an error elsewhere when the first batch is dispatched).
    Bad options raise `ValueError` (or `PlacementError`) here, before anything is built.
    """
    options = OccultOptions(dispatcher=dispatcher, placement=placement, max_devices=max_devices, transport=transport)
    found = moe_specs(spec)
    if not found:
        raise ValueError(
            f"{type(spec).__qualname__} has no MoELayer for occult's dispatcher: pass a spec built with "
            "num_experts (e.g. get_gpt_layer_local_spec(num_experts=...))"
        )
    rewrite(found, lambda node: with_occult(node, options), "install")
    return len(found)


def use_grouped_experts(spec: Any) -> int:
    """Make the experts of every MoE layer of `spec` Megatron's `TEGroupedMLP` over occult's `GroupedLinear` (one
    grouped GEMM per fc1 and fc2 for all local experts, no Transformer Engine needed); returns how many layers.

    For a local spec (`SequentialMLP`: one GEMM per expert), with Megatron's dispatcher or occult's (`install`, in
    either order). The state dict then has TEGroupedMLP's keys (`...experts.linear_fc1.weight{e}`): a
    SequentialMLP checkpoint loads after `to_grouped_expert_keys`."""
    found = moe_specs(spec)
    if not found:
        raise ValueError(
            f"{type(spec).__qualname__} has no MoELayer for occult's grouped experts: pass a spec built with "
            "num_experts (e.g. get_gpt_layer_local_spec(num_experts=...))"
        )
    rewrite(found, with_grouped_experts, "use_grouped_experts")
    return len(found)


def with_grouped_experts(node: Any) -> Any:
    """The MoE layer spec `node` with `TEGroupedMLP` over `GroupedLinear` as its experts."""
    from megatron.core.transformer.moe import experts as megatron_experts

    if isinstance(node, ModuleSpec):  # 0.16: TEGroupedMLP builds its linear layers from MLPSubmodules
        from megatron.core.transformer.mlp import MLPSubmodules

        grouped = MLPSubmodules(linear_fc1=GroupedLinear, linear_fc2=GroupedLinear)
        experts = ModuleSpec(module=megatron_experts.TEGroupedMLP, submodules=grouped)
        node.submodules = dataclasses.replace(node.submodules, experts=experts)  # a new one: it may be shared
        return node
    # 0.19: the protocols' builders, in GroupedMLPSubmodules; a new MoESubmodules (it may be shared)
    grouped = megatron_experts.GroupedMLPSubmodules(linear_fc1=GroupedLinear, linear_fc2=GroupedLinear)
    experts = partial(megatron_experts.TEGroupedMLP, submodules=grouped)
    submodules = dataclasses.replace(node.keywords["submodules"], experts=experts)
    return partial(node.func, *node.args, **{**node.keywords, "submodules": submodules})


def rewrite(found: list[tuple[Any, Any, Any]], change: Any, name: str) -> None:
    """Each found (container, key, MoE spec) -> `change(spec)`, put back into its container where it is new."""
    for container, key, node in found:
        new = change(node)
        if new is node:
            continue
        if container is None:
            raise ValueError(f"{name} changes a spec in place: pass the layer or block spec that holds the MoE spec")
        if isinstance(container, list):
            container[key] = new
        else:
            object.__setattr__(container, key, new)  # spec dataclasses may be frozen
