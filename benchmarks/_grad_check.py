"""Whether a timed training step's MoE backward reaches the layers in front of it (e2e.py's train phase).

The logit check sees the forward only. A backward that loses the MoE blocks' input and gate gradients still
trains, fast and wrong: the residual stream carries a gradient around them (docs/training.md, "Traced
expert-parallel layers: GPU truth": compiled all-to-alls on NCCL gave zero gradients and a step 3% faster
than it should be). Two kinds of parameter get their gradient only through the MoE block: its router
(through the gates) and the norm in front of it (through the rows sent to the experts). Their gradients on
one batch, against the unconverted model's on the same batch in the same dtype, tell a lost or wrong MoE
backward (relative error ~1) from rounding (in bf16 up to ~0.1 on the tiny random models of CPU runs, whose
routers' near-ties flip under any change of rounding). Expert weights are left out: expert-parallel
variants hold only their own, under the same names.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
from _replay_check import relative_error

from occult.integrations import hf

TOL = 0.5  # relative L2 error, worst over the checked parameters and ranks: a lost MoE backward gives ~1


def checked_names(model: nn.Module) -> list[str]:
    """The parameters of `model` whose gradient comes only through a MoE block (module docstring): each MoE
    block's router (`<block>.gate.weight`) and its decoder layer's `post_attention_layernorm.weight`
    (transformers' names, which hf.convert keeps)."""
    params = {n for n, _ in model.named_parameters()}
    names = []
    for block, _ in hf.moe_blocks(model):
        layer = block.rsplit(".", 1)[0]
        names += [n for n in (f"{block}.gate.weight", f"{layer}.post_attention_layernorm.weight") if n in params]
    return names


def moe_input_gradients(
    model: nn.Module,
    ids_BS: torch.Tensor,
    names: list[str],
    chunks: int = 1,
    scope: Callable[[], AbstractContextManager] = nullcontext,
) -> dict[str, torch.Tensor]:
    """fp32 copies of `names`' gradients of the mean loss over `ids_BS` (labels = ids) from one forward and backward
    of `model` in training mode, from zero, inside `scope()`. With `chunks` > 1 the batch goes as that many equal
    micro-batches (the shapes a split training step compiles for), their gradients accumulated and averaged: the
    whole batch's. The model's gradients are cleared after, its mode restored."""
    if ids_BS.shape[0] % chunks:
        raise ValueError(f"{ids_BS.shape[0]} sequences do not split into {chunks} equal micro-batches")
    training = model.training
    model.zero_grad(set_to_none=True)
    model.train()
    try:
        with scope():
            for part in ids_BS.chunk(chunks):
                (model(input_ids=part, labels=part, use_cache=False).loss / chunks).backward()
    finally:
        model.train(training)
    params = dict(model.named_parameters())
    grads = {n: params[n].grad.detach().float().clone() for n in names if params[n].grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def reference_gradients(model: nn.Module, ids_BS: torch.Tensor) -> dict[str, torch.Tensor]:
    """`moe_input_gradients` of the unconverted model, its other parameters frozen for the pass (no gradient
    memory for them; the checked ones' gradients are the same)."""
    names = checked_names(model)
    keep = {n: p.requires_grad for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.requires_grad_(n in names)
    try:
        return moe_input_gradients(model, ids_BS, names)
    finally:
        for n, p in model.named_parameters():
            p.requires_grad_(keep[n])


def gradient_check(
    model: nn.Module,
    ids_BS: torch.Tensor,
    reference: dict[str, torch.Tensor],
    chunks: int = 1,
    scope: Callable[[], AbstractContextManager] = nullcontext,
) -> dict:
    """The converted `model`'s checked gradients on `ids_BS` (in `chunks` micro-batches, inside `scope()`:
    `moe_input_gradients`) against `reference` (a collective: every rank calls): {"max_rel_err" (worst over
    parameters and ranks), "worst_param" (on this rank), "params", "tol", "passed"}. A parameter the reference
    has and the model does not, or a gradient that is missing or not finite, counts as an error of inf."""
    got = moe_input_gradients(model, ids_BS, list(reference), chunks, scope)
    worst, worst_name = 0.0, ""
    for name, want in reference.items():
        err = relative_error(got.get(name), want)
        if err > worst or not worst_name:
            worst, worst_name = err, name
    box = torch.tensor([worst if math.isfinite(worst) else 3.0e38], dtype=torch.float64, device=ids_BS.device)
    if dist.is_initialized():
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
    total = float(box)
    return {
        "max_rel_err": total,
        "worst_param": worst_name,
        "params": len(reference),
        "tol": TOL,
        "passed": bool(reference) and total <= TOL,
    }
