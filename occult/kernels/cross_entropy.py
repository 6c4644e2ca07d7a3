"""Cross-entropy on half-precision logits without a float copy: two streaming passes over the rows.

The usual path (`F.cross_entropy(logits.float(), ...)`, transformers' `ForCausalLMLoss`) copies the [N, V] logits to
fp32, writes their log-softmax, then in the backward a zero-filled fp32 gradient, the log-softmax gradient and its cast
back: ~45 bytes moved per logit, and two fp32 [N, V] tensors alive at once (at Qwen3's 151,936-word vocabulary and
8192 tokens, 5 GB each). Here the forward reads each row once (`_lse_kernel`: an online max and sum in fp32 give the
row's log-sum-exp and its loss) and the backward reads it again and writes its gradient in the logits' dtype
(`_grad_kernel`: `(softmax - onehot) * scale`): 6 bytes per bf16 logit, nothing in fp32 but one number a row. The
arithmetic is the usual path's (fp32 from the stored logits, the gradient rounded once to the logits' dtype).

Targets equal to `ignore_index` count for nothing (zero loss and gradient); a target outside [0, V) gives its row a
NaN loss and a zero gradient (the mean turns NaN, the weights are left alone; torch's kernel would end the process
in a device assert). No host synchronisation: a CUDA graph records both passes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from occult.kernels import config as _config  # noqa: F401  (under the interpreter: its loop-bound fix)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_BLOCK = 4096  # classes a program reads per step (16 per thread at 8 warps)


@triton.jit
def _lse_kernel(logits_ptr, target_ptr, lse_ptr, loss_ptr, row_stride, num_classes, ignore_index, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    cols = tl.arange(0, BLOCK)
    run_max = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane: the largest logit so far ...
    run_sum = tl.zeros([BLOCK], tl.float32)  # ... and the sum of exp(logit - that)
    for start in range(0, num_classes, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < num_classes, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(run_max, x)
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # (a lane with no logit yet: not -inf - -inf)
        run_sum = run_sum * tl.exp(run_max - shift) + tl.exp(x - shift)
        run_max = new_max
    row_max = tl.max(run_max, axis=0)
    row_shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    lse = row_max + tl.log(tl.sum(run_sum * tl.exp(run_max - row_shift), axis=0))
    target = tl.load(target_ptr + row).to(tl.int64)
    counted = target != ignore_index
    in_range = (target >= 0) & (target < num_classes)
    picked = tl.load(base + target, mask=counted & in_range, other=0.0).to(tl.float32)
    loss = tl.where(counted, tl.where(in_range, lse - picked, float("nan")), 0.0)
    tl.store(lse_ptr + row, lse)
    tl.store(loss_ptr + row, loss)


@triton.jit
def _grad_kernel(
    logits_ptr,
    target_ptr,
    lse_ptr,
    scale_ptr,
    grad_ptr,
    row_stride,
    grad_stride,
    num_classes,
    ignore_index,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    out = grad_ptr + row * grad_stride
    cols = tl.arange(0, BLOCK)
    target = tl.load(target_ptr + row).to(tl.int64)
    lse = tl.load(lse_ptr + row)
    in_range = (target >= 0) & (target < num_classes)
    scale = tl.where((target != ignore_index) & in_range, tl.load(scale_ptr), 0.0)
    for start in range(0, num_classes, BLOCK):
        at = start + cols
        x = tl.load(base + at, mask=at < num_classes, other=float("-inf")).to(tl.float32)
        g = (tl.exp(x - lse) - tl.where(at == target, 1.0, 0.0)) * scale
        tl.store(out + at, g.to(grad_ptr.dtype.element_ty), mask=at < num_classes)


def _block(num_classes: int) -> int:
    return min(MAX_BLOCK, triton.next_power_of_2(max(num_classes, 16)))


def _check(logits_NV: torch.Tensor, target_N: torch.Tensor) -> None:
    if logits_NV.dim() != 2 or target_N.shape != logits_NV.shape[:1]:
        raise ValueError(
            f"expected logits [N, V] and targets [N]; got {tuple(logits_NV.shape)} and {tuple(target_N.shape)}"
        )
    if logits_NV.dtype not in DTYPES or logits_NV.stride(1) != 1:
        raise ValueError(f"logits must be fp32, bf16 or fp16 with contiguous rows, got {logits_NV.dtype}")
    if target_N.dtype.is_floating_point or target_N.dtype == torch.bool:
        raise ValueError(f"targets must be integer class ids, got {target_N.dtype}")


def row_losses(logits_NV: torch.Tensor, target_N: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-sum-exp [N], loss [N]) in fp32: `lse - logits[target]`, 0 where the target is `ignore_index`."""
    _check(logits_NV, target_N)
    n, v = logits_NV.shape
    lse_N = torch.empty(n, dtype=torch.float32, device=logits_NV.device)
    loss_N = torch.empty_like(lse_N)
    if n:
        _lse_kernel[(n,)](
            logits_NV, target_N, lse_N, loss_N, logits_NV.stride(0), v, ignore_index, BLOCK=_block(v), num_warps=8
        )
    return lse_N, loss_N


def row_gradients(
    logits_NV: torch.Tensor, target_N: torch.Tensor, lse_N: torch.Tensor, scale_1: torch.Tensor, ignore_index: int
) -> torch.Tensor:
    """d loss / d logits [N, V] in the logits' dtype: `(softmax - onehot(target)) * scale_1` per counted row, 0 in
    the rest (`scale_1`: a one-element fp32 tensor, read on the device)."""
    n, v = logits_NV.shape
    grad_NV = torch.empty((n, v), dtype=logits_NV.dtype, device=logits_NV.device)
    if n:
        _grad_kernel[(n,)](
            logits_NV,
            target_N,
            lse_N,
            scale_1,
            grad_NV,
            logits_NV.stride(0),
            grad_NV.stride(0),
            v,
            ignore_index,
            BLOCK=_block(v),
            num_warps=8,
        )
    return grad_NV


class CrossEntropy(torch.autograd.Function):
    """`loss = sum of row losses / divisor` (the divisor: a 0-dim tensor, e.g. the counted rows), its gradient
    through `row_gradients`; the logits are saved for the backward, no float copy of them."""

    @staticmethod
    def forward(ctx, logits_NV, target_N, divisor, ignore_index):  # noqa: D102
        lse_N, loss_N = row_losses(logits_NV, target_N, ignore_index)
        divisor = divisor.to(torch.float32)
        ctx.save_for_backward(logits_NV, target_N, lse_N, divisor)
        ctx.ignore_index = ignore_index
        return loss_N.sum() / divisor

    @staticmethod
    def backward(ctx, grad_loss):  # noqa: D102
        logits_NV, target_N, lse_N, divisor = ctx.saved_tensors
        scale_1 = (grad_loss.to(torch.float32) / divisor).reshape(1)
        return row_gradients(logits_NV, target_N, lse_N, scale_1, ctx.ignore_index), None, None, None
