"""Several layers whose training calls are replayed from CUDA graphs (`occult.moe.train_graphs`), one after
another as in a model, on one GPU at a real layer size.

In e2e.py's 16-layer training the replays went wrong (NaN on 4 GPUs): the autograd thread's cuBLAS workspace
for the capture stream, first allocated while the first layer's backward recorded, landed in that layer's pool
over its freed activations, and every later layer's GEMMs wrote into them between its forward and backward
replays (`occult.moe.capture_stream`). Whether the workspace lands on activations depends on the allocator's
layout, so the gradients alone can pass with the defect present (they did here); the first test checks the
cause: after recording, the recordings' pool holds nothing but what they hand out (their outputs and
gradients). The second checks that the recordings of a step, sharing one pool, take about an eager step's
memory. Single-process GPU tests (stage 2)."""

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


def _pool_blocks(recordings) -> list[dict]:
    """The blocks of every segment in the pools `recordings` record into, each with its address."""
    pools = {tuple(r.forward_graph.pool()) for r in recordings}
    blocks = []
    for segment in torch.cuda.memory_snapshot():
        if tuple(segment.get("segment_pool_id", ())) not in pools:
            continue
        address = segment["address"]
        for block in segment["blocks"]:
            blocks.append(dict(block, address=block.get("address", address)))
            address = blocks[-1]["address"] + block["size"]
    return blocks


def _handed(recording) -> list[torch.Tensor]:
    """The tensors a recording hands out: its output, routing statuses and gradients."""
    return [recording.y_TH, *recording.statuses, *(g for g in recording.grads if g is not None)]


def _stray_blocks(recordings) -> list[tuple[int, int]]:
    """Blocks of at least STRAY_BYTES allocated in the pools of `recordings` that are none of the tensors they
    hand out (outputs, gradients, routing statuses): (address, bytes)."""
    starts = {t.untyped_storage().data_ptr() for r in recordings for t in _handed(r)}
    return [
        (b["address"], b["size"])
        for b in _pool_blocks(recordings)
        if b["state"] == "active_allocated" and b["size"] >= STRAY_BYTES and b["address"] not in starts
    ]


def test_training_recordings_hold_no_blas_workspace():
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    graphed, eager = _stacks(seed)
    errors = _train(graphed, eager, seed)
    recordings = [r for layer in graphed for r in layer.graphs.recordings()]
    assert len(recordings) == LAYERS  # every layer recorded once and replayed
    assert len({tuple(r.forward_graph.pool()) for r in recordings}) == 1  # one step's recordings share a pool
    stray = _stray_blocks(recordings)
    assert not stray, (seed, stray)
    assert max(e for _, _, e in errors) <= TOL, (seed, errors)


def test_a_stacks_recordings_take_about_the_memory_of_an_eager_step():
    """The recordings share one pool in the order they replay, so what each layer needs only while it runs
    is held once, as in an eager step, not once per layer (with a pool per recording, a 4-GPU OLMoE step
    held 88 GiB of it)."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    graphed, eager = _stacks(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
    w = torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen)
    _step(eager, x, w)  # kernels compiled, gradients allocated
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _step(eager, x, w)
    eager_bytes = torch.cuda.max_memory_allocated() - base
    for _ in range(EAGER_CALLS + 2):
        _step(graphed, x, w)
    recordings = [r for layer in graphed for r in layer.graphs.recordings()]
    assert len(recordings) == LAYERS
    pool_bytes = sum(b["size"] for b in _pool_blocks(recordings))
    # what they hand out stays theirs (autograd copies the gradients into .grad): the rest is the step's memory
    handed = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for r in recordings for t in _handed(r)}
    kept_bytes = pool_bytes - sum(handed.values())
    print(
        f"recordings' pools {pool_bytes / 2**20:.0f} MiB, of which handed out {sum(handed.values()) / 2**20:.0f}; "
        f"an eager step's peak {eager_bytes / 2**20:.0f} MiB"
    )
    assert kept_bytes <= 1.25 * eager_bytes, (pool_bytes, kept_bytes, eager_bytes)
