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
    from occult.integrations import hf
    from occult.integrations.hf.generate import StaticDecoder

    dev = torch.device("cuda", torch.cuda.current_device())
    model = hf.tiny_random_model("olmoe", seed=seed, vocab_size=VOCAB).to(device=dev, dtype=torch.bfloat16).eval()
    hf.convert(model, dispatcher="dedup")
    g = torch.Generator(device=dev).manual_seed(seed)
    out: dict = {}
    for b in (1, 4):
        ids = torch.randint(3, VOCAB, (b, PROMPT), device=dev, generator=g)
        eager = hf.generate(model, ids, NEW, cuda_graph=False, eos_token_id=[])
        graph = [hf.generate(model, ids, n, cuda_graph=True, eos_token_id=[]) for n in (NEW, NEW, 1, 2, NEW)]
        out[f"B{b}"] = [bool(torch.equal(g_, eager[:, : g_.shape[1]])) for g_ in graph]
        kw = dict(do_sample=True, temperature=0.9, top_k=20, seed=seed + b, eos_token_id=[])
        sampled_eager = hf.generate(model, ids, NEW, cuda_graph=False, **kw)
        out[f"B{b}_sampled"] = bool(torch.equal(hf.generate(model, ids, NEW, cuda_graph=True, **kw), sampled_eager))
    dec = model._occult_decoder[1]  # the last call's decoder (captured, prompt + NEW positions)
    out["captured"] = dec.graph is not None
    for _ in range(dec.free_slots):
        dec.step()
    try:
        dec.step()
        out["past_cache"] = "no error"
    except ValueError as exc:
        out["past_cache"] = str(exc)
    torch.cuda.synchronize()  # the CUDA context is intact
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
        assert res[f"B{b}"] == [True] * 5, (seed, res)
        assert res[f"B{b}_sampled"], (seed, res)
    assert res["captured"] and "cache slot" in res["past_cache"], res
    assert "before prefill" in res["before_prefill"], res
