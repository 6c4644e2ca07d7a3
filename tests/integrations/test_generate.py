"""`hf.generate` (static KV cache, sync-free decode) on converted models vs transformers' own generate.

Two gloo ranks hold tiny random OLMoE and Qwen3-MoE models converted with a random placement, in
float32. The ranks hold different batches: rank 0 three left-padded prompts of length 7 (with an
attention mask), rank 1 a single short prompt of length 4 (no mask). Each rank's `hf.generate`
output must equal, token for token, the unconverted model's `model.generate(..., do_sample=False)`
on that rank's prompts alone: with the config's eos token, with an eos token that finishes rank 1's only row at
its third step at the latest (rank 1 then keeps stepping with padding until rank 0 is done; its output is
trimmed there, as transformers' would be), and with an eos that finishes rank 0's rows. Sampled
(temperature, top-k, top-p, a seed per rank) it must equal the plain reference sampler of
test_sampling.py on that rank's prompts. One spawn runs every case (imports dominate the run time on CPU).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

from test_sampling import reference_sample  # noqa: E402  (tests/integrations/test_sampling.py)

from occult import OccultMoE, set_sync_free  # noqa: E402
from occult.distributed import run_ranks  # noqa: E402
from occult.integrations import hf  # noqa: E402
from occult.placement import Placement  # noqa: E402

FAMILIES = ["olmoe", "qwen3_moe"]
VOCAB, NEW = 96, 8
PAD = 0


def _random_placement(E: int, layers: int, world: int, seed: int) -> Placement:
    rng = np.random.default_rng(seed)
    return Placement(np.stack([rng.permutation(np.arange(E) % world) for _ in range(layers)]), world)


def _prompts(rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rank 0: 3 prompts of length 7, left-padded (mask); rank 1: one prompt of length 4, no mask."""
    g = torch.Generator().manual_seed(seed + rank)
    if rank == 0:
        ids = torch.randint(3, VOCAB, (3, 7), generator=g)
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
        mask[1, :1] = 0
        return ids.masked_fill(mask == 0, PAD), mask
    return torch.randint(3, VOCAB, (1, 4), generator=g), None


def check_generate(rank: int, world_size: int, seed: int) -> dict:
    out: dict = {}
    for i, family in enumerate(FAMILIES):
        ref = hf.tiny_random_model(family, seed=seed + i, vocab_size=VOCAB).eval()
        model = hf.tiny_random_model(family, seed=seed + i, vocab_size=VOCAB).eval()
        blocks = hf.moe_blocks(model)
        E = int(blocks[0][1].gate.num_experts)
        hf.convert(model, placement=_random_placement(E, len(blocks), world_size, seed), dispatcher="dedup")
        layers = [m for m in model.modules() if isinstance(m, OccultMoE)]
        layers[0].sync_free = True  # a mixed setting: generate must give back exactly this
        # eos candidates: tokens each rank's reference generates early (every rank computes both)
        plain = []
        for r in range(world_size):
            r_ids, r_mask = _prompts(r, seed)
            plain.append(
                ref.generate(r_ids, attention_mask=r_mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD)
            )
        eos_rank1 = int(plain[1][0, 4 + 2])  # rank 1's single row ends by its 3rd new token
        eos_rank0 = [int(plain[0][0, 7 + 1]), int(plain[0][1, 7 + 4]), int(plain[0][2, 7 + 5])]
        ids, mask = _prompts(rank, seed)
        res = {}
        for case, eos, every in [
            ("config_eos", None, 8),
            ("eos_rank1", eos_rank1, 2 + rank),
            ("eos_rank0", eos_rank0, 1),
        ]:
            kw = dict(max_new_tokens=NEW, pad_token_id=PAD, eos_token_id=eos)
            expected = ref.generate(ids, attention_mask=mask, do_sample=False, **kw)  # eos None: the config's
            got = hf.generate(model, ids, attention_mask=mask, sync_every=every, **kw)
            res[case] = {
                "equal": bool(torch.equal(got, expected)),
                "shape": list(got.shape),
                "expected_shape": list(expected.shape),
            }
        g = torch.Generator().manual_seed(7)
        s1 = hf.generate(model, ids, NEW, attention_mask=mask, do_sample=True, temperature=0.8, top_k=5, generator=g)
        s2 = hf.generate(
            model,
            ids,
            NEW,
            attention_mask=mask,
            do_sample=True,
            temperature=0.8,
            top_k=5,
            generator=torch.Generator().manual_seed(7),
        )
        res["sample_repeatable"] = bool(torch.equal(s1, s2)) and s1.shape == (ids.shape[0], ids.shape[1] + NEW)
        # sampled with every warper, a seed per rank: the plain reference sampler on this rank's prompts alone,
        # drawing [3, V] numbers per step (the batch padded to rank 0's 3 rows); the config's eos
        got = hf.generate(
            model,
            ids,
            NEW,
            attention_mask=mask,
            pad_token_id=PAD,
            do_sample=True,
            temperature=0.9,
            top_k=12,
            top_p=0.9,
            seed=50 + rank,
        )
        want = reference_sample(
            ref,
            ids,
            torch.ones_like(ids) if mask is None else mask,
            NEW,
            50 + rank,
            0.9,
            12,
            0.9,
            eos=[int(ref.generation_config.eos_token_id)],
            pad=PAD,
            padded_batch=3,
        )
        res["sampled_equals_reference"] = bool(torch.equal(got, want))
        res["sync_free_restored"] = [m.sync_free for m in layers] == [True] + [False] * (len(layers) - 1)
        out[family] = res
    return out


