"""The device transport's buffers on GPUs over NCCL: a growth that fails on one rank raises one
`TransportMemoryError` on every rank and leaves the layer computing right at its old size; the
buffers' size shows in `memory_bytes` and the layer's repr; `occult.release_transports()` frees them
and the next call grows them again. (Each collective case starts with the transports released:
conftest.py.)"""

from __future__ import annotations

import pytest
import torch
from test_collective_layer import FFN, HIDDEN, _placement, _rel, skip_without_transport

import occult
from occult import DenseMoE, OccultMoE, TransportMemoryError
from occult.moe.transport_buffers import slots_bytes

TOL_VS_COUNTS = 1e-2  # bf16, against the same layer over the count exchange (as test_collective_layer_graphs)
GROW_BYTES = 8 << 30  # what the failed growth asks per buffer: fits every rank but the one that holds the rest


def _layer(ranks):
    if ranks.device.type != "cuda" or ranks.backend != "nccl":
        pytest.skip("the device transport needs GPUs with NCCL")
    skip_without_transport(ranks, "device")
    torch.manual_seed(ranks.seed + 31)
    E = 8 * ranks.world_size
    dense = DenseMoE(HIDDEN, FFN, E, 4, dtype=torch.bfloat16, device=ranks.device)
    placement = _placement("random", E, ranks.world_size, ranks.seed)
    layer = OccultMoE.from_dense(dense, placement=placement, transport="device")
    return layer, OccultMoE.from_dense(dense, placement=placement, transport="counts")


def _check(ranks, layer, reference, tokens: int) -> float:
    """The layer's relative error against the reference on fresh tokens (a collective: every rank calls)."""
    gen = torch.Generator(device=ranks.device).manual_seed(ranks.seed * 7 + ranks.rank + tokens)
    x = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16, device=ranks.device, generator=gen)
    with torch.no_grad():
        return _rel(layer(x), reference(x))


def test_a_growth_that_fails_on_one_rank_raises_on_every_rank_and_the_layer_works_on(ranks):
    layer, reference = _layer(ranks)
    tokens = 96 + 17 * ranks.rank
    worst = _check(ranks, layer, reference, tokens)
    transport = layer.dispatcher.transport
    held, capacity, generation = transport.memory_bytes, transport.capacity_bytes, transport.generation
    assert held == slots_bytes(capacity) > 0 and f"transport_memory={held / 2**20:.1f} MiB" in repr(layer)
    hog = None
    # (the suite's memory cap, OCCULT_GPU_SUITE_MEMORY_GIB, binds torch's allocator only, not the symmetric
    # memory the growth asks for: lifted while the hog holds the GPU's real free memory)
    fraction = torch.cuda.get_per_process_memory_fraction(ranks.device)
    try:
        held_back = 1.0  # (a hog that cannot be had fails every rank here, not one rank while the rest wait)
        if ranks.rank == ranks.world_size - 1:  # this rank keeps less free memory than the growth needs
            torch.cuda.set_per_process_memory_fraction(1.0, ranks.device)
            free = torch.cuda.mem_get_info(ranks.device)[0]
            try:
                hog = torch.empty(max(0, free - GROW_BYTES), dtype=torch.uint8, device=ranks.device)
            except torch.OutOfMemoryError:
                held_back = 0.0
        assert -ranks.all_max(-held_back) == 1.0, "the last rank could not hold its GPU's free memory"
        with pytest.raises(TransportMemoryError) as err:
            transport.reserve(GROW_BYTES)  # every rank asks the same (growth is collective)
    finally:
        del hog
        torch.cuda.empty_cache()  # back to the driver: later cases allocate symmetric memory outside torch's cache
        torch.cuda.set_per_process_memory_fraction(fraction, ranks.device)
    message = str(err.value)
    assert f"on rank(s) [{ranks.world_size - 1}]" in message and f"stay at {held:,} bytes" in message, message
    assert (transport.memory_bytes, transport.capacity_bytes, transport.generation) == (held, capacity, generation)
    worst = max(worst, _check(ranks, layer, reference, tokens))  # the same size again: the old buffers serve it
    assert ranks.all_max(worst) <= TOL_VS_COUNTS, worst


def test_released_buffers_grow_again_on_the_next_call(ranks):
    layer, reference = _layer(ranks)
    worst = _check(ranks, layer, reference, 64 + 5 * ranks.rank)
    transport = layer.dispatcher.transport
    held = transport.memory_bytes
    assert held > 0 and occult.release_transports() >= held
    assert transport.memory_bytes == 0 and "transport_memory=0.0 MiB" in repr(layer)
    worst = max(worst, _check(ranks, layer, reference, 200 + 3 * ranks.rank))  # grows again (another bucket)
    assert transport.memory_bytes > 0
    assert ranks.all_max(worst) <= TOL_VS_COUNTS, worst
