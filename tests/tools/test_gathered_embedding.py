"""benchmarks/_gathered_embedding.py (e2e.py's `--embedding-grads gathered`): on 2 gloo ranks the embedding's
gathered gradient equals the all-reduced one (repeated ids, the padding row zero), every rank holds the same, and the
sync leaves it out (`hf.sync_gradients(complete=...)`); `replicas_equal` tells equal weights from one rank's moved
by 1e-9; a tied embedding or one process is left alone; e2e.py trains with it, its ranks' embeddings equal after."""

from __future__ import annotations

import json
import random
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _bench_helpers import ROOT, torchrun

from occult.distributed import run_ranks

sys.path.insert(0, str(ROOT / "benchmarks"))

import _gathered_embedding  # noqa: E402

WORLD, VOCAB, HIDDEN, PAD = 2, 23, 6, 3


class _Tiny(nn.Module):
    def __init__(self, seed: int, tied: bool = False):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, HIDDEN, padding_idx=PAD, dtype=torch.float64)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False, dtype=torch.float64)
        if tied:
            self.head.weight = self.embed.weight

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed

    def get_output_embeddings(self) -> nn.Linear:
        return self.head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(ids))).square().mean()


def _ids(seed: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 5 + rank)
    ids = torch.randint(0, 8, (3, 7), generator=g)  # few distinct ids: repeats within and across ranks
    ids[0, 0] = PAD
    return ids


def _worker(rank: int, world: int, seed: int) -> dict:
    from occult.integrations import hf

    want, got = _Tiny(seed), _Tiny(seed)
    weight = _gathered_embedding.gather_embedding_grads(got)
    ids = _ids(seed, rank)
    (want(ids) / world).backward()
    for p in want.parameters():
        dist.all_reduce(p.grad)
    (got(ids) / world).backward()
    gathered = got.embed.weight.grad.clone()
    hf.sync_gradients(got, average=False, complete=(weight,))  # the head all-reduced, the embedding left as it is
    everyone = [torch.empty_like(gathered) for _ in range(world)]
    dist.all_gather(everyone, gathered)
    return {
        "returned_weight": weight is got.embed.weight,
        "embed_err": float((got.embed.weight.grad - want.embed.weight.grad).abs().max()),
        "untouched_by_sync": torch.equal(got.embed.weight.grad, gathered),
        "head_err": float((got.head.weight.grad - want.head.weight.grad).abs().max()),
        "pad_row_zero": bool((gathered[PAD] == 0).all()),
        "same_on_every_rank": all(torch.equal(e, everyone[0]) for e in everyone),
        "tied_left_alone": _gathered_embedding.gather_embedding_grads(_Tiny(seed, tied=True)) is None,
        "replicas_equal": _gathered_embedding.replicas_equal(got.embed.weight),
        "one_rank_moved": _gathered_embedding.replicas_equal(got.embed.weight + (rank == 1) * 1e-9),
    }


def test_the_gathered_gradient_is_the_all_reduced_one():
    seed = random.randrange(2**31)
    for rank, got in enumerate(run_ranks(_worker, WORLD, seed, timeout_s=120)):
        assert got["returned_weight"] and got["untouched_by_sync"] and got["tied_left_alone"], (rank, got)
        assert got["embed_err"] < 1e-12 and got["head_err"] < 1e-12, (rank, got, seed)
        assert got["pad_row_zero"] and got["same_on_every_rank"], (rank, got)
        assert got["replicas_equal"] and not got["one_rank_moved"], (rank, got)  # (said on every rank)


def test_one_process_is_left_alone():
    model = _Tiny(0)
    forward = model.embed.forward
    assert _gathered_embedding.gather_embedding_grads(model) is None  # (no process group here)
    assert model.embed.forward == forward


def test_e2e_trains_with_gathered_embedding_gradients(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "e2e.json"
    args = ["--model", "tiny", "--batch", "2", "--seq", "32", "--check-seq", "32", "--warmup", "1", "--iters", "2"]
    args += ["--phases", "train", "--embedding-grads", "gathered", "--variants", "replicated,dedup", "--out", str(out)]
    res = torchrun(ROOT / "benchmarks" / "e2e.py", 2, *args)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["config"]["embedding_grads"] == "gathered"
    assert res.stdout.count("input embedding's gradient gathered in its backward") == 2  # (each variant's model)
    for name in ("replicated", "dedup"):
        train = report["variants"][name]["phases"]["train"]
        assert train["ms_median"] > 0 and train["embedding_replicas_equal"] is True, name
