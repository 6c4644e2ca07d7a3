"""Several layers whose training calls are replayed from CUDA graphs (`occult.moe.train_graphs`), one after
another as in a model, on one GPU at a real layer size.

In e2e.py's 16-layer training the replays went wrong (NaN on 4 GPUs): the autograd thread's cuBLAS workspace
for the capture stream, first allocated while the first layer's backward recorded, landed in that layer's pool
over its freed activations, and every later layer's GEMMs wrote into them between its forward and backward
replays (`occult.moe.capture_stream`). Whether the workspace lands on activations depends on the allocator's
layout, so the gradients alone can pass with the defect present (they did here); the first test checks the
cause: after recording, a layer's pool holds nothing but what the recording hands out (its output and
gradients). Single-process GPU tests (stage 2)."""

from __future__ import annotations

import pytest
import torch
from test_collective_layer import _rel

from occult import DenseMoE, OccultMoE
from occult.moe.graphs import EAGER_CALLS

TOKENS, HIDDEN, FFN, EXPERTS, TOP_K, LAYERS = 8192, 2048, 1024, 16, 4, 3  # saved rows of 32-128 MiB per layer
TOL = 2e-2  # relative L2, bf16 (both sides run the same kernels)
STRAY_BYTES = 1 << 20  # a block this large in a recording's pool that it does not hand out is a stray workspace

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def _stacks(seed: int) -> tuple[list[OccultMoE], list[OccultMoE]]:
    """(layers replaying training calls, the same weights eager), one rank each."""
    torch.manual_seed(seed)
    graphed, eager = [], []
    for _ in range(LAYERS):
        dense = DenseMoE(HIDDEN, FFN, EXPERTS, TOP_K, dtype=torch.bfloat16, device="cuda")
        graphed.append(OccultMoE.from_dense(dense, graphs=True, train_graphs=True))
        eager.append(OccultMoE.from_dense(dense))
    return graphed, eager


def _step(layers: list[OccultMoE], x: torch.Tensor, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """The gradients of sum(y * w), y the stack's output, for the input and every parameter."""
    x = x.detach().clone().requires_grad_(True)
    y = x
    for layer in layers:
        layer.zero_grad(set_to_none=True)
        y = layer(y)
    (y.float() * w).sum().backward()
    grads = {f"{i}.{name}": p.grad for i, layer in enumerate(layers) for name, p in layer.named_parameters()}
    return {"x": x.grad, **grads}


def _train(graphed: list[OccultMoE], eager: list[OccultMoE], seed: int) -> list[tuple[int, str, float]]:
    """EAGER_CALLS + 3 steps of both stacks (the graphed one records at its third); each step's worst gradient."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    errors = []
    for step in range(EAGER_CALLS + 3):
        x = torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
        w = torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen)
        got, ref = _step(graphed, x, w), _step(eager, x, w)
        worst = max(ref, key=lambda k: _rel(got[k], ref[k]))
        errors.append((step, worst, _rel(got[worst], ref[worst])))
        with torch.no_grad():  # an optimizer's in-place update, the same on both stacks
            for a, b in zip((p for m in graphed for p in m.parameters()), (p for m in eager for p in m.parameters())):
                a.mul_(0.9)
                b.mul_(0.9)
    return errors


def _stray_blocks(recording) -> list[tuple[int, int]]:
    """Blocks of at least STRAY_BYTES allocated in `recording`'s pool that are none of the tensors it hands out
    (output, gradients, routing statuses): (address, bytes)."""
    handed = [recording.y_TH, *recording.statuses, *(g for g in recording.grads if g is not None)]
    starts = {t.untyped_storage().data_ptr() for t in handed}
    stray = []
    for segment in torch.cuda.memory_snapshot():
        if tuple(segment.get("segment_pool_id", ())) != tuple(recording.forward_graph.pool()):
            continue
        address = segment["address"]
        for block in segment["blocks"]:
            at = block.get("address", address)
            if block["state"] == "active_allocated" and block["size"] >= STRAY_BYTES and at not in starts:
                stray.append((at, block["size"]))
            address = at + block["size"]
    return stray


def test_training_recordings_hold_no_blas_workspace():
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    graphed, eager = _stacks(seed)
    errors = _train(graphed, eager, seed)
    recordings = [r for layer in graphed for r in layer.graphs.recordings()]
    assert len(recordings) == LAYERS  # every layer recorded once and replayed
    stray = {i: _stray_blocks(r) for i, r in enumerate(recordings)}
    assert not any(stray.values()), (seed, stray)
    assert max(e for _, _, e in errors) <= TOL, (seed, errors)
