"""`occult.integrations.hf.sampling`: the warpers equal transformers' own, the draw has the right
distribution, `hf.generate(do_sample=True)` with a seed equals a plain reference sampler token for
token (single process; the 2-rank case is in test_generate.py), and bad settings fail clearly."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

from occult.integrations import hf  # noqa: E402
from occult.integrations.hf.sampling import Sampling, TokenSelector, filter_logits, sample  # noqa: E402

VOCAB = 96


def _hf_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    procs = LogitsProcessorList()
    if temperature != 1.0:
        procs.append(TemperatureLogitsWarper(temperature))
    if top_k:
        procs.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p))
    return procs


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [
        (1.0, None, None),
        (0.7, None, None),
        (1.3, 5, None),
        (1.0, None, 0.9),
        (0.8, 10, 0.5),
        (2.0, 1, 0.99),
        (1.0, 200, 0.3),
        (0.5, 0, 1.0),
    ],
)
def test_filter_equals_transformers_warpers(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(hash((temperature, top_k, top_p)) % 2**31)
    scores = torch.randn(6, 150, generator=g) * 3
    scores[0, :40] = scores[0, 40]  # ties at the k-th and inside the nucleus
    scores[1] = 0.0
    ids = torch.zeros(6, 1, dtype=torch.long)
    want = _hf_warpers(temperature, top_k, top_p)(ids, scores.clone())
    got = filter_logits(scores, temperature, top_k, top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(got, want)


def test_draw_has_the_filtered_distribution():
    """20,000 draws from one row: every kept token's frequency within 5 sigma, dropped ones never."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    s = Sampling(True, temperature=0.9, top_k=6, top_p=0.95)
    p = filter_logits(logits[None], 0.9, 6, 0.95).softmax(-1)[0].double()
    n = 20_000
    got = sample(logits.expand(n, -1).clone(), s, torch.Generator().manual_seed(3))
    freq = torch.bincount(got, minlength=8).double() / n
    assert torch.all(freq[p == 0] == 0) and (p == 0).sum() >= 2
    sigma = (p * (1 - p) / n).sqrt()
    assert torch.all((freq - p).abs() <= 5 * sigma + 1e-12), (freq, p)


def test_greedy_and_top_k_1_pick_the_argmax():
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample(logits, Sampling(), None), logits.argmax(-1))
    assert torch.equal(sample(logits, Sampling(True, 1.7, 1), torch.Generator().manual_seed(1)), logits.argmax(-1))


def test_selector_finishes_rows_and_pads():
    sel = TokenSelector(3, torch.device("cpu"), Sampling(), eos=[4], pad=0)
    sel.reset(2)  # row 2: a padding row, finished from the start
    logits = torch.zeros(3, 8)
    logits[:, 4] = 1  # eos everywhere
    assert sel(logits).tolist() == [4, 4, 0] and sel.unfinished_B.tolist() == [False, False, False]
    logits[:, 5] = 2
    assert sel(logits).tolist() == [0, 0, 0]


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(do_sample=True, temperature=0.0), "temperature must be > 0"),
        (dict(do_sample=True, top_k=-1), "top_k must be"),
        (dict(do_sample=True, top_p=0.0), "top_p must be in"),
        (dict(do_sample=True, top_p=1.5), "top_p must be in"),
    ],
)
def test_bad_sampling_settings(kw, message):
    with pytest.raises(ValueError, match=message):
        Sampling(**kw)
    model = hf.tiny_random_model("olmoe", seed=0, vocab_size=VOCAB).eval()
    with pytest.raises(ValueError, match=message):
        hf.generate(model, torch.randint(3, VOCAB, (1, 4)), 2, **kw)


