"""`hf.GraphedForward` on one GPU: each replay with fresh ids gives the eager forward's last-position
logits (fp32, within 1e-5). Single-process GPU tests (tests/gpu/run.sh's second stage);
with several ranks: tests/gpu/test_collective_hf.py."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'occult[hf]')")

from occult.integrations import hf  # noqa: E402

VOCAB = 96


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_replays_give_the_eager_logits():
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    model = hf.convert(hf.tiny_random_model("olmoe", seed=seed, vocab_size=VOCAB)).to("cuda", torch.float32).eval()
    graphed = hf.GraphedForward(model, 4, 9)
    gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    with torch.no_grad():
        for _ in range(3):
            ids = torch.randint(3, VOCAB, (4, 9), generator=gen).cuda()
            got = graphed(ids).clone()
            want = model(input_ids=ids, use_cache=False).logits[:, -1]
            worst = max(worst, ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item())
    graphed.release()
    assert worst < 1e-5, (seed, worst)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_compiled_layers_captured_under_autocast_replay_the_eager_logits():
    """An fp32 model with `compile_layers`, warmed up and captured inside one bf16 autocast region: the capture
    makes its own weight casts (the cache off, `autocast_uncached`) and its compiled layers do not recompile
    (the warm-up ran in the same autocast state); replays in a later region give the eager logits."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    model = hf.convert(hf.tiny_random_model("olmoe", seed=seed, vocab_size=VOCAB)).to("cuda", torch.float32).eval()
    hf.compile_layers(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        graphed = hf.GraphedForward(model, 2, 9)
    junk = [torch.full_like(p, float("nan"), dtype=torch.bfloat16) for p in model.parameters()]  # freed casts reused
    worst = 0.0
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        for _ in range(2):
            ids = torch.randint(3, VOCAB, (2, 9), generator=gen).cuda()
            got = graphed(ids).float().clone()
            want = model(input_ids=ids, use_cache=False).logits[:, -1].float()
            worst = max(worst, ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item())
    del junk
    graphed.release()
    assert worst < 2e-2, (seed, worst)  # bf16 casts; the same kernels, compiled once more for the cache's state


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_changed_model_is_captured_again():
    """A weight replaced after the capture (the old one freed, its memory refilled with NaN where the allocator
    reuses it): the next call captures again and gives the changed model's eager logits; calls with nothing changed,
    or a setting switched and back before the call, replay without capturing."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    model = hf.convert(hf.tiny_random_model("olmoe", seed=seed, vocab_size=VOCAB)).to("cuda", torch.float32).eval()
    graphed = hf.GraphedForward(model, 2, 9, warmup=1)
    gen = torch.Generator().manual_seed(seed)

    def worst_error() -> float:
        ids = torch.randint(3, VOCAB, (2, 9), generator=gen).cuda()
        with torch.no_grad():
            got = graphed(ids).clone()
            want = model(input_ids=ids, use_cache=False).logits[:, -1]
        return ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()

    assert worst_error() < 1e-5 and worst_error() < 1e-5 and graphed.captures == 1
    with torch.no_grad():
        model.lm_head.weight.data = 2 * model.lm_head.weight.data  # the captured weight's memory is free now
    junk = torch.full((1 << 20,), float("nan"), device="cuda")  # (reuses it, where the allocator allows)
    assert worst_error() < 1e-5 and graphed.captures == 2, graphed.captures
    del junk
    model.train()  # a plain setting of every module (the capture ran in eval mode)
    model.eval()
    assert worst_error() < 1e-5 and graphed.captures == 2  # switched back before the call: nothing changed
    graphed.release()