_RESULTS: list = []


@pytest.fixture(scope="module")
def results():
    if not _RESULTS:
        _RESULTS.extend(run_ranks(check_generate, 2, 11, timeout_s=300))
    return _RESULTS


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", ["config_eos", "eos_rank1", "eos_rank0"])
def test_generate_matches_transformers(results, family, case):
    for rank, res in enumerate(results):
        r = res[family][case]
        assert r["equal"], (family, case, rank, r)


def test_eos_cases_stop_early(results):
    """The cases do what they claim: one rank stops early while the other goes on to the end."""
    for family in FAMILIES:
        r0, r1 = results[0][family], results[1][family]
        assert r1["eos_rank1"]["shape"][1] <= 4 + 3 and r0["eos_rank1"]["shape"] == [3, 7 + NEW], family
        assert r0["eos_rank0"]["shape"][1] < 7 + NEW, family
        assert r0["config_eos"]["shape"] == [3, 7 + NEW] and r1["config_eos"]["shape"] == [1, 4 + NEW], family


def test_sampling_repeatable_and_flags_restored(results):
    for res in results:
        for family in FAMILIES:
            assert res[family]["sample_repeatable"], family
            assert res[family]["sampled_equals_reference"], family
            assert res[family]["sync_free_restored"], family


def test_sync_free_restored_when_generate_fails(monkeypatch):
    """Single process: a converted one-rank model; a failing prefill still restores every flag."""
    model = hf.convert(hf.tiny_random_model("olmoe", seed=0, vocab_size=VOCAB).eval())
    layers = [m for m in model.modules() if isinstance(m, OccultMoE)]
    set_sync_free(model, False)
    layers[1].sync_free = True
    ids = torch.randint(3, VOCAB, (2, 5))
    before = [m.sync_free for m in layers]
    ref = hf.generate(model, ids, 3)
    assert [m.sync_free for m in layers] == before and ref.shape == (2, 8)

    from occult.integrations.hf.generate import StaticDecoder

    def boom(self, *a, **k):
        assert all(m.sync_free for m in layers)  # decoding runs sync-free
        raise RuntimeError("boom")

    monkeypatch.setattr(StaticDecoder, "step", boom)
    with pytest.raises(RuntimeError, match="boom"):
        hf.generate(model, ids, 3, reuse=False)
    assert [m.sync_free for m in layers] == before


def test_bad_arguments():
    model = hf.tiny_random_model("olmoe", seed=0, vocab_size=VOCAB).eval()
    ids = torch.randint(3, VOCAB, (1, 4))
    with pytest.raises(ValueError, match="max_new_tokens"):
        hf.generate(model, ids, 0)
    with pytest.raises(ValueError, match="does not match"):
        hf.generate(model, ids, 2, attention_mask=torch.ones(1, 3))
    with pytest.raises(ValueError, match="cuda_graph=True"):
        hf.generate(model, ids, 2, cuda_graph=True)


def _decoder_after_prefill(model, ids, max_len):
    from occult.integrations.hf.generate import StaticDecoder
    from occult.integrations.hf.sampling import Sampling, TokenSelector

    dec = StaticDecoder(model, ids.shape[0], max_len, TokenSelector(ids.shape[0], ids.device, Sampling(), [], PAD))
    set_sync_free(model, False)
    dec.select(dec.prefill(ids, torch.ones_like(ids)))
    set_sync_free(model, True)
    return dec