# ------------------------------------------------------------ reference sampler
def reference_sample(model, ids, mask, new, seed, temperature, top_k, top_p, eos, pad, padded_batch=None):
    """Plain: full recompute every step, per-row Python warpers, the documented draw.

    The draws: one generator seeded with `seed`, [padded_batch, V] Exp(1) numbers per step (the
    padded batch of `generate`: rows beyond this rank's batch draw too).
    """
    B = ids.shape[0]
    P = padded_batch or B
    g = torch.Generator().manual_seed(seed)
    seq, m = ids.clone(), mask.clone()
    done = [False] * B
    out = []
    for _ in range(new):
        pos = (m.cumsum(-1) - 1).clamp_min(0)
        with torch.no_grad():
            logits = model(input_ids=seq, attention_mask=m, position_ids=pos, use_cache=False).logits[:, -1].float()
        noise = torch.empty(P, logits.shape[-1]).exponential_(generator=g)
        step = []
        for r in range(B):
            scores = logits[r] / temperature if temperature != 1.0 else logits[r].clone()
            if top_k:
                kth = sorted(scores.tolist(), reverse=True)[min(top_k, len(scores)) - 1]
                scores[scores < kth] = float("-inf")
            if top_p is not None and top_p < 1.0:
                order = torch.argsort(scores, stable=True)  # ascending, like torch.sort
                cum = scores[order].softmax(-1).cumsum(-1).tolist()
                drop = [int(order[j]) for j in range(len(cum) - 1) if cum[j] <= 1 - top_p]  # keep the top one
                scores[drop] = float("-inf")
            probs = scores.softmax(-1)
            tok = int(torch.argmax(probs / noise[r]))
            if done[r]:
                tok = pad
            elif tok in eos:
                done[r] = True
            step.append(tok)
        out.append(step)
        seq = torch.cat([seq, torch.tensor(step)[:, None]], 1)
        m = torch.cat([m, torch.ones(B, 1, dtype=m.dtype)], 1)
        if all(done):
            break
    return torch.cat([ids, torch.tensor(out).T], 1)


@pytest.mark.parametrize(
    "temperature, top_k, top_p", [(1.0, None, None), (0.8, 7, None), (1.2, None, 0.8), (0.9, 12, 0.9)]
)
def test_generate_sampled_equals_reference(temperature, top_k, top_p):
    ref = hf.tiny_random_model("qwen3_moe", seed=4, vocab_size=VOCAB).eval()
    model = hf.convert(hf.tiny_random_model("qwen3_moe", seed=4, vocab_size=VOCAB).eval())  # one rank
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(3, VOCAB, (3, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    ids = ids.masked_fill(mask == 0, 0)
    kw = dict(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)
    got = hf.generate(model, ids, 10, attention_mask=mask, eos_token_id=[], pad_token_id=0, seed=123, **kw)
    want = reference_sample(ref, ids, mask, 10, 123, temperature, top_k, top_p, eos=[], pad=0)
    assert torch.equal(got, want), (got[:, 6:], want[:, 6:])
    # the same seed again (decoder reused) and through a generator: the same tokens; another seed: others
    again = hf.generate(model, ids, 10, attention_mask=mask, eos_token_id=[], pad_token_id=0, seed=123, **kw)
    other = hf.generate(model, ids, 10, attention_mask=mask, eos_token_id=[], pad_token_id=0, seed=124, **kw)
    assert torch.equal(again, got) and not torch.equal(other, got)
    # greedy on the same decoder path is unchanged: transformers' own greedy generate
    greedy = hf.generate(model, ids, 10, attention_mask=mask, eos_token_id=[], pad_token_id=0)
    assert torch.equal(
        greedy,
        ref.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0),
    )


def test_generate_sampled_with_eos_equals_reference():
    ref = hf.tiny_random_model("olmoe", seed=6, vocab_size=VOCAB).eval()
    model = hf.convert(hf.tiny_random_model("olmoe", seed=6, vocab_size=VOCAB).eval())
    ids = torch.randint(3, VOCAB, (4, 5), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    free = reference_sample(ref, ids, mask, 12, 77, 1.0, 20, None, eos=[], pad=0)
    eos = [int(free[0, 5 + 2]), int(free[2, 5 + 5])]  # rows 0 and 2 finish early (others may too)
    got = hf.generate(model, ids, 12, eos_token_id=eos, pad_token_id=0, do_sample=True, top_k=20, seed=77, sync_every=1)
    want = reference_sample(ref, ids, mask, 12, 77, 1.0, 20, None, eos=eos, pad=0)
    assert torch.equal(got, want), (got[:, 5:], want[:, 5:])
    assert (got[0, 8:] == 0).all()


def test_token_choice_has_no_host_sync():
    """Nothing in the choice reads a device value on the host (what CUDA-graph capture forbids): no item,
    nonzero, unique, masked_select... (checked at the dispatcher, on CPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    syncing = {
        "_local_scalar_dense",
        "nonzero",
        "_unique2",
        "unique_consecutive",
        "unique_dim",
        "masked_select",
        "equal",
        "is_nonzero",
        "_assert_async",
    }

    class Probe(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in syncing:
                self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    for sampling in (Sampling(), Sampling(True, 0.7, 10, 0.85)):
        sel = TokenSelector(4, torch.device("cpu"), sampling, eos=list(range(3, 20)), pad=0)  # a long eos list
        sel.reset(3, seed=5)
        with Probe() as probe:
            for _ in range(3):
                sel(logits)
        assert probe.seen == [], (sampling, probe.seen)
    with Probe() as probe:  # the probe sees what it should
        logits.argmax().item()
    assert probe.seen == ["aten._local_scalar_dense.default"]
