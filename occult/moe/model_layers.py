"""Switches and questions over every MoE layer of a model: replayed from CUDA graphs, sync-free, which layers a
CUDA graph cannot record, which two interleaved micro-batches cannot run."""

from __future__ import annotations

from dataclasses import replace

import torch.nn as nn

from occult.moe.layer import OccultMoE


def uncapturable_layers(module: nn.Module) -> list[str]:
    """Names of the `OccultMoE` layers inside `module` whose exchanges a CUDA graph cannot record (a gloo
    group: its collectives run on the host, and capturing one breaks the process's CUDA state)."""
    return [name for name, m in module.named_modules() if isinstance(m, OccultMoE) and not m.dispatcher.capturable]


def set_graphs(module: nn.Module, enabled: bool = True, training: bool = False) -> int:
    """Switch every `OccultMoE` inside `module` to (or from) forwards replayed from CUDA graphs
    (`ExecConfig.graphs`; `training`: calls under autograd too, `ExecConfig.train_graphs`); returns how
    many. Switching off frees their graphs."""
    layers = [m for m in module.modules() if isinstance(m, OccultMoE)]
    for layer in layers:
        layer.execution = replace(layer.execution, graphs=enabled, train_graphs=enabled and training)
        if not enabled:
            layer.graphs.release()
    return len(layers)


def set_sync_free(module: nn.Module, enabled: bool = True) -> int:
    """Switch every `OccultMoE` inside `module` to (or from) sync-free dispatch; returns how many."""
    layers = [m for m in module.modules() if isinstance(m, OccultMoE)]
    for layer in layers:
        layer.sync_free = enabled
    return len(layers)


def exchanging_with_buffers(module: nn.Module) -> list[str]:
    """The names of the expert-parallel `OccultMoE` layers inside `module` that are not sync-free (their exchanges
    go through a group's shared buffers or a host wait): what two interleaved micro-batches cannot run."""
    return [n for n, m in module.named_modules() if isinstance(m, OccultMoE) and m.num_ranks > 1 and not m.sync_free]
