"""`hf.generate(..., cuda_graph=True)` on one GPU, the call sequence that ended in a device-side assert (issue 26).

A benchmark timed a decode step as (generate n tokens - generate 1 token) / (n - 1): the call with
one new token built a decoder whose cache held prompt + 1 positions, and the capture's two warm-up
forwards wrote cache slots prompt and prompt + 1, the second past the cache (ScatterGatherKernel
index out of bounds; the process's CUDA context lost). Now the warm-up writes the next slot only,
one new token captures nothing, and a step past the cache is a ValueError before any launch.

Runs in a plain pytest process (tests/gpu/run.sh's second stage) and spawns its own one-rank NCCL
group, as `torchrun --nproc-per-node 1` did in the report, so a device-side assert cannot break
the other tests' CUDA context.
"""

from __future__ import annotations

import os

import pytest
import torch

from occult.distributed import run_ranks

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

VOCAB, PROMPT, NEW = 96, 12, 8


def capture_sequence_worker(rank: int, world_size: int, seed: int) -> dict:
    from occult import set_sync_free
    from occult.integrations import hf
    from occult.integrations.hf.generate import StaticDecoder
    from occult.integrations.hf.sampling import Sampling, TokenSelector

    dev = torch.device("cuda", torch.cuda.current_device())
    model = hf.tiny_random_model("olmoe", seed=seed, vocab_size=VOCAB).to(device=dev, dtype=torch.bfloat16).eval()
    hf.convert(model, dispatcher="dedup")
    g = torch.Generator(device=dev).manual_seed(seed)
    out: dict = {}
    for b in (1, 4):
        if hasattr(model, "_occult_decoder"):
            del model._occult_decoder
        ids = torch.randint(3, VOCAB, (b, PROMPT), device=dev, generator=g)
        eager = hf.generate(model, ids, NEW, cuda_graph=False, eos_token_id=[], reuse=False)
        calls = [(1, True), (NEW, True), (NEW, True), (1, True), (2, True), (1, False), (NEW, True)]
        graph = [hf.generate(model, ids, n, cuda_graph=True, eos_token_id=[], reuse=r) for n, r in calls]
        out[f"B{b}"] = [bool(torch.equal(g_, eager[:, : g_.shape[1]])) for g_ in graph]
        kw = dict(do_sample=True, temperature=0.9, top_k=20, seed=seed + b, eos_token_id=[])
        sampled_eager = hf.generate(model, ids, NEW, cuda_graph=False, **kw)
        out[f"B{b}_sampled"] = bool(torch.equal(hf.generate(model, ids, NEW, cuda_graph=True, **kw), sampled_eager))
        # the capture itself with room for one step (what the 1-token call did before the fix)
        steps = []
        for capture in (False, True):
            dec = StaticDecoder(model, b, PROMPT + 1, TokenSelector(b, dev, Sampling(), [], 0))
            set_sync_free(model, False)
            dec.select(dec.prefill(ids, torch.ones_like(ids)))
            set_sync_free(model, True)
            if capture:
                dec.capture()
            steps.append(dec.step().clone())
            try:
                dec.step()
                out[f"B{b}_past_cache_{capture}"] = "no error"
            except ValueError as exc:
                out[f"B{b}_past_cache_{capture}"] = str(exc)
            set_sync_free(model, False)
        torch.cuda.synchronize()  # the CUDA context is intact
        out[f"B{b}_capture_at_limit"] = bool(torch.equal(steps[0].argmax(-1), steps[1].argmax(-1))) and float(
            (steps[0] - steps[1]).abs().max()
        ) <= 1e-2 * float(steps[0].abs().max())
    out["before_prefill"] = ""
    try:
        StaticDecoder(model, 1, 4).step(torch.zeros(1, dtype=torch.long, device=dev))
    except ValueError as exc:
        out["before_prefill"] = str(exc)
    return out


def test_generate_graph_after_one_token_call():
    seed = int.from_bytes(os.urandom(2), "little")
    (res,) = run_ranks(capture_sequence_worker, 1, seed, backend="nccl", timeout_s=300)
    for b in (1, 4):
        assert res[f"B{b}"] == [True] * 7, (seed, res)
        assert res[f"B{b}_sampled"] and res[f"B{b}_capture_at_limit"], (seed, res)
        for capture in (False, True):
            assert "cache slot 13 of a StaticDecoder holding 13 positions" in res[f"B{b}_past_cache_{capture}"], res
    assert "before prefill" in res["before_prefill"], res


def changed_model_worker(rank: int, world_size: int, seed: int) -> dict:
    from occult.integrations import hf

    dev = torch.device("cuda", torch.cuda.current_device())
    model = hf.tiny_random_model("olmoe", seed=seed, vocab_size=VOCAB).to(device=dev, dtype=torch.bfloat16).eval()
    hf.convert(model, dispatcher="dedup")
    ids = torch.randint(3, VOCAB, (2, PROMPT), device=dev, generator=torch.Generator(device=dev).manual_seed(seed))
    out = {"first": hf.generate(model, ids, NEW, cuda_graph=True, eos_token_id=[])}
    kept = model._occult_decoder.decoder
    with torch.no_grad():  # another tensor (the captured one freed, its memory refilled with NaN where reused)
        model.lm_head.weight.data = model.lm_head.weight.data.flip(0).contiguous()
    junk = torch.full((1 << 20,), float("nan"), device=dev)
    out["changed"] = hf.generate(model, ids, NEW, cuda_graph=True, eos_token_id=[])
    out["changed_eager"] = hf.generate(model, ids, NEW, cuda_graph=False, eos_token_id=[], reuse=False)
    out["renewed"] = model._occult_decoder.decoder is not kept
    del junk
    kept = model._occult_decoder.decoder
    out["again"] = hf.generate(model, ids, NEW, cuda_graph=True, eos_token_id=[])
    out["kept"] = model._occult_decoder.decoder is kept and not kept.needs_capture()
    return {k: v.cpu() if torch.is_tensor(v) else v for k, v in out.items()}


def test_generate_graph_after_the_model_changed():
    """A weight replaced between two captured `generate` calls (the lm_head's rows reversed: other tokens): the
    second call builds a new decoder and captures again, giving the eager decode of the changed model, not the
    first model's tokens; a third call with nothing changed keeps that decoder and its graph."""
    seed = int.from_bytes(os.urandom(2), "little")
    (res,) = run_ranks(changed_model_worker, 1, seed, backend="nccl", timeout_s=300)
    assert torch.equal(res["changed"], res["changed_eager"]) and not torch.equal(res["changed"], res["first"]), seed
    assert res["renewed"] and res["kept"] and torch.equal(res["again"], res["changed"]), (seed, res)
