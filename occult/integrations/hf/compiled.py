"""`compile_layers`: torch.compile a transformers model's decoder layers around its MoE blocks.

A decoder layer's dense part (RMSNorms, q/k norms, rotary embedding, residual adds; tens of
small memory-bound kernels) costs more GPU time than its attention matmuls at OLMoE's shape and
dominates a decode step's launches. Inductor fuses it. Where every MoE layer is one-rank (one
GPU, data-parallel replicas) and on a GPU, the MoE block is traced with its layer for training- and
prefill-sized calls: one graph per decoder layer, router and routing fused with the dense part, no eager
host work between its halves (decode-sized calls keep the eager block, as measured for captured decode). An
expert-parallel MoE block stays eager (its forward is excluded from tracing: it exchanges with other
ranks), so each decoder layer compiles to the graph before the MoE block and the one after it.
(A whole converted model can also be given to `torch.compile` directly, MoE blocks traced:
docs/history.md, "torch.compile on the decode path".)

Decoder layers share one class and one forward, and torch.compile treats module parameters as
inputs, so the layers share compiled graphs where nothing else differs. With a KV cache each
layer reads its own cache slot (`layer_idx`), which specialises a graph per layer: the helper
raises Dynamo's recompile limit to fit every layer for 16 shapes (a process-wide setting) instead
of letting layers past the limit fall back to eager silently. Each new shape compiles again
(`dynamic=False` by default: the fastest code for fixed serving shapes; pass `dynamic=True` or
pad prompts to a few lengths where they vary).

Works on plain and converted models; every rank compiles its own copy (no collectives here).

Expert-parallel MoE layers that do not wait for the GPU (the device transport, `"auto"`'s choice on
NCCL GPUs of one host, or sync-free) are also switched to calls replayed from their own CUDA
graphs (`ExecConfig(graphs=True)`, `occult.moe.graphs`; `layer_graphs=False` leaves them): with the
dense part compiled, their ~2-3 ms of host time a call was what remained (on 2 x H200 a Qwen3-shape
prefill went from 32.7 to 23.5 ms, docs/history.md "Layer graphs"). `train_graphs=True` replays their
training calls too, forward and backward (`occult.moe.train_graphs`; opt-in: on 2 x H200 over NVLink an
OLMoE-shape training step runs at 0.974x the replicated floor with them, against about 1.04x without; on
4 GPUs and on a slow link they gain nothing: docs/training.md "Layer graphs in training"). One-rank
layers stay as they are: their host cost is already small.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn as nn

from occult.integrations.hf.block import OccultMoeBlock
from occult.moe.layer import OccultMoE


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers (`model.model.layers` in every supported family)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise ValueError(f"{type(model).__name__} has no `model.layers` list of decoder layers to compile")
    return list(layers)


def compile_layers(
    model: nn.Module,
    layer_graphs: bool = True,
    train_graphs: bool = False,
    trace_moe: bool | None = None,
    **compile_kwargs: Any,
) -> int:
    """Compile every decoder layer of `model` in place (`nn.Module.compile(**compile_kwargs)`, default
    `dynamic=False`); returns how many. Call after `convert`.
    `layer_graphs`: also replay the expert-parallel MoE layers that do not wait for the GPU from
    their CUDA graphs (module docstring); `train_graphs`: their training calls too, forward and
    backward (opt-in). `trace_moe`: the MoE blocks traced into their decoder layer's graph (no graph
    break, no eager host work between the layer's halves; a traced layer still reports bad routing,
    and its `last_comm_stats` book the backward's rows with the forward) for training- and
    prefill-sized calls; decode-sized ones (`decode_sized`) keep the eager block. Tracing holds one-rank and
    sync-free expert-parallel MoE layers (whose all-to-alls' sizes follow from shapes); `None` (the default)
    traces them where every MoE layer of the model is one-rank with its experts on a GPU and none was compiled
    eager before, `True` also traces sync-free expert-parallel layers (forward and backward: the all-to-alls in
    the layer's graphs) and refuses other expert-parallel ones, `False` keeps every MoE block eager between its
    layer's two graphs.

    The first forward of each new shape (prefill length, decode batch) compiles: time it apart.
    """
    layers = decoder_layers(model)
    if trace_moe is None:
        trace_moe = traceable(model)
    elif trace_moe:
        check_traceable(model)
    compile_kwargs.setdefault("dynamic", False)
    # per input shape (each prefill length, each decode batch), one graph per layer (its cache slot)
    # twice (before and after the MoE block): room for 16 shapes before a layer would fall back to eager
    limit = 32 * len(layers) + 8
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, limit)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 8 * limit)
    for layer in layers:
        for block in layer.modules():
            if not isinstance(block, OccultMoeBlock) or getattr(block, "occult_traced", False):
                continue
            if trace_moe:
                block.forward = traced_forward(block)
                block.occult_traced = True
            elif not getattr(block, "occult_eager", False):
                block.forward = torch.compiler.disable(block.forward)  # this instance only: eager inside
                block.occult_eager = True
        layer.compile(**compile_kwargs)
    if layer_graphs or train_graphs:
        for moe in model.modules():
            if isinstance(moe, OccultMoE) and moe.num_ranks > 1 and not moe.waits_for_gpu:
                moe.execution = replace(moe.execution, graphs=True, train_graphs=train_graphs)
    return len(layers)


def decode_sized(num_tokens: int, top_k: int) -> bool:
    """Whether a call of `num_tokens` tokens is decode-sized: its (token, expert) pairs few enough for the
    small-batch kernels (`occult.kernels.small_batch.MAX_PAIRS`)."""
    from occult.kernels.small_batch import MAX_PAIRS

    return num_tokens * top_k <= MAX_PAIRS


def traced_forward(block: OccultMoeBlock) -> Any:
    """`block.forward` traced with its layer for training- and prefill-sized calls; a decode-sized call keeps the
    eager block between the layer's two graphs, as measured for captured decode steps (tracing those is not).
    The choice is made when a shape is traced (a Python branch on the token count): one graph per shape."""
    traced, eager = block.forward, torch.compiler.disable(block.forward)
    top_k = block.experts.top_k

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        tokens = hidden_states.numel() // hidden_states.shape[-1]
        return eager(hidden_states) if decode_sized(tokens, top_k) else traced(hidden_states)

    return forward


def traceable(model: nn.Module) -> bool:
    """Whether `compile_layers` traces the model's MoE blocks with their layers by default: every `OccultMoE`
    one-rank with its experts on a GPU (where the Triton expert path traces whole; on CPU the reference loop
    breaks the graph at its data-dependent splits), and no block compiled eager by an earlier call. (Sync-free
    expert-parallel layers trace when asked, `trace_moe=True`: not by default, as they did not beat the eager
    block on GPUs: docs/training.md.)"""
    layers = [m for m in model.modules() if isinstance(m, OccultMoE)]
    if not layers or not all(layer.gate_up_proj.is_cuda and layer.num_ranks == 1 for layer in layers):
        return False
    try:
        check_traceable(model)
    except ValueError:
        return False
    return True


def check_traceable(model: nn.Module) -> None:
    """`trace_moe` traces one-rank and sync-free MoE layers: an expert-parallel call that learns its all-to-alls'
    sizes on the host (the count exchange) or agrees with the other ranks' hosts (the device transport) cannot be
    held by a compiled graph; a sync-free one's sizes follow from shapes (`OccultMoE.sync_free`)."""
    parallel = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, OccultMoE) and m.num_ranks > 1 and not m.sync_free
    ]
    if parallel:
        name, layer = parallel[0]
        raise ValueError(
            f"compile_layers(trace_moe=True) traces one-rank and sync-free MoE layers only; {name} is expert "
            f"parallel over {layer.num_ranks} ranks and learns its exchanges' sizes at run time: make it sync-free "
            "first (occult.set_sync_free(model): every rank the same token count) or leave trace_moe off"
        )
    eager = [name for name, m in model.named_modules() if getattr(m, "occult_eager", False)]
    if eager:
        raise ValueError(
            f"{eager[0]} was already compiled with its MoE block eager (compile_layers without trace_moe): "
            "call compile_layers(trace_moe=True) on a freshly converted model"
        )
