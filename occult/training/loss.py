"""The trainers' cross-entropy: occult's two-pass kernel on GPU logits, torch's everywhere else.

`cross_entropy(logits_NV, target_N)` is `F.cross_entropy(logits_NV.float(), target_N)`: the mean over the rows whose
target is not `ignore_index` (or, given `num_items`, their sum over it). Where `occult.kernels` run it is computed by
`occult.kernels.cross_entropy`, with no float copy of the logits and its gradient in their dtype (docs/training.md,
"The loss"). `causal_lm_loss` has the signature and semantics of transformers' `ForCausalLMLoss` (labels shifted left
by one, the last position of each sequence not counted): `model.loss_function = causal_lm_loss` gives a transformers
causal LM this loss (`occult.integrations.hf.use_occult_loss`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from occult import kernels


def _kernel() -> Any:
    """`occult.kernels.cross_entropy`, imported when first used (it imports Triton)."""
    from occult.kernels import cross_entropy as kernel

    return kernel


BACKENDS = ("auto", "triton", "torch")


def uses_kernel(logits_NV: torch.Tensor, backend: str = "auto") -> bool:
    """Whether `cross_entropy` takes occult's kernel: "auto" for fp32, bf16 or fp16 logits [N, V] with contiguous
    rows on a CUDA GPU where the kernels run; "triton" wherever they run (Triton's CPU interpreter too: the tests);
    "torch" never."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return (
        backend != "torch"
        and (backend == "triton" or logits_NV.is_cuda)
        and logits_NV.dim() == 2
        and logits_NV.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and logits_NV.stride(1) == 1
        and kernels.available(logits_NV.device)
    )


def cross_entropy(
    logits_NV: torch.Tensor,
    target_N: torch.Tensor,
    ignore_index: int = -100,
    num_items: torch.Tensor | int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Mean cross-entropy of `logits_NV` [N, V] against class ids `target_N` [N] (rows targeting `ignore_index`
    left out; with `num_items`, the sum over it), in fp32 whatever the logits' dtype; differentiable in the logits.
    On occult's kernel (`uses_kernel`) a target outside [0, V) makes the loss NaN (torch's raises on CPU and ends
    the process in a device assert on a GPU)."""
    if not uses_kernel(logits_NV, backend):
        reduction = "mean" if num_items is None else "sum"
        loss = F.cross_entropy(logits_NV.float(), target_N, ignore_index=ignore_index, reduction=reduction)
        return loss if num_items is None else loss / num_items
    if num_items is None:
        divisor = (target_N != ignore_index).sum()
    else:
        divisor = torch.as_tensor(num_items, device=logits_NV.device)
    return _kernel().CrossEntropy.apply(logits_NV, target_N, divisor, ignore_index)


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """transformers' `ForCausalLMLoss` on `cross_entropy`: position t of `logits` [..., V] predicts label t + 1
    (`shift_labels`: already shifted); the logits are never copied (the last position's target is `ignore_index`
    instead of a slice)."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return cross_entropy(
        logits.reshape(-1, vocab_size),
        shift_labels.reshape(-1).to(logits.device),
        ignore_index=ignore_index,
        num_items=num_items_in_batch,
    )
