"""`occult.training.loss.cross_entropy` on a GPU at a real vocabulary: occult's kernel against torch's
cross-entropy in fp32 (loss and gradient, bf16 and fp16 logits, ignored rows), recorded in a CUDA graph and replayed
bit for bit, and a transformers model's `.loss` through `hf.use_occult_loss` against its own in bf16. Single-process
GPU test (tests/gpu/run.sh's second stage); the kernel's small cases: tests/kernels/test_cross_entropy_kernel.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from occult.training.loss import cross_entropy, uses_kernel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="occult's kernel runs on a GPU")


def _case(n: int, v: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    logits = (torch.randn(n, v, device="cuda", generator=gen) * 3).to(dtype)
    target = torch.randint(v, (n,), device="cuda", generator=gen)
    target[::7] = -100
    return logits, target


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_real_vocabulary_matches_torch_in_fp32(dtype):
    """Qwen3's vocabulary (151,936), 512 rows: the loss to fp32 rounding, the gradient to its rounding to the
    logits' dtype (both sides round it once; torch in its cast back from fp32)."""
    logits, target = _case(512, 151_936, dtype)
    assert uses_kernel(logits)
    ours_x = logits.clone().requires_grad_()
    ours = cross_entropy(ours_x, target)
    ours.backward()
    ref_x = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_x.float(), target)
    ref.backward()
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=0)
    assert ours_x.grad.dtype == dtype
    ulp = 2**-8 if dtype == torch.bfloat16 else 2**-11
    scale = ref_x.grad.float().abs().max()
    assert (ours_x.grad.float() - ref_x.grad.float()).abs().max() <= ulp * scale


def test_a_cuda_graph_replays_the_loss_and_gradient_bit_for_bit():
    logits, target = _case(256, 50_304, torch.bfloat16)
    x = logits.clone().requires_grad_()
    eager = cross_entropy(x, target)
    eager.backward()
    eager_grad = x.grad.clone()
    static_x = torch.empty_like(logits).requires_grad_()
    static_target = torch.empty_like(target)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture (Triton's first launch compiles)
        for _ in range(2):
            static_x.grad = None
            cross_entropy(static_x, static_target.fill_(0)).backward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    static_x.grad = None
    with torch.cuda.graph(graph):
        loss = cross_entropy(static_x, static_target)
        loss.backward()
    with torch.no_grad():
        static_x.copy_(logits)
    static_target.copy_(target)
    graph.replay()
    assert torch.equal(loss, eager) and torch.equal(static_x.grad, eager_grad)


def test_a_transformers_model_in_bf16_trains_as_with_its_own_loss():
    """A tiny OLMoE in bf16 on the GPU: the loss within bf16's rounding of transformers' own, every gradient within
    a few of its units (the logits' gradient rounds at the same point on both sides)."""
    from occult.integrations import hf

    seed = int(torch.randint(0, 1000, ()))
    ids = torch.randint(1000, (2, 64), generator=torch.Generator().manual_seed(seed)).cuda()
    runs = []
    for ours in (False, True):
        model = hf.tiny_random_model("olmoe", seed=seed, vocab_size=1000).to("cuda", torch.bfloat16)
        if ours:
            hf.use_occult_loss(model)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        runs.append((loss.detach(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}))
    (ref_loss, ref_grads), (loss, grads) = runs
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    for name, g in grads.items():
        scale = ref_grads[name].abs().max().clamp_min(1e-30)
        assert (g - ref_grads[name]).abs().max() <= 4 * 2**-8 * scale, name
