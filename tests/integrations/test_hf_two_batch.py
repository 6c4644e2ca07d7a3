"""Two-batch overlap on converted transformers models (2 gloo ranks, float32).

`occult.two_batch_overlap(lambda ids: model(ids).logits, ids)` must give the logits and every
gradient of the plain converted model on the same batch (which tests/integrations/test_hf.py
checks against the unconverted model), for a family without shared experts (OLMoE), one with
a shared expert (Qwen2-MoE) and one with a dense first layer and shared experts (DeepSeek-V3);
and the halves must really interleave (each MoE layer entered A, B, A, B ...). The same through
the switch `hf.set_two_batch(model)`, with an attention mask and labels (the model's own loss).
"""

from __future__ import annotations

import os
import random
import threading

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
try:
    import transformers
except ImportError:
    pytest.skip("transformers is not installed (pip install 'occult[hf]')", allow_module_level=True)

from occult import two_batch_overlap  # noqa: E402
from occult.distributed import run_ranks  # noqa: E402
from occult.integrations import hf  # noqa: E402

FAMILIES = ["olmoe", "qwen2_moe", "deepseek_v3"]
VOCAB, SEQ = 96, 10


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)


def _converted(path: str, seed: int, log: list | None = None):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.convert(model, dispatcher="dedup")
    model.train()
    if log is not None:
        for name, block in hf.moe_blocks(model):
            block.register_forward_pre_hook(
                lambda mod, args, name=name: log.append((name, threading.current_thread().name[-1])))
    return model


def check(rank: int, world_size: int, dirs: dict, seed: int) -> dict:
    out = {}
    for family, path in dirs.items():
        log: list = []
        plain, tbo = _converted(path, seed), _converted(path, seed, log)
        g = torch.Generator().manual_seed(seed + rank)
        rows = 3 + rank  # uneven batches: halves of 1/2 and 2/2 rows
        ids = torch.randint(3, VOCAB, (rows, SEQ), generator=g)
        weights = torch.randn(rows, SEQ, VOCAB, generator=g)
        logits = plain(ids).logits
        (logits * weights).sum().backward()
        logits_tbo = two_batch_overlap(lambda x: tbo(x).logits, ids)
        (logits_tbo * weights).sum().backward()
        grads = dict(tbo.named_parameters())
        worst = max(((_rel(grads[n].grad, p.grad), n) for n, p in plain.named_parameters() if p.grad is not None))
        names = [name for name, _ in hf.moe_blocks(tbo)]
        out[family] = {"logits": _rel(logits_tbo, logits), "grad_worst": worst,
                       "interleaved": log == [(n, h) for n in names for h in "AB"], "log": log[:6]}
        out[family].update(check_switch(path, seed, ids))
    return out


def check_switch(path: str, seed: int, ids: torch.Tensor) -> dict:
    """`hf.set_two_batch(model)`: model(input_ids, attention_mask, labels) as the plain model gives it
    (a left-padded row included), generate falls back to the plain forward, router logits refused."""
    plain, switched = _converted(path, seed), hf.set_two_batch(_converted(path, seed))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding in the first row
    labels = ids.masked_fill(mask == 0, -100)
    out_plain = plain(input_ids=ids, attention_mask=mask, labels=labels)
    out_plain.loss.backward()
    calls = []
    switched.model.layers[0].register_forward_pre_hook(lambda m, a, kw: calls.append(a[0].shape[0] if a else
                                                                                   kw["hidden_states"].shape[0]),
                                                        with_kwargs=True)
    out = switched(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    grads = dict(switched.named_parameters())
    worst = max((_rel(grads[n].grad, p.grad) for n, p in plain.named_parameters() if p.grad is not None))
    res = {"switch_loss": abs(out.loss.item() - out_plain.loss.item()) / abs(out_plain.loss.item()),
           "switch_logits": _rel(out.logits, out_plain.logits), "switch_grad": worst,
           "switch_halves": calls == [(ids.shape[0] + 1) // 2, ids.shape[0] // 2]}
    kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, synced_gpus=True)
    with torch.no_grad():
        res["switch_generate"] = bool(torch.equal(switched.generate(ids[:, :4], **kw), plain.generate(ids[:, :4], **kw)))
    try:
        switched(input_ids=ids, output_router_logits=True)
        res["router_logits_refused"] = False
    except ValueError as exc:
        res["router_logits_refused"] = "router logits" in str(exc)
    hf.set_two_batch(switched, False)
    res["switch_off"] = "forward" not in switched.__dict__
    return res


def test_converted_models_match_under_two_batch_overlap(tmp_path):
    dirs = {}
    for i, family in enumerate(FAMILIES):
        dirs[family] = str(tmp_path / family)
        hf.tiny_random_model(family, dirs[family], seed=i, vocab_size=VOCAB)
    results = run_ranks(check, 2, dirs, random.randrange(2**31), timeout_s=400, collective_timeout_s=120)
    for rank, res in enumerate(results):
        for family, r in res.items():
            assert r["logits"] <= 1e-5, (family, rank, r)
            assert r["grad_worst"][0] <= 1e-4, (family, rank, r)
            assert r["interleaved"], (family, rank, r)
            assert r["switch_loss"] <= 1e-5 and r["switch_logits"] <= 1e-5 and r["switch_grad"] <= 1e-4, (family, rank, r)
            assert r["switch_halves"] and r["switch_generate"] and r["router_logits_refused"] and r["switch_off"], (family, rank, r)
