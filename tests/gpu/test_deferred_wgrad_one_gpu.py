"""`OCCULT_DEFER_WGRAD=1` on one GPU (`occult.kernels.deferred_wgrad`): the expert op's weight GEMMs on their side
stream give every gradient of the op without the setting, bit for bit, for a stack of one-rank layers in bf16,
fp16 and fp32, trained eagerly and inside one CUDA graph of the whole forward and backward (a captured training
step's case: the side stream forks and joins inside the capture). Single-process GPU tests (stage 2); the
expert-parallel layers over NCCL: test_collective_deferred_wgrad.py."""

from __future__ import annotations

import pytest
import torch

from occult import DenseMoE, OccultMoE

TOKENS, HIDDEN, FFN, EXPERTS, TOP_K, LAYERS = 4096, 1024, 512, 16, 4, 3
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the side stream needs a GPU")


def _stack(seed: int, dtype: torch.dtype) -> list[OccultMoE]:
    torch.manual_seed(seed)
    return [
        OccultMoE.from_dense(DenseMoE(HIDDEN, FFN, EXPERTS, TOP_K, dtype=dtype, device="cuda")) for _ in range(LAYERS)
    ]


def _backward(layers: list[OccultMoE], x: torch.Tensor, w: torch.Tensor) -> None:
    y = x
    for layer in layers:
        y = layer(y)
    (y.float() * w).sum().backward()


def _grads(layers: list[OccultMoE], x: torch.Tensor) -> dict[str, torch.Tensor]:
    found = {f"{i}.{n}": p.grad.clone() for i, layer in enumerate(layers) for n, p in layer.named_parameters()}
    return {"x": x.grad.clone(), **found}


def _eager(layers, x, w, monkeypatch, defer: bool) -> dict[str, torch.Tensor]:
    monkeypatch.setenv("OCCULT_DEFER_WGRAD", "1" if defer else "0")
    x = x.detach().clone().requires_grad_(True)
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    _backward(layers, x, w)
    torch.cuda.synchronize()
    return _grads(layers, x)


def _inputs(seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen).to(dtype)
    return x, torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_deferred_weight_gradients_are_the_ops_bit_for_bit(monkeypatch, dtype_name):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    layers = _stack(seed, DTYPES[dtype_name])
    x, w = _inputs(seed, DTYPES[dtype_name])
    want = _eager(layers, x, w, monkeypatch, defer=False)
    got = _eager(layers, x, w, monkeypatch, defer=True)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), (seed, dtype_name, name)


def test_a_captured_forward_and_backward_forks_and_joins_the_side_stream(monkeypatch):
    """One CUDA graph of the forward and backward (warm-up steps first, as a captured step takes them): its
    replays give the eager gradients without the setting, bit for bit, on fresh inputs copied in."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    layers = _stack(seed, torch.bfloat16)
    x, w = _inputs(seed, torch.bfloat16)
    static_x, static_w = x.clone().requires_grad_(True), w.clone()
    monkeypatch.setenv("OCCULT_DEFER_WGRAD", "1")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            for layer in layers:
                layer.zero_grad(set_to_none=True)
            static_x.grad = None
            _backward(layers, static_x, static_w)
    torch.cuda.current_stream().wait_stream(stream)
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _backward(layers, static_x, static_w)
    written = {f"{i}.{n}": p.grad for i, layer in enumerate(layers) for n, p in layer.named_parameters()}
    written["x"] = static_x.grad  # the tensors the replays write (the eager steps below replace .grad)
    for step in range(2):
        x, w = _inputs(seed + 1 + step, torch.bfloat16)
        with torch.no_grad():
            static_x.copy_(x)
            static_w.copy_(w)
        graph.replay()
        torch.cuda.synchronize()
        got = {name: t.clone() for name, t in written.items()}
        want = _eager(layers, x, w, monkeypatch, defer=False)
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), (seed, step, name)
