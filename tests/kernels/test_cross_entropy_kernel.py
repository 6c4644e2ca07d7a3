"""`occult.training.loss.cross_entropy` on occult's kernel (`occult.kernels.cross_entropy`) against torch's
cross-entropy in float64: the loss and the logits' gradient in fp32, bf16 and fp16, ignored rows, `num_items`, a
vocabulary of several blocks, masked (-inf) logits, a target out of range. Without a GPU the kernel runs under
Triton's CPU interpreter (tests/kernels/_triton_interpreter.py); the GPU case at real sizes and in a CUDA graph:
tests/gpu/test_cross_entropy_one_gpu.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

# first: Triton's CPU interpreter without a GPU, or this file in a fresh process (test_in_subprocess)
from _triton_interpreter import DEVICE, IN_PROCESS, needs_in_process, run_file_in_fresh_process

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# the gradient is rounded once to the logits' dtype: its error is that rounding of its largest terms
GRAD_TOL = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}


def _case(n: int, v: int, dtype: torch.dtype, ignored: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    logits = (torch.randn(n, v, device=DEVICE) * 4).to(dtype)
    target = torch.randint(v, (n,), device=DEVICE)
    target[torch.randperm(n, device=DEVICE)[:ignored]] = -100
    return logits, target


def _reference(logits: torch.Tensor, target: torch.Tensor, grad: float, **kw) -> tuple[float, torch.Tensor]:
    """Loss and d(grad * loss)/d logits in float64 from the same (rounded) logits."""
    x = logits.detach().double().requires_grad_()
    num_items = kw.pop("num_items", None)
    if num_items is None:
        loss = F.cross_entropy(x, target, **kw)
    else:
        loss = F.cross_entropy(x, target, reduction="sum", **kw) / num_items
    (loss * grad).backward()
    return loss.item(), x.grad


def _ours(logits: torch.Tensor, target: torch.Tensor, grad: float, **kw) -> tuple[float, torch.Tensor]:
    from occult.training.loss import cross_entropy, uses_kernel

    assert uses_kernel(logits, "triton") and uses_kernel(logits) == logits.is_cuda
    x = logits.detach().clone().requires_grad_()
    loss = cross_entropy(x, target, backend="triton", **kw)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    loss.backward(torch.tensor(grad, device=DEVICE))
    assert x.grad.dtype == logits.dtype
    return loss.item(), x.grad


def _assert_close(ours, ref, logits: torch.Tensor) -> None:
    """The loss to fp32 rounding of its terms; the gradient to its rounding to the logits' dtype plus fp32's
    rounding of `logit - lse` (which grows with the logits' size)."""
    big = logits[torch.isfinite(logits)].abs().max().item()
    assert ours[0] == pytest.approx(ref[0], rel=2e-6 * (1 + big), abs=1e-6)
    scale = ref[1].abs().max().item()
    err = (ours[1].double() - ref[1]).abs().max().item()
    assert err <= (GRAD_TOL[logits.dtype] + 2e-7 * big) * scale, (err, scale)


@needs_in_process
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("num_classes", [5, 300, 4096 + 37])  # one partial block; several blocks
def test_loss_and_gradient_match_float64(dtype_name, num_classes):
    logits, target = _case(9, num_classes, DTYPES[dtype_name])
    grad = float(torch.rand(()) + 0.5)
    _assert_close(_ours(logits, target, grad), _reference(logits, target, grad), logits)


@needs_in_process
def test_num_items_divides_the_sum_and_another_ignore_index_is_honoured():
    logits, target = _case(11, 70, torch.bfloat16, ignored=0)
    target[[1, 4]] = 3  # the ignored class: rows targeting it count for nothing
    ref = _reference(logits, target, 1.0, ignore_index=3, num_items=17)
    _assert_close(_ours(logits, target, 1.0, ignore_index=3, num_items=17), ref, logits)
    tensor = torch.tensor(17, device=DEVICE)
    _assert_close(_ours(logits, target, 1.0, ignore_index=3, num_items=tensor), ref, logits)


@needs_in_process
def test_masked_and_large_logits_stay_finite():
    """Whole blocks of -inf (a masked vocabulary) and logits near fp32's exp range: the online max keeps the sums
    finite; a masked class gets exactly zero gradient."""
    logits, target = _case(6, 4096 + 100, torch.float32, ignored=0)
    logits[:, :4096] = float("-inf")
    logits[0, 4096:] += 500.0
    target = 4096 + torch.randint(100, (6,), device=DEVICE)
    ours = _ours(logits, target, 1.0)
    assert torch.isfinite(torch.tensor(ours[0])) and torch.equal(ours[1][:, :4096], torch.zeros_like(ours[1][:, :4096]))
    _assert_close(ours, _reference(logits, target, 1.0), logits)


@needs_in_process
def test_every_row_ignored_gives_nan_as_torch_does():
    logits, target = _case(4, 30, torch.float32, ignored=4)
    loss, grad = _ours(logits, target, 1.0)
    assert torch.isnan(torch.tensor(loss)) and torch.isnan(F.cross_entropy(logits, target))
    assert not grad.any()


@needs_in_process
def test_a_target_out_of_range_makes_the_loss_nan_and_leaves_its_row_alone():
    """Where torch's GPU kernel would end the process in a device assert: the mean turns NaN, the bad row's gradient
    is zero, the other rows' are what they would be with that row counted."""
    logits, target = _case(5, 40, torch.float32, ignored=0)
    bad = target.clone()
    bad[2] = 40
    loss, grad = _ours(logits, bad, 1.0)
    assert torch.isnan(torch.tensor(loss))
    assert not grad[2].any()
    _, ref = _reference(logits, target, 1.0)
    keep = torch.arange(5, device=DEVICE) != 2
    assert torch.allclose(grad[keep].double(), ref[keep], atol=1e-7)


@needs_in_process
def test_no_rows_and_bad_shapes():
    from occult.kernels.cross_entropy import row_losses

    empty = torch.zeros(0, 8, device=DEVICE)
    lse, loss = row_losses(empty, torch.zeros(0, dtype=torch.int64, device=DEVICE), -100)
    assert lse.shape == loss.shape == (0,)
    with pytest.raises(ValueError, match=r"logits \[N, V\] and targets \[N\]"):
        row_losses(torch.zeros(3, 8, device=DEVICE), torch.zeros(4, dtype=torch.int64, device=DEVICE), -100)
    with pytest.raises(ValueError, match="integer class ids"):
        row_losses(torch.zeros(3, 8, device=DEVICE), torch.zeros(3, device=DEVICE), -100)


def test_in_subprocess():
    if IN_PROCESS:
        pytest.skip("ran in this process")
    run_file_in_fresh_process(__file__)
