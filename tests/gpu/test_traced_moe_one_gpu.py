"""`hf.compile_layers(trace_moe=True)` on one GPU: the one-rank MoE blocks traced with their decoder layer
(one graph per layer, no graph break; the Triton expert path under torch.compile) train like the eager model,
in fp32, bf16 and fp16. Single-process GPU tests (tests/gpu/run.sh's second stage)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'occult[hf]')")

from occult.integrations import hf  # noqa: E402

VOCAB = 96
TOL = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 5e-2}


def _grads(model, ids) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the traced Triton expert path needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_traced_moe_layers_train_like_eager_in_one_graph(dtype):
    from torch._dynamo.utils import counters

    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    model = hf.convert(hf.tiny_random_model("olmoe", seed=seed, vocab_size=VOCAB, num_hidden_layers=2))
    model = model.to("cuda", dtype)
    ids = torch.randint(3, VOCAB, (4, 64), generator=torch.Generator().manual_seed(seed)).cuda()
    ref = _grads(model, ids)
    torch._dynamo.reset()
    counters.clear()
    hf.compile_layers(model, trace_moe=True)
    got = _grads(model, ids)
    again = _grads(model, ids)
    assert not counters["graph_break"], dict(counters["graph_break"])  # each layer one whole graph
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])  # at most one per layer
    worst = max(((got[n] - g).norm() / g.norm().clamp_min(1e-12)).item() for n, g in ref.items())
    assert worst < TOL[dtype], (seed, worst)
    assert all(torch.equal(got[n], again[n]) for n in got)