def test_decoder_warm_up_and_steps_stay_inside_the_cache():
    """The capture's warm-up (issue 26): a decoder with room for one step (prompt + 1 new token) warms up
    from the same state each time (before the fix the 2nd warm-up forward wrote past the cache: an
    IndexError here, a device-side assert in a CUDA-graph capture); a step past the cache is a ValueError."""
    model = hf.convert(hf.tiny_random_model("olmoe", seed=3, vocab_size=VOCAB).eval())
    ids = torch.randint(
        3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(int.from_bytes(os.urandom(2), "little"))
    )
    plain = _decoder_after_prefill(model, ids, ids.shape[1] + 1)
    want = plain.step().clone()
    dec = _decoder_after_prefill(model, ids, ids.shape[1] + 1)
    before = [t.clone() for t in dec._state()]
    dec.warm_up(3)
    assert all(torch.equal(a, b) for a, b in zip(before, dec._state()))
    assert dec.free_slots == 1
    torch.testing.assert_close(dec.step(), want)  # the warm-up's K/V write did not change the step
    assert dec.free_slots == 0
    with pytest.raises(ValueError, match="cache slot 6 of a StaticDecoder holding 6 positions"):
        dec.step()
    with pytest.raises(ValueError, match="cache slot"):
        dec.warm_up(1)
    from occult.integrations.hf.generate import StaticDecoder

    with pytest.raises(ValueError, match="before prefill"):
        StaticDecoder(model, 2, 9).step(ids[:, 0])
    set_sync_free(model, False)


def test_generate_one_new_token_between_longer_calls():
    """The call sequence of issue 26's failing script (n, n, then 1, then n new tokens): each call equals
    transformers' greedy generate, 1 token is the first of n, and the kept decoder serves the shorter call
    (a longer one needs a new one); reuse=False leaves the kept one alone."""
    ref = hf.tiny_random_model("olmoe", seed=4, vocab_size=VOCAB).eval()
    model = hf.convert(hf.tiny_random_model("olmoe", seed=4, vocab_size=VOCAB).eval())
    ids = torch.randint(3, VOCAB, (2, 6))
    expected = ref.generate(
        ids,
        max_new_tokens=NEW,
        do_sample=False,
        pad_token_id=PAD,
        eos_token_id=None,
        attention_mask=torch.ones_like(ids),
    )
    decoders, outs = [], []
    for n, reuse in ((NEW, True), (NEW, True), (1, True), (1, False), (NEW, True), (NEW + 2, True)):
        outs.append(hf.generate(model, ids, n, eos_token_id=[], reuse=reuse))
        decoders.append(model._occult_decoder[1])
        assert torch.equal(outs[-1], expected[:, : ids.shape[1] + n]) if n <= NEW else outs[-1].shape[1] == 6 + n
    assert torch.equal(outs[-1][:, : 6 + NEW], expected)
    assert all(d is decoders[0] for d in decoders[:5]) and decoders[5] is not decoders[0]
    assert decoders[5].max_len == 6 + NEW + 2


def test_a_model_changed_between_calls_gets_a_new_decoder():
    """The decoder kept between calls is built again when the model changed (here its dtype: the kept cache's K/V
    are float32, and a float64 model's writes into them failed with torch's dtype error; a weight replaced, which
    a kept CUDA graph would read from freed memory); each call equals a fresh decoder's, and an unchanged model
    keeps its decoder."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    model = hf.convert(hf.tiny_random_model("olmoe", seed=seed, vocab_size=VOCAB).eval())
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(seed))
    hf.generate(model, ids, NEW, eos_token_id=[])
    first = model._occult_decoder.decoder
    hf.generate(model, ids, NEW, eos_token_id=[])
    assert model._occult_decoder.decoder is first
    model.double()
    got = hf.generate(model, ids, NEW, eos_token_id=[])
    assert torch.equal(got, hf.generate(model, ids, NEW, eos_token_id=[], reuse=False))
    second = model._occult_decoder.decoder
    assert second is not first and second.dtype == torch.float64
    with torch.no_grad():
        model.lm_head.weight.data = -model.lm_head.weight.data  # another tensor: the old one is freed
    got = hf.generate(model, ids, NEW, eos_token_id=[])
    assert torch.equal(got, hf.generate(model, ids, NEW, eos_token_id=[], reuse=False))
    assert model._occult_decoder.decoder is not second
