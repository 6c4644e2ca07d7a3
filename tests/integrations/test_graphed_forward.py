"""`hf.GraphedForward`: what it refuses on the CPU (the capture itself runs in the GPU suite and in
benchmarks/e2e.py's `/graph` variants, whose replay is checked against the eager forward)."""

from __future__ import annotations

import random

import pytest
import torch

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


def sdpa_calls(model, ids, capturing: bool, monkeypatch) -> tuple[list[tuple[bool, bool]], torch.Tensor]:
    """Per attention call of `model(input_ids=ids)`: (was a mask passed, is_causal), and the logits; `capturing`:
    transformers is told a CUDA graph capture runs (torch's answer replaced, as on a GPU inside one)."""
    import torch.nn.functional as F

    calls: list[tuple[bool, bool]] = []
    plain = F.scaled_dot_product_attention

    def recorded(*args, **kwargs):
        calls.append((kwargs.get("attn_mask") is not None, bool(kwargs.get("is_causal", False))))
        return plain(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(F, "scaled_dot_product_attention", recorded)
        m.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits
    return calls, logits


@pytest.mark.parametrize("model_type", ["olmoe", "qwen3_moe"])
def test_masks_as_eager_under_a_capture(model_type, monkeypatch):
    """Under a capture transformers materialises the causal mask (SDPA without flash attention); inside
    `masks_as_eager` it passes none and asks for `is_causal`, as in an eager call, with the same logits; the
    answers are restored after."""
    from transformers import masking_utils
    from transformers.utils import import_utils

    from occult.integrations import hf
    from occult.integrations.hf.graphed import masks_as_eager

    seed = random.randrange(2**31)
    model = hf.tiny_random_model(model_type, seed=seed, vocab_size=64).eval()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(seed))
    eager, eager_logits = sdpa_calls(model, ids, False, monkeypatch)
    captured, captured_logits = sdpa_calls(model, ids, True, monkeypatch)
    assert eager and all(c == (False, True) for c in eager), eager
    assert captured and all(masked for masked, _ in captured), captured  # what the scope is there for
    saved = (import_utils.is_cuda_stream_capturing, masking_utils.find_packed_sequence_indices)
    with masks_as_eager():
        inside, inside_logits = sdpa_calls(model, ids, True, monkeypatch)
    assert inside == eager, (inside, eager)
    assert (import_utils.is_cuda_stream_capturing, masking_utils.find_packed_sequence_indices) == saved
    scale = eager_logits.abs().max().item()
    torch.testing.assert_close(inside_logits, eager_logits, rtol=0, atol=1e-5 * scale)
    torch.testing.assert_close(captured_logits, eager_logits, rtol=0, atol=1e-5 * scale)
