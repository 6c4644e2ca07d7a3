"""`hf.compile_layers` on one GPU: the one-rank MoE blocks traced with their decoder layer by default (one graph
per layer, no graph break; the Triton expert path under torch.compile) train like the eager model, in fp32, bf16
and fp16, and still report bad routing. Single-process GPU tests (tests/gpu/run.sh's second stage)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'occult[hf]')")

from gradient_judge import gradients_off  # noqa: E402  (tests/gpu/gradient_judge.py)

import occult  # noqa: E402
from occult.integrations import hf  # noqa: E402

VOCAB = 96


def _grads(model, ids) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _model(seed: int, dtype: torch.dtype) -> torch.nn.Module:
    """The tiny random OLMoE of `seed`, converted, on the GPU in `dtype`."""
    model = hf.convert(hf.tiny_random_model("olmoe", seed=seed, vocab_size=VOCAB, num_hidden_layers=2))
    return model.to("cuda", dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the traced Triton expert path needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_traced_moe_layers_train_like_eager_in_one_graph(dtype):
    from torch._dynamo.utils import counters

    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    ids = torch.randint(3, VOCAB, (4, 64), generator=torch.Generator().manual_seed(seed)).cuda()
    exact = _grads(_model(seed, torch.float32), ids)  # the same model in fp32, eager
    model = _model(seed, dtype)
    ref = _grads(model, ids)
    torch._dynamo.reset()
    counters.clear()
    hf.compile_layers(model)  # one-rank layers on a GPU: traced by default
    assert not any(getattr(b, "occult_eager", False) for _, b in hf.moe_blocks(model))
    got = _grads(model, ids)
    again = _grads(model, ids)
    assert not counters["graph_break"], dict(counters["graph_break"])  # each layer one whole graph
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])  # at most one per layer
    # compiled against eager in the same precision: exact in fp32, no gross error in half precision (routing
    # flips: gradient_judge.py)
    off = gradients_off(got, ref, exact, dtype)
    assert not off, (seed, off)
    assert all(torch.equal(got[n], again[n]) for n in got)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the traced Triton expert path needs a GPU")
@pytest.mark.parametrize("phase", ["forward", "train"])
def test_traced_moe_layers_report_bad_routing(phase):
    """A router weight made NaN inside a traced layer raises `RoutingError` from the model's call (the compiled
    graph queues each layer's routing status through `occult::queue_routing_status`), with no graph break,
    and the model works again once the weight is repaired."""
    from torch._dynamo.utils import counters

    from occult import OccultMoE, RoutingError

    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    ids = torch.randint(3, VOCAB, (4, 64), generator=torch.Generator().manual_seed(seed)).cuda()  # past decode size
    model = _model(seed, torch.bfloat16)
    torch._dynamo.reset()
    counters.clear()
    hf.compile_layers(model)
    layer = [m for m in model.modules() if isinstance(m, OccultMoE)][-1]

    def run():
        if phase == "train":
            model(input_ids=ids, labels=ids).loss.backward()
        else:
            with torch.no_grad():
                model(input_ids=ids)

    run()
    saved = layer.router.gate.weight.detach().clone()
    with torch.no_grad():
        layer.router.gate.weight[0, 0] = float("nan")
    with pytest.raises(RoutingError, match="NaN"):
        run()
        torch.cuda.synchronize()
    assert layer.routing_status_1.item() != 0, seed  # the status the compiled graph queued
    with torch.no_grad():
        layer.router.gate.weight.copy_(saved)
    run()
    occult.check_routing()
    assert not counters["graph_break"], dict(counters["graph_break"])
