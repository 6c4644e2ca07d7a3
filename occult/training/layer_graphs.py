"""A training run's MoE layers replayed from CUDA graphs (`occult train / finetune [--hf] --layer-graphs`:
`TrainConfig.layer_graphs`, `FinetuneConfig.layer_graphs`; the recordings are `occult.moe.graphs` and
`occult.moe.train_graphs`): the checks both adapters make before any step, and the switch for a run."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.nn as nn

from occult.moe.layer import OccultMoE
from occult.moe.model_layers import set_graphs
from occult.training.dtensor import is_sharded


def check_recordable(model: nn.Module) -> list[OccultMoE]:
    """`model`'s MoE layers where a CUDA graph can record their training calls, else a `ValueError` naming
    why: FSDP2 (it frees and gathers again the dense weights, the routers' among them, around every block:
    a recording would read memory they no longer hold), the count exchange (a host wait), not on a GPU."""
    layers = [m for m in model.modules() if isinstance(m, OccultMoE)]
    if any(is_sharded(p) for p in model.parameters()):
        raise ValueError(
            "layer_graphs (--layer-graphs) with grad_sync='fsdp': FSDP2 frees and gathers again the dense weights "
            "(the routers' among them) around every block, so a recorded call would read memory they no longer "
            "hold; use --grad-sync ddp or explicit"
        )
    waiting = [str(i) for i, layer in enumerate(layers) if layer.waits_for_gpu]
    if waiting:
        raise ValueError(
            f"layer_graphs (--layer-graphs): MoE layers {', '.join(waiting)} read their row counts on the host "
            "(--transport counts), which a CUDA graph cannot record; use --transport device (NCCL ranks of one host)"
        )
    if not layers or any(layer.gate_up_proj.device.type != "cuda" for layer in layers):
        raise ValueError(
            "layer_graphs (--layer-graphs) records CUDA graphs: it needs a CUDA device, the MoE layers on a GPU"
        )
    return layers


@contextlib.contextmanager
def replayed_layers(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Inside, `model`'s MoE layers replay their calls, training ones too, from CUDA graphs (after
    `check_recordable`); after, the layers' settings as they were and their graphs freed."""
    if not enabled:
        yield
        return
    layers = check_recordable(model)
    before = [layer.execution for layer in layers]
    set_graphs(model, True, training=True)
    try:
        yield
    finally:
        for layer, execution in zip(layers, before):
            layer.execution = execution
            layer.graphs.release()
