"""Record a routing trace (format: README.md, section Files) from an `OccultLM` on a token stream.

`record_trace(model, batches)` runs the model without gradients and, for every MoE layer,
collects each token's top-k expert ids (`occult.placement.trace.TraceRecorder`) and streams the router
logits into a Gram matrix, from which the expert-similarity table of the similarity pruning
variant is derived (cosine of the experts' router-logit columns, `occult.moe.pruning`).

By default the trace holds the model's *plain* top-k (what the placement solver needs), even
when the model runs with a device limit; `as_routed=True` records the ids actually used.
`profile_checkpoint` / `occult profile` write

    OUT.safetensors              the trace: `layers.{i}.topk_ids` (+ `layers.{i}.scores`, the
                                 router's probabilities [T, E], with --scores), metadata
                                 num_experts, top_k, source checkpoint, split, tokens
    OUT.similarity.safetensors   per-layer [E, E] similarity (or --similarity PATH; put it beside
                                 the placement as PLACEMENT.similarity.safetensors, where
                                 `occult finetune --prune-method similarity` looks for it)

ready for `occult place --trace OUT.safetensors --devices D`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from occult.lm.data import TokenData, eval_batches, train_batch
from occult.lm.model import OccultLM
from occult.moe.pruning import SimilarityAccumulator, save_similarity, similarity_path
from occult.moe.routing import softmax_topk
from occult.placement.trace import Trace, TraceRecorder, write_trace

CALIBRATION_SEED = 20250513


def calibration_batches(
    data: TokenData, split: str, tokens: int, batch_size: int, seq_len: int
) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
    """Windows for profiling: random (fixed seed) windows of the training split, or the first
    non-overlapping windows of the validation split; `tokens` tokens in all (rounded up)."""
    stream = data.split(split)
    if split == "val":
        yield from eval_batches(stream, batch_size, seq_len, tokens)
        return
    n_batches = max(1, -(-tokens // (batch_size * seq_len)))
    for i in range(n_batches):
        yield train_batch(stream, batch_size, seq_len, CALIBRATION_SEED, i)


@torch.no_grad()
def record_trace(
    model: OccultLM,
    batches: Iterable[tuple[torch.Tensor, Any]],
    *,
    with_scores: bool = False,
    as_routed: bool = False,
    precision: str = "auto",
    metadata: Mapping[str, Any] | None = None,
    progress: bool | None = False,
) -> tuple[Trace, list[torch.Tensor]]:
    """(trace, per-layer similarity tables) of `model` on `batches` of input ids."""
    from tqdm.auto import tqdm

    from occult.lm.evaluate import autocast_for

    cfg = model.config
    device = next(model.parameters()).device
    recorder = TraceRecorder(cfg.num_experts, cfg.top_k, metadata)
    sims = [SimilarityAccumulator(cfg.num_experts) for _ in range(cfg.num_layers)]

    def observe(layer: int, logits_TE, weights_TK, ids_TK) -> None:
        logits = logits_TE.float()
        if not as_routed:
            _, ids_TK = softmax_topk(logits, cfg.top_k, cfg.norm_topk_prob)
        scores = torch.softmax(logits, dim=-1).cpu() if with_scores else None
        recorder.add(layer, ids_TK.cpu(), scores)
        sims[layer].add(logits)

    was_training = model.training
    model.eval()
    try:
        with model.observe_routing(observe), autocast_for(device, precision):
            for x, *_ in tqdm(
                batches, desc="occult profile", unit="batch", disable=(not progress) if progress is not None else None
            ):
                model(x.to(device), return_logits=False)
    finally:
        model.train(was_training)
    return recorder.to_trace(), [s.similarity() for s in sims]


def profile_checkpoint(
    checkpoint: str | os.PathLike,
    data: TokenData,
    out: str | os.PathLike,
    *,
    split: str = "train",
    tokens: int = 65536,
    batch_size: int = 16,
    seq_len: int | None = None,
    with_scores: bool = False,
    as_routed: bool = False,
    similarity_out: str | os.PathLike | None = None,
    device: str = "auto",
    precision: str = "auto",
    progress: bool | None = None,
) -> tuple[Trace, Path]:
    """Load `checkpoint`, record its routing on `tokens` tokens of `split`, write the trace and
    the similarity table; return (trace, similarity path)."""
    from occult.lm.checkpoint import load_model
    from occult.lm.evaluate import pick_device

    model = load_model(checkpoint, device=pick_device(device), routing=as_routed)
    seq_len = seq_len or model.config.max_seq_len
    meta = {
        "source": "occult profile",
        "checkpoint": str(checkpoint),
        "split": split,
        "routing": "as routed: " + model.routing.describe() if as_routed else "plain top-k",
        "model_config": json.dumps(model.config.to_dict()),
    }
    trace, sims = record_trace(
        model,
        calibration_batches(data, split, tokens, batch_size, seq_len),
        with_scores=with_scores,
        as_routed=as_routed,
        precision=precision,
        metadata=meta,
        progress=progress,
    )
    write_trace(out, trace)
    sim_path = Path(similarity_out) if similarity_out is not None else similarity_path(out)
    save_similarity(
        sim_path,
        sims,
        {
            "source": "occult profile",
            "checkpoint": str(checkpoint),
            "trace": str(out),
            "tokens": str(trace.num_tokens[0]),
        },
    )
    return trace, sim_path


__all__ = ["record_trace", "profile_checkpoint", "calibration_batches", "CALIBRATION_SEED"]
