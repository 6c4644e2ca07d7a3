"""The chunked schedule (`ExecConfig(chunks=C)`, `occult.moe.chunked`) on gloo ranks.

A sync-free call without autograd runs as C chunks of tokens; it must compute the dense layer's
function and send the rows the unchunked sync-free call sends, for every dispatcher, with fewer
tokens than chunks, top-1 and top-k = all experts; a call under autograd runs unchunked (same
outputs and gradients as chunks=1); tiny calls (0 or 1 token) too. On CPU the chunks run one
after another; the two-stream overlap is the GPU suite's (tests/gpu/test_collective_layer_graphs.py).
"""

from __future__ import annotations

import random

import pytest
import torch

from occult.distributed import run_ranks
from occult.moe.chunked import chunk_bounds
from occult.moe.config import ExecConfig
from occult.moe.dense import DenseMoE
from occult.moe.layer import OccultMoE

WORLD = 2
# (tokens per rank, top_k, chunks): more tokens than chunks, fewer tokens than chunks, top-1, top-k = all
CASES = [(13, 3, 3), (4, 8, 5), (9, 1, 2), (1, 3, 4), (0, 3, 2)]


def _layers(dense: DenseMoE, dispatcher: str, chunks: int) -> tuple[OccultMoE, OccultMoE]:
    make = lambda c: OccultMoE.from_dense(dense, execution=ExecConfig(dispatcher, sync_free=True, chunks=c))  # noqa: E731
    return make(1), make(chunks)


def _case(rank: int, seed: int, dispatcher: str, tokens: int, top_k: int, chunks: int) -> dict:
    torch.manual_seed(seed)
    dense = DenseMoE(16, 12, 8, top_k, dtype=torch.float64)
    plain, chunked = _layers(dense, dispatcher, chunks)
    torch.manual_seed(seed + 1 + rank)
    x = torch.randn(tokens, 16, dtype=torch.float64)
    calls = []
    dispatch = chunked.dispatcher.dispatch
    chunked.dispatcher.dispatch = lambda *a, **k: calls.append(a[0].shape[0]) or dispatch(*a, **k)
    with torch.no_grad():
        ref, y_plain, y_chunked = dense(x), plain(x), chunked(x)
    del chunked.dispatcher.dispatch
    out = {"vs_dense": float((y_chunked - ref).abs().max()) if tokens else 0.0,
           "vs_plain": float((y_chunked - y_plain).abs().max()) if tokens else 0.0,
           "same_rows": plain.last_comm_stats.as_dict() == chunked.last_comm_stats.as_dict(),
           "forward_rows": chunked.last_comm_stats.forward_rows,
           "chunk_tokens": calls, "expected": [b - a for a, b in chunk_bounds(tokens, chunks)] if tokens > 1 else [tokens]}
    grads = []
    for layer in (plain, chunked):  # under autograd: unchunked, the same outputs and gradients
        x_ = x.clone().requires_grad_()
        g = torch.ones_like(x_)
        (layer(x_) * g).sum().backward()
        grads.append((x_.grad, layer.gate_up_proj.grad, layer.down_proj.grad, layer.router.gate.weight.grad))
    out["grad_error"] = max(float((a - b).abs().max()) if a.numel() else 0.0 for a, b in zip(*grads))
    return out


def _worker(rank: int, world_size: int, seed: int) -> dict:
    return {(name, *case): _case(rank, seed, name, *case) for name in ("dedup", "standard") for case in CASES}


def test_chunked_calls_compute_the_dense_function_and_send_the_same_rows():
    per_rank = run_ranks(_worker, WORLD, random.randrange(2**31), timeout_s=300)
    for rank, results in enumerate(per_rank):
        for key, res in results.items():
            label = (rank, *key)
            assert res["vs_dense"] < 1e-12, label
            assert res["vs_plain"] < 1e-12, label
            assert res["same_rows"], label
            assert res["grad_error"] == 0.0, label
            assert res["chunk_tokens"] == res["expected"], label  # the chunked path ran (tiny calls: unchunked)
            if key[1]:  # tokens: rows were sent
                assert res["forward_rows"] > 0, label


def test_chunk_bounds_cover_the_tokens_in_near_equal_chunks():
    for tokens in (0, 1, 2, 7, 64, 8193):
        for chunks in (1, 2, 3, 4, 9):
            bounds = chunk_bounds(tokens, chunks)
            assert bounds[0][0] == 0 and bounds[-1][1] == tokens
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            assert len(bounds) == max(1, min(chunks, tokens))
            sizes = [b - a for a, b in bounds]
            assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("chunks", [0, -2, 2.5, True, "4"])
def test_bad_chunks_are_refused(chunks):
    with pytest.raises(ValueError, match="chunks must be an integer >= 1"):
        ExecConfig(chunks=chunks)


def test_repr_shows_the_chunks():
    dense = DenseMoE(16, 12, 8, 2, dtype=torch.float64)
    layer = OccultMoE.from_dense(dense, execution=ExecConfig("dedup", sync_free=True, chunks=4))
    assert "chunks=4" in repr(layer)
    assert "chunks" not in repr(OccultMoE.from_dense(dense))
