"""Routing traces of a transformers model (`profile`), recorded through the model's own routers.

Hooks on every MoE block's gate (or, on a converted model, on its router) collect each token's
top-k ids, optionally the gate's scores, and the router logits' Gram matrix for the
expert-similarity table; under torch.distributed the ranks' traces are gathered.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from occult.integrations.hf.block import OccultMoeBlock, moe_blocks
from occult.integrations.hf.families import check_block, check_transformers_version, group_size, model_family
from occult.placement.trace import Trace, TraceRecorder, write_trace


def _batch_kwargs(batch: Any) -> tuple[dict[str, Any], torch.Tensor | None]:
    if isinstance(batch, torch.Tensor):
        return {"input_ids": batch if batch.dim() == 2 else batch.unsqueeze(0)}, None
    if isinstance(batch, Mapping):
        kwargs = dict(batch)
        kwargs.pop("labels", None)
        return kwargs, kwargs.get("attention_mask")
    raise TypeError(f"a batch is a LongTensor of input ids or a dict of model inputs, got {type(batch).__name__}")


@torch.no_grad()
def profile(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    scores: str | None = None,
    max_tokens: int | None = None,
    group: Any = None,
    gather: bool = True,
    path: str | None = None,
    similarity_path: str | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> Trace:
    """Record the routing trace of every MoE layer through the model's own routers.

    `batches` yields input-id tensors [B, S] or dicts of model inputs; tokens where a batch's
    `attention_mask` is 0 are left out. `scores`: None, "topk" (the gate weights, [T, k]) or
    "all" (the gate's per-expert probabilities, softmax or sigmoid, [T, E]; what similarity
    pruning needs). Stops after `max_tokens` tokens. On a converted model the recorded ids are
    the ones actually dispatched (after any device limit). Under torch.distributed with
    `gather=True` every rank of `group` (default: the default group) must call it: each records
    its own batches, and all ranks return the same trace, ranks' tokens concatenated in rank
    order (`gather=False`: this rank's tokens only; a converted model still needs every rank
    to run its forward passes). `path` writes it
    (rank 0 only). `similarity_path` also writes the per-layer expert similarity tables
    (cosine of router-logit columns, `occult.moe.pruning.save_similarity`) that similarity pruning
    (`convert(..., prune_method="similarity")`) reads back with `occult.moe.pruning.load_similarity`.
    Runs in eval mode.
    """
    check_transformers_version()
    if scores not in (None, "topk", "all"):
        raise ValueError(f"scores must be None, 'topk' or 'all', got {scores!r}")
    blocks = moe_blocks(model)
    family = model_family(model)
    for name, block in blocks:
        if not isinstance(block, OccultMoeBlock):  # a converted block was checked when converted
            check_block(name, block, family)
    taps = _RoutingTaps(model, blocks, scores, similarity=similarity_path is not None)
    handles = taps.attach(blocks)
    was_training = model.training
    model.eval()
    try:
        _run_batches(model, batches, taps, max_tokens)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    meta = {
        "source": "occult.integrations.hf.profile",
        "model_type": family.model_type,
        "model": str(getattr(model.config, "_name_or_path", "") or ""),
        "moe_modules": json.dumps([n for n, _ in blocks]),
    }
    meta.update({str(k): str(v) for k, v in (metadata or {}).items()})
    taps.rec.metadata.update(meta)
    trace = taps.rec.to_trace()
    if max_tokens is not None:  # the last batch may overshoot
        trace = Trace(
            [t[:max_tokens] for t in trace.topk_ids],
            trace.num_experts,
            trace.top_k,
            [None if s is None else s[:max_tokens] for s in trace.scores],
            trace.metadata,
        )
    size, rank = group_size(group) if gather else (1, 0)
    if size > 1:
        trace = _gather_trace(trace, group)
    if path is not None and rank == 0:
        write_trace(path, trace)
    if taps.sims is not None:
        _save_similarity(model, taps.sims, group, size, rank, similarity_path, family.model_type)
    return trace


class _RoutingTaps:
    """Forward hooks on every MoE block's gate (and a converted block's router) that record each
    token's top-k ids (and `scores`) and, with `similarity`, the router logits' Gram matrices.
    `keep` masks out padding tokens of the current batch."""

    def __init__(self, model: nn.Module, blocks: list[tuple[str, nn.Module]], scores: str | None, similarity: bool):
        family = model_family(model)
        self.num_experts = int(blocks[0][1].gate.num_experts)
        self.top_k = int(blocks[0][1].gate.top_k)
        self.scores = scores
        self.rec = TraceRecorder(self.num_experts, self.top_k)
        self.sims = None
        if similarity:
            from occult.moe.pruning import SimilarityAccumulator

            self.sims = [SimilarityAccumulator(self.num_experts) for _ in blocks]
        self.keep: torch.Tensor | None = None
        self.last_logits: dict[int, torch.Tensor] = {}
        self.routers = [b.experts.router if isinstance(b, OccultMoeBlock) else family.router(b.gate) for _, b in blocks]

    def add(self, layer: int, logits, weights, ids) -> None:
        ids = ids.reshape(-1, self.top_k)
        sel = slice(None) if self.keep is None else self.keep
        s = None
        if self.scores == "topk":
            s = weights.reshape(-1, self.top_k)[sel].float()
        elif self.scores == "all":
            s = self.routers[layer].scores(logits.reshape(-1, self.num_experts))[sel]
        self.rec.add(layer, ids[sel], s)
        if self.sims is not None:
            self.sims[layer].add(logits.reshape(-1, self.num_experts)[sel])

    def attach(self, blocks: list[tuple[str, nn.Module]]) -> list[Any]:
        """Register the hooks; a converted block's gate hands its logits to its router's hook,
        which records the ids actually dispatched. Returns the handles."""

        def gate_hook(layer: int, converted: bool):
            def hook(_mod, _args, out):
                if converted:
                    self.last_logits[layer] = out[0]
                else:
                    self.add(layer, out[0], out[1], out[2])

            return hook

        def router_hook(layer: int):
            def hook(_mod, _args, out):
                self.add(layer, self.last_logits.pop(layer, None), out[0], out[1])

            return hook

        handles = []
        for i, (_, block) in enumerate(blocks):
            converted = isinstance(block, OccultMoeBlock)
            handles.append(block.gate.register_forward_hook(gate_hook(i, converted)))
            if converted:
                handles.append(block.experts.router.register_forward_hook(router_hook(i)))
        return handles


def _run_batches(model: nn.Module, batches: Iterable[Any], taps: _RoutingTaps, max_tokens: int | None) -> None:
    """Forward every batch (no KV cache) until `max_tokens` real tokens were seen."""
    seen = 0
    for batch in batches:
        kwargs, mask = _batch_kwargs(batch)
        taps.keep = None if mask is None else mask.reshape(-1).bool().to(next(model.parameters()).device)
        model(**kwargs, use_cache=False)
        seen += int(mask.sum()) if mask is not None else int(kwargs["input_ids"].numel())
        if max_tokens is not None and seen >= max_tokens:
            break


def _save_similarity(
    model: nn.Module, sims: list[Any], group: Any, size: int, rank: int, path: str, model_type: str
) -> None:
    """Sum the ranks' Gram matrices and write the similarity tables (rank 0)."""
    from occult.moe.pruning import save_similarity

    gram = torch.stack([acc.gram_EE for acc in sims])
    if size > 1:  # float64 Gram matrices add up over ranks' tokens (on the model's device for NCCL)
        gram = gram.to(next(model.parameters()).device)
        dist.all_reduce(gram, group=group)
        gram = gram.cpu()
    for acc, g in zip(sims, gram):
        acc.gram_EE, acc.tokens = g, max(acc.tokens, 1)
    if rank == 0:
        save_similarity(path, [acc.similarity() for acc in sims], {"model_type": model_type})


def _gather_trace(trace: Trace, group: Any) -> Trace:
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, (trace.topk_ids, trace.scores), group=group)
    ids = [np.concatenate([p[0][i] for p in parts]) for i in range(trace.num_layers)]
    scores = [
        None if parts[0][1][i] is None else np.concatenate([p[1][i] for p in parts]) for i in range(trace.num_layers)
    ]
    return Trace(ids, trace.num_experts, trace.top_k, scores, trace.metadata)
