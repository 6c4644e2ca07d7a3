"""`hf.GraphedForward`: what it refuses on the CPU (the capture itself runs in the GPU suite and in
benchmarks/e2e.py's `/graph` variants, whose replay is checked against the eager forward)."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("transformers")

from occult.distributed import run_ranks  # noqa: E402


def waiting_worker(rank: int, world: int, seed: int) -> dict:
    from occult import ExecConfig, set_sync_free
    from occult.integrations import hf
    from occult.integrations.hf.graphed import host_waiting_layers

    model = hf.convert(
        hf.tiny_random_model("olmoe", seed=seed, vocab_size=64), execution=ExecConfig(dispatcher="dedup")
    )
    out = {"counts": host_waiting_layers(model), "blocks": len(hf.moe_blocks(model))}
    set_sync_free(model, True)
    out["sync_free"] = host_waiting_layers(model)
    set_sync_free(model, False)
    try:
        hf.GraphedForward(model, 2, 8)
    except ValueError as err:
        out["error"] = str(err)
    return out


def test_layers_that_wait_are_named_and_a_cpu_model_is_refused():
    """On 2 CPU gloo ranks: every MoE layer over the count exchange waits for the GPU (named), none
    once sync-free; a CPU model is refused with the reason, on every rank."""
    for out in run_ranks(waiting_worker, 2, random.randrange(2**31), timeout_s=180):
        assert len(out["counts"]) == out["blocks"] > 0 and all("experts" in n for n in out["counts"]), out
        assert out["sync_free"] == []
        assert "captures a CUDA graph: the model is on cpu" in out["error"], out


def test_one_process_model_has_no_waiting_layer():
    from occult.integrations import hf
    from occult.integrations.hf.graphed import host_waiting_layers

    model = hf.convert(hf.tiny_random_model("olmoe", seed=1, vocab_size=64))
    assert host_waiting_layers(model) == []


def test_warmup_takes_the_capture_mask_path():
    """The warm-up answers transformers' 'is a CUDA graph capturing?' with yes (so a compiled decoder
    layer meets in the warm-up the explicit causal mask it meets in the capture, and does not
    recompile inside it), and only there."""
    from transformers.utils import import_utils

    from occult.integrations.hf.graphed import masks_as_under_capture

    before = import_utils.is_tracing()
    with masks_as_under_capture():
        assert import_utils.is_tracing() and import_utils.is_cuda_stream_capturing()
    assert import_utils.is_tracing() == before is False and not import_utils.is_cuda_stream_capturing()
