"""`occult.training.loss`: what it computes where occult's kernel does not run (torch's cross-entropy, the same
semantics), the backend choice, and transformers' `.loss` through `hf.use_occult_loss` equal to transformers' own
(loss and every gradient, fp32; with `num_items_in_batch` and `shift_labels` too). The kernel itself:
tests/kernels/test_cross_entropy_kernel.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from occult.training.loss import causal_lm_loss, cross_entropy, uses_kernel


def test_on_cpu_it_is_torchs_cross_entropy_on_float_logits():
    logits = torch.randn(7, 11, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(11, (7,))
    target[3] = -100
    assert not uses_kernel(logits) and not uses_kernel(logits, "torch")
    ours = cross_entropy(logits, target)
    ref = F.cross_entropy(logits.float(), target)
    assert ours.dtype == torch.float32 and torch.equal(ours, ref)
    summed = cross_entropy(logits, target, num_items=5)
    assert torch.equal(summed, F.cross_entropy(logits.float(), target, reduction="sum") / 5)
    with pytest.raises(ValueError, match="backend must be one of"):
        cross_entropy(logits, target, backend="cuda")


def test_causal_lm_loss_shifts_without_copying_the_logits():
    """Position t predicts label t + 1; the last position counts for nothing; the same as slicing."""
    logits = torch.randn(2, 6, 9)
    labels = torch.randint(9, (2, 6))
    labels[1, 2] = -100
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, 9), labels[:, 1:].reshape(-1))
    assert torch.allclose(causal_lm_loss(logits, labels, 9), ref, rtol=1e-6)
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
    assert torch.allclose(causal_lm_loss(logits, None, 9, shift_labels=shifted), ref, rtol=1e-6)


@pytest.mark.parametrize("num_items", [None, 13])
def test_a_transformers_model_trains_as_with_its_own_loss(num_items):
    """`use_occult_loss`: `model(input_ids, labels=...).loss` and every parameter's gradient as transformers' own
    ForCausalLMLoss gives them (fp32, a tiny OLMoE); asking twice is harmless; a loss set by hand is refused."""
    from occult.integrations import hf

    seed = int(torch.randint(0, 1000, ()))
    ids = torch.randint(64, (2, 10), generator=torch.Generator().manual_seed(seed))
    runs = []
    for ours in (False, True):
        model = hf.tiny_random_model("olmoe", seed=seed, vocab_size=64)
        if ours:
            hf.use_occult_loss(model)
            hf.use_occult_loss(model)
        kwargs = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
        loss = model(input_ids=ids, labels=ids, use_cache=False, **kwargs).loss
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (ref_loss, ref_grads), (loss, grads) = runs
    assert torch.allclose(loss, ref_loss, rtol=1e-6) and grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        scale = ref_grads[name].abs().max().clamp_min(1e-30)
        assert (g - ref_grads[name]).abs().max() <= 1e-5 * scale, name
    model = hf.tiny_random_model("olmoe", seed=seed, vocab_size=64)
    model.loss_function = lambda *a, **k: torch.zeros(())
    with pytest.raises(ValueError, match="not transformers' ForCausalLMLoss"):
        hf.use_occult_loss(model)
