"""A transformers causal LM's training loss on occult's cross-entropy (`use_occult_loss`).

transformers computes `model(input_ids, labels=...).loss` with `ForCausalLMLoss`, which copies the logits to fp32
first; `occult.training.loss.causal_lm_loss` is the same function on occult's two-pass kernel (no float copy, the
gradient in the logits' dtype: docs/training.md, "The loss"). `occult finetune --hf` computes its loss through
`occult.training.loss.cross_entropy` itself; this is for a step that asks the model for `.loss` (e2e.py's).
"""

from __future__ import annotations

import torch.nn as nn

from occult.training.loss import causal_lm_loss


def use_occult_loss(model: nn.Module) -> None:
    """Give `model` (a transformers causal LM) occult's cross-entropy as its `loss_function`; a clear error where its
    loss is not transformers' causal-LM cross-entropy (another loss type, or one set by hand)."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    current = getattr(model, "loss_function", None)
    if current is causal_lm_loss:
        return
    if current is not LOSS_MAPPING["ForCausalLM"]:
        raise ValueError(
            f"use_occult_loss: {type(model).__name__}'s loss is {getattr(current, '__name__', current)!r}, not "
            "transformers' ForCausalLMLoss; occult's replaces only that one (leave this model's loss as it is)"
        )
    model.loss_function = causal_lm_loss
