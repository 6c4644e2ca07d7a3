"""What an `OccultMoE` call accepts: its input's status known on the host, and the error it raises.

A status (`occult.moe.counts`) travels to every rank of the group before anyone raises, so no rank
is left waiting in an all-to-all; the rank whose input it was then raises `bad_input_error`.
"""

from __future__ import annotations

import torch

from occult.moe.counts import STATUS_OVER_STEP, STATUS_WRONG_DTYPE, STATUS_WRONG_HIDDEN


def input_status(x: torch.Tensor, hidden_size: int, weights_dtype: torch.dtype, step_tokens: int | None) -> int:
    """0, or why a call on `x` cannot run: wrong hidden size, wrong dtype (outside autocast), or more
    tokens than the training step's agreement allows (`step_tokens`, `occult.moe.step`)."""
    if x.shape[-1] != hidden_size:
        return STATUS_WRONG_HIDDEN
    if x.dtype != weights_dtype and not torch.is_autocast_enabled(x.device.type):
        return STATUS_WRONG_DTYPE
    if step_tokens is not None and x.numel() // hidden_size > step_tokens:
        return STATUS_OVER_STEP
    return 0


def bad_input_error(
    x: torch.Tensor, hidden_size: int, weights_dtype: torch.dtype, step_tokens: int | None
) -> ValueError:
    """The error the rank with input `x` raises (`input_status` is not 0)."""
    status = input_status(x, hidden_size, weights_dtype, step_tokens)
    if status == STATUS_WRONG_HIDDEN:
        return ValueError(f"input has hidden size {x.shape[-1]} but this MoE layer expects {hidden_size}")
    if status == STATUS_OVER_STEP:
        return ValueError(
            f"input has {x.numel() // hidden_size} tokens but the training step's agreement allows at most "
            f"{step_tokens} per call (occult.agreed_step): pass it the largest token count of any call in the step"
        )
    return ValueError(
        f"input has dtype {x.dtype} but this MoE layer's weights are {weights_dtype}: "
        f"cast the input (x.to({weights_dtype})) or the layer"
    )
