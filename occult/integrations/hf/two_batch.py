"""Two-batch overlap as a switch on a converted model: `set_two_batch(model)`.

After it, `model(input_ids=..., attention_mask=..., labels=...)` (what a training loop or the
transformers Trainer calls) runs as two halves of the batch through `occult.two_batch_overlap`:
each half's all-to-alls run under the other half's attention and experts, forward and backward.
The logits are the concatenated halves' and the loss is the model's own `loss_function` on them,
so the result is the plain forward's (tests). Tensors with the batch in dim 0 and at least two
dims (attention masks, position ids) are split with the ids; everything else goes to both halves.

Calls it cannot split run the plain forward: a KV cache (`past_key_values`, `use_cache=True`,
i.e. `generate`), `inputs_embeds`, fewer than 2 sequences. Router logits (the MoE auxiliary
loss) are not returned by the split path, so asking for them is an error, not a silent change.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn as nn

from occult.moe.two_batch import two_batch_overlap

_PLAIN = "_occult_plain_forward"


def _splits(value: Any, rows: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == rows


def _two_batch_forward(self: nn.Module, input_ids: torch.Tensor | None = None, attention_mask=None,
                       labels: torch.Tensor | None = None, **kwargs: Any):
    plain = self.__dict__[_PLAIN][0]
    wants_router_logits = kwargs.get("output_router_logits", getattr(self.config, "output_router_logits", False))
    if (input_ids is None or input_ids.dim() != 2 or input_ids.shape[0] < 2 or kwargs.get("use_cache")
            or kwargs.get("past_key_values") is not None or kwargs.get("inputs_embeds") is not None):
        return plain(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)
    if wants_router_logits:
        raise ValueError("two-batch overlap does not return router logits (the MoE auxiliary loss): pass "
                         "output_router_logits=False (and set model.config.output_router_logits = False), or "
                         "turn it off with hf.set_two_batch(model, False)")
    rows = input_ids.shape[0]
    kwargs["attention_mask"] = attention_mask
    split = [k for k, v in kwargs.items() if _splits(v, rows)]
    whole = {k: v for k, v in kwargs.items() if k not in split and k not in ("return_dict", "use_cache")}
    loss_kwargs = {k: whole.pop(k) for k in ("num_items_in_batch", "ignore_index") if k in whole}

    def half(ids: torch.Tensor, *parts: torch.Tensor) -> torch.Tensor:
        return plain(input_ids=ids, use_cache=False, **dict(zip(split, parts)), **whole).logits

    logits = two_batch_overlap(half, input_ids, *(kwargs[k] for k in split))
    loss = None
    if labels is not None:
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **loss_kwargs)
    if kwargs.get("return_dict") is False:
        return (loss, logits) if loss is not None else (logits,)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast(loss=loss, logits=logits)


def set_two_batch(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Turn two-batch overlap on (or off) for `model`'s forward (module docstring); returns `model`.

    Every rank of the expert-parallel group must make the same calls. Not with activation
    checkpointing of the decoder layers (`occult.moe.two_batch`).
    """
    if enabled and _PLAIN not in model.__dict__:
        model.__dict__[_PLAIN] = (model.forward, "forward" in model.__dict__)
        model.forward = types.MethodType(_two_batch_forward, model)
    elif not enabled and _PLAIN in model.__dict__:
        plain, was_own = model.__dict__.pop(_PLAIN)
        if was_own:
            model.forward = plain
        else:
            del model.__dict__["forward"]
    return model
