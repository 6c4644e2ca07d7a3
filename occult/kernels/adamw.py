"""AdamW's update of one parameter tensor in one pass: read parameter, gradient and both moments, write all three.

The update is torch's fused AdamW's (its `fused_adam_utils.cuh`, decoupled weight decay, in fp32 whatever the
storage dtype): `p -= lr*wd*p; m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g*g;
p -= (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)`. What differs is the memory access: torch's
multi-tensor kernel moves AdamW's 14 bytes per bf16 parameter at about two thirds of the card's copy rate
(docs/training.md, "The optimizer step"); this kernel streams each tensor with wide contiguous loads. The step
count `t` is read on the device (AdamW's fused/capturable state keeps it there), and so is the learning rate when
it is a tensor (a captured step fills it in place), so one launch serves eager and recorded steps alike.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from occult.kernels import config as _config

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _one_minus_exp(y):
    """`1 - exp(y)` for `y <= 0` in fp32 without cancellation (`1 - beta2^t` is ~1e-3 early in training, where
    `1 - exp2(...)` in fp32 would lose 4 of its 7 digits): a Taylor series below |y| = 0.1, `exp` above."""
    series = y * (1.0 + y / 2.0 * (1.0 + y / 3.0 * (1.0 + y / 4.0 * (1.0 + y / 5.0 * (1.0 + y / 6.0)))))
    return -tl.where(y > -0.1, series, tl.exp(y) - 1.0)


@triton.jit
def _adamw_kernel(
    param_ptr,
    grad_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    step_ptr,
    lr_ptr,
    lr,
    beta1,
    beta2,
    one_minus_beta1,
    one_minus_beta2,
    ln_beta1,
    ln_beta2,
    eps,
    weight_decay,
    numel,
    MAXIMIZE: tl.constexpr,
    LR_ON_DEVICE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    step = tl.load(step_ptr).to(tl.float32)
    if LR_ON_DEVICE:
        rate = tl.load(lr_ptr).to(tl.float32)
    else:
        rate = lr
    bias1 = _one_minus_exp(step * ln_beta1)  # 1 - beta1^t
    bias2_sqrt = tl.sqrt(_one_minus_exp(step * ln_beta2))
    p = tl.load(param_ptr + offs, mask=mask).to(tl.float32)
    g = tl.load(grad_ptr + offs, mask=mask).to(tl.float32)
    m = tl.load(exp_avg_ptr + offs, mask=mask).to(tl.float32)
    v = tl.load(exp_avg_sq_ptr + offs, mask=mask).to(tl.float32)
    if MAXIMIZE:
        g = -g
    p = p - rate * weight_decay * p
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * g * g
    denom = tl.sqrt(v) / bias2_sqrt + eps
    p = p - (rate / bias1) * m / denom
    tl.store(param_ptr + offs, p.to(param_ptr.dtype.element_ty), mask=mask)
    tl.store(exp_avg_ptr + offs, m.to(exp_avg_ptr.dtype.element_ty), mask=mask)
    tl.store(exp_avg_sq_ptr + offs, v.to(exp_avg_sq_ptr.dtype.element_ty), mask=mask)


def min_numel() -> int:
    """The smallest tensor worth a launch of its own: below it a launch costs the host more (tens of
    microseconds) than the update takes on the GPU, and torch's multi-tensor kernel (one launch for all of them)
    is the better path (`occult.training.optim.AdamW` sends them there). In a CUDA graph being recorded (a captured
    step) a replay launches nothing on the host, so there tensors down to `RECORDED_MIN_NUMEL` take the faster
    stream too, until a graph node's own gap outweighs what it saves. Every tensor under the interpreter."""
    if _config.interpreting():
        return 0
    return RECORDED_MIN_NUMEL if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing() else 1 << 24


RECORDED_MIN_NUMEL = 1 << 21  # (an attention projection of OLMoE is twice this: docs/training.md, "The optimizer step")


def _ln(beta: float) -> float:
    """ln(beta), -inf for beta = 0 (then every bias correction is 1, as beta^t = 0)."""
    return math.log(beta) if beta > 0 else -math.inf


def takes(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> bool:
    """Whether `adamw_update_` takes this parameter: one floating dtype of `DTYPES` for all four tensors, all
    contiguous, of one shape, on one device."""
    four = (param, grad, exp_avg, exp_avg_sq)
    return (
        param.dtype in DTYPES
        and all(t.dtype == param.dtype and t.device == param.device and t.shape == param.shape for t in four)
        and all(t.is_contiguous() for t in four)
    )


def adamw_update_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    *,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool = False,
) -> None:
    """One AdamW update of each parameter and its moments in place (one launch a parameter), at its step count
    (a one-element fp32 tensor on the parameter's device, already advanced). `lr` a float or a one-element tensor
    on the parameters' device."""
    if not len(params) == len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(steps):
        raise ValueError("adamw_update_ takes one gradient, both moments and a step count per parameter")
    cfg = _config.get("adamw")
    lr_on_device = torch.is_tensor(lr)
    rate = 0.0 if lr_on_device else float(lr)
    # the blend factors and logarithms in double here, rounded once to the kernel's fp32 (torch's fused kernel keeps
    # the betas in double)
    hyper = (
        float(beta1),
        float(beta2),
        1.0 - float(beta1),
        1.0 - float(beta2),
        _ln(beta1),
        _ln(beta2),
        float(eps),
        float(weight_decay),
    )
    for param, grad, exp_avg, exp_avg_sq, step in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
        if not takes(param, grad, exp_avg, exp_avg_sq):
            raise ValueError(
                "adamw_update_ takes contiguous tensors of one shape, device and dtype (fp32, bf16 or fp16); got "
                f"{[(tuple(t.shape), t.dtype, t.is_contiguous()) for t in (param, grad, exp_avg, exp_avg_sq)]}"
            )
        numel = param.numel()
        if numel == 0:
            continue
        _adamw_kernel[(triton.cdiv(numel, cfg.block_m),)](
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            step,
            lr if lr_on_device else step,
            rate,
            *hyper,
            numel,
            MAXIMIZE=bool(maximize),
            LR_ON_DEVICE=lr_on_device,
            BLOCK=cfg.block_m,
            num_warps=cfg.num_warps,
        )


__all__ = ["DTYPES", "RECORDED_MIN_NUMEL", "min_numel", "takes", "adamw_update_"]
