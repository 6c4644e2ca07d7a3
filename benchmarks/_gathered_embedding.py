"""An experiment of e2e.py's `--embedding-grads gathered` (docs/overlap.md, "What the dense sync's tail still costs"):
the input embedding's backward all-gathers every rank's token ids and upstream gradient rows and accumulates all
of them into its gradient, which is then whole on every rank, so the dense sync leaves it out. A step touches at
most W x T of the embedding's V rows: at Qwen3's vocabulary that moves 2 x 33.5 MB where all-reducing the dense
gradient moves 622 MB, and it is the last all-reduce of the backward, under no compute.

Every rank must call the embedding with the same number of tokens (e2e.py's ranks do: `--batch` x `--seq` each);
the gradient is the sum over ranks of each rank's loss's (scale the losses, as e2e.py does, for the mean). Kept in
benchmarks/ until a GPU run says whether it pays; then it belongs in occult's trainers (the design's other parts).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def _all_gather_rows(out: torch.Tensor, mine: torch.Tensor, group: Any) -> None:
    """Every rank's `mine` (the same shape on each), in rank order, into `out` along dim 0."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (the newer name first)
    gather(out, mine, group=group)


class _GatheredEmbedding(torch.autograd.Function):
    """`F.embedding(ids, weight)` whose weight gradient sums every rank's tokens' rows (module docstring)."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None, group: Any) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.rows, ctx.padding_idx, ctx.group = weight.shape[0], padding_idx, group
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[None, torch.Tensor, None, None]:
        (ids,) = ctx.saved_tensors
        world = dist.get_world_size(ctx.group)
        ids_T = ids.reshape(-1).contiguous()
        dy_TH = dy.reshape(-1, dy.shape[-1]).contiguous()
        ids_WT = ids_T.new_empty(world * ids_T.numel())
        dy_WTH = dy_TH.new_empty(world * dy_TH.shape[0], dy_TH.shape[1])
        _all_gather_rows(ids_WT, ids_T, ctx.group)
        _all_gather_rows(dy_WTH, dy_TH, ctx.group)
        grad_VH = dy_TH.new_zeros(ctx.rows, dy_TH.shape[1])
        grad_VH.index_put_((ids_WT,), dy_WTH, accumulate=True)  # (sort-based on CUDA: the same order on every rank)
        if ctx.padding_idx is not None:
            grad_VH[ctx.padding_idx] = 0
        return None, grad_VH, None, None


def gather_embedding_grads(model: nn.Module, group: Any = None) -> nn.Parameter | None:
    """Make `model`'s input embedding gather its gradient (module docstring) and return its weight, which the dense
    sync must then leave out; None where nothing changes: one rank, or the embedding tied to the output layer (its
    gradient is dense there). A ValueError for an embedding whose backward this does not reproduce."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return None
    embedding = model.get_input_embeddings()
    output = model.get_output_embeddings()
    if output is not None and output.weight is embedding.weight:
        return None
    if not isinstance(embedding, nn.Embedding) or embedding.max_norm is not None:
        raise ValueError(f"--embedding-grads gathered takes a plain nn.Embedding, not {embedding!r}")
    if embedding.scale_grad_by_freq or embedding.sparse:
        raise ValueError("--embedding-grads gathered: the embedding scales its gradient by frequency or is sparse")

    def forward(ids: torch.Tensor) -> torch.Tensor:
        return _GatheredEmbedding.apply(ids, embedding.weight, embedding.padding_idx, group)

    embedding.forward = forward
    return embedding.weight


@torch.no_grad()
def replicas_equal(weight: torch.Tensor, group: Any = None) -> bool:
    """Whether every rank holds `weight` bit for bit (its elementwise max and min over the ranks are its own): a
    gathered gradient accumulated in another order on some rank would make the replicas drift apart."""
    high, low = weight.detach().clone(), weight.detach().clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    mine = torch.tensor([float(torch.equal(high, weight) and torch.equal(low, weight))], device=weight.device)
    dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=group)
    return bool(mine.item())
