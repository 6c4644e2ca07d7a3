"""Whether a timed training step's MoE backward is right (e2e.py's train phase, before the timed steps).

The logit check sees the forward only. A backward that loses the MoE blocks' input and gate gradients still
trains, fast and wrong: the residual stream carries a gradient around them (docs/training.md, "Traced
expert-parallel layers: GPU truth": compiled all-to-alls on NCCL gave zero gradients and a step 3% faster
than it should be). Three kinds of parameter are checked on one batch, against the unconverted model's
gradients on the same batch in the same dtype:

- each MoE block's router (its gradient comes only through the gates);
- the norm in front of each MoE block (only through the rows sent to the experts);
- up to three experts of each MoE block (their weight gradients): the first, the last and the best reached,
  leaving out any whose gradient is below `FEW_TOKENS` of the block's median expert's on some rank (so every rank
  samples the same): an expert few tokens reach has a gradient that one near-tied token flipping between experts
  moves by more than the tolerance (a random Qwen3-shape router sent expert 0 of one layer so few tokens that the
  floor itself missed by 0.85 and 1.23). An expert-parallel layer holds each expert on one rank, and its
  gradient there has every rank's tokens in it. The reference for it is therefore the unconverted model's gradient
  summed over the layer's ranks. A rank compares the sampled experts it holds.

A lost or wrong MoE backward gives a relative error of ~1; rounding gives less (in bf16 up to ~0.1 on the tiny
random models of CPU runs, whose routers' near-ties flip under any change of rounding). Where router scores nearly
tie at a realistic shape in half precision (DeepSeek-V3's sigmoid scores with group top-k), any change of rounding
picks other experts for some tokens and moves a router's gradient, and a reached expert's, by more than that:
transformers' own compiled model missed the half-precision reference by 0.72 on one router and by 0.53 on one
expert's weights (1 x H200). As e2e.py's logit check does (`_timing.Truth`), every checked parameter then also has
the fp32 model's gradient (`truth_gradients`: the same weights upcast), and a variant passes a parameter whose
distance from it is within `MARGIN` x the half-precision reference's own + `TOL`; a parameter where that allowance
reaches a lost gradient's error (~1) cannot tell a lost backward from rounding and is left out, named (the rest of
its layer still checks that layer).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
from _replay_check import relative_error

from occult.integrations import hf

TOL = 0.5  # relative L2 error, worst over the checked parameters and ranks: a lost MoE backward gives ~1
MARGIN = 1.25  # with the fp32 truth: a parameter passes within MARGIN x the half-precision model's error + TOL
LOST = 0.9  # a parameter whose allowance from the fp32 truth reaches this cannot tell a lost gradient: left out
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")  # (transformers' fused experts' names, which hf.convert keeps)
FEW_TOKENS = 0.25  # an expert whose gradient norm is below this share of its block's median expert's is not sampled
_EXPERT_KEY = re.compile(r"^(?P<name>.+)\[(?P<expert>\d+)\]$")  # "<param>[<expert>]": one expert's slice


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


def expert_weights(model: nn.Module) -> list[str]:
    """`<block>.experts.<weight>` of each MoE block of the unconverted `model` (its experts' fused weights)."""
    params = {n for n, _ in model.named_parameters()}
    return [
        f"{block}.experts.{weight}"
        for block, _ in hf.moe_blocks(model)
        for weight in EXPERT_WEIGHTS
        if f"{block}.experts.{weight}" in params
    ]


def sampled_experts(grad_EX: torch.Tensor) -> list[int]:
    """The experts of one fused weight's gradient [E, ...] to check (module docstring): the first, the last and the
    best reached, leaving out any whose gradient is below `FEW_TOKENS` of the median expert's on some rank (each
    rank's share, its least over the ranks where a process group is up: a collective). Every rank samples the
    same, and each sampled expert is well reached on each (a replicated floor compares every rank's own batch)."""
    norms_E = grad_EX.detach().float().flatten(1).norm(dim=1)
    share_E = norms_E / max(float(norms_E.median()), torch.finfo(torch.float32).tiny)
    if dist.is_initialized():
        dist.all_reduce(share_E, op=dist.ReduceOp.MIN)
    candidates = {0, len(share_E) - 1, int(share_E.argmax())}
    return sorted(e for e in candidates if float(share_E[e]) > FEW_TOKENS)


def split_key(key: str) -> tuple[str, int | None]:
    """(parameter name, expert) of a checked key; expert None for a whole parameter."""
    match = _EXPERT_KEY.match(key)
    return (key, None) if match is None else (match["name"], int(match["expert"]))


def backward_pass(
    model: nn.Module,
    ids_BS: torch.Tensor,
    chunks: int = 1,
    scope: Callable[[], AbstractContextManager] = nullcontext,
) -> None:
    """One forward and backward of `model` in training mode on `ids_BS` (labels = ids) from zero gradients, inside
    `scope()`: the mean loss over the batch, in `chunks` equal micro-batches (the shapes a split training step
    compiles for) whose gradients accumulate to the whole batch's. Its mode is restored after."""
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


def reference_gradients(model: nn.Module, ids_BS: torch.Tensor) -> dict[str, torch.Tensor]:
    """The unconverted `model`'s gradients (fp32 copies) of `checked_names` and of each expert weight's
    `sampled_experts` (keys `<weight>[e]`) on `ids_BS`, its other parameters frozen for the pass (no gradient memory
    for them; the checked ones' gradients are the same) and every gradient cleared after. A collective where a
    process group is up: every rank calls it."""
    names, weights = checked_names(model), expert_weights(model)
    wanted = set(names + weights)
    keep = {n: p.requires_grad for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.requires_grad_(n in wanted)
    try:
        backward_pass(model, ids_BS)
        params = dict(model.named_parameters())
        grads = {n: params[n].grad.detach().float().clone() for n in names if params[n].grad is not None}
        for weight in weights:
            grad = params[weight].grad
            if grad is not None:
                grads |= {f"{weight}[{e}]": grad[e].detach().float().clone() for e in sampled_experts(grad)}
        return grads
    finally:
        model.zero_grad(set_to_none=True)
        for n, p in model.named_parameters():
            p.requires_grad_(keep[n])


def truth_gradients(
    model: nn.Module, ids_BS: torch.Tensor, keys: list[str], chunks: int = 1, pass_bytes: int = 4 << 30
) -> dict[str, torch.Tensor]:
    """The gradients (fp32) of `keys` (`reference_gradients`' keys: whole parameters and `<weight>[e]` experts) on
    `ids_BS` in `chunks` micro-batches, called with the unconverted model upcast to fp32 (its half-precision
    weights: the exact-arithmetic reference of the same model). In as many passes as it takes to hold at most
    `pass_bytes` of fp32 gradients at a time (a whole expert weight's gradient is made to keep one expert's); the
    other parameters frozen in each pass, every gradient cleared after."""
    sizes = {n: p.numel() * 4 for n, p in model.named_parameters()}
    wanted = list(dict.fromkeys(split_key(k)[0] for k in keys))
    passes: list[list[str]] = [[]]
    for name in wanted:
        if passes[-1] and sum(sizes[n] for n in passes[-1]) + sizes[name] > pass_bytes:
            passes.append([])
        passes[-1].append(name)
    keep = {n: p.requires_grad for n, p in model.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    try:
        for names in passes:
            for n, p in model.named_parameters():
                p.requires_grad_(n in names)
            backward_pass(model, ids_BS, chunks)
            params = dict(model.named_parameters())
            for key in keys:
                name, expert = split_key(key)
                grad = params[name].grad if name in names else None
                if grad is not None:
                    out[key] = (grad if expert is None else grad[expert]).detach().float().clone()
            model.zero_grad(set_to_none=True)
        return out
    finally:
        model.zero_grad(set_to_none=True)
        for n, p in model.named_parameters():
            p.requires_grad_(keep[n])


def worst_native(reference: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]) -> tuple[str, float]:
    """(the key, its relative error) where this rank's half-precision reference is farthest from the fp32 one."""
    errors = {k: relative_error(reference[k], t) for k, t in truth.items()}
    key = max(errors, key=errors.get)
    return key, errors[key]


def _expert_layer(model: nn.Module, name: str) -> nn.Module:
    """The module that owns expert weight `name`: occult's layer (an `expert_device_E` map) or transformers' own."""
    return model.get_submodule(name.rsplit(".", 1)[0])


def _wanted(model: nn.Module, key: str, want: torch.Tensor) -> tuple[torch.Tensor, tuple[str, int | None] | None]:
    """(the reference for `key` on this rank, where this rank holds it: (parameter, index) or None). An expert of
    an expert-parallel layer: the reference summed over the layer's ranks (a collective over its group; every
    rank calls for every key in the same order), held by the rank its placement says, at its slot."""
    name, expert = split_key(key)
    if expert is None:
        return want, (name, None)
    layer = _expert_layer(model, name)
    if not hasattr(layer, "expert_device_E") or layer.num_ranks == 1:  # every expert here, its own tokens only
        slot = expert if not hasattr(layer, "expert_slot_E") else int(layer.expert_slot_E[expert])
        return want, (name, slot)
    total = want.clone()
    dist.all_reduce(total, group=layer.dispatcher.group)
    if int(layer.expert_device_E[expert]) != layer.rank:
        return total, None
    return total, (name, int(layer.expert_slot_E[expert]))


def _verdict(got: torch.Tensor | None, want: torch.Tensor, exact: torch.Tensor | None) -> tuple[float, str]:
    """(the relative error vs the half-precision reference `want`, "pass" / "fail" / "unchecked") of one gradient;
    `exact`: the fp32 model's (module docstring: a gradient also passes near it, or is left out)."""
    err = relative_error(got, want)
    if exact is None or err <= TOL:
        return err, "pass" if err <= TOL else "fail"
    allowance = MARGIN * relative_error(want, exact) + TOL
    if allowance >= LOST:
        return err, "unchecked"
    return err, "pass" if relative_error(got, exact) <= allowance else "fail"


def gradient_check(
    model: nn.Module,
    ids_BS: torch.Tensor,
    reference: dict[str, torch.Tensor],
    chunks: int = 1,
    scope: Callable[[], AbstractContextManager] = nullcontext,
    truth: dict[str, torch.Tensor] | None = None,
) -> dict:
    """The converted `model`'s gradients on `ids_BS` (in `chunks` micro-batches, inside `scope()`:
    `backward_pass`) against `reference` (`reference_gradients`; a collective: every rank calls) and the fp32
    model's gradients `truth` (`truth_gradients`, on every rank or none) where given (module docstring):
    {"max_rel_err" (worst over the checked gradients and ranks, vs `reference`), "worst_param" (on this rank),
    "params" (keys checked on this rank), "unchecked" (keys left out on this rank: too ill-conditioned in half
    precision to tell a lost gradient), "tol", "passed" (every checked key on every rank)}. A parameter the
    reference has and the model does not, or a gradient that is missing or not finite, counts as an error of inf."""
    backward_pass(model, ids_BS, chunks, scope)
    params = dict(model.named_parameters())
    worst, worst_key, checked, failed, unchecked = 0.0, "", 0, 0, []
    for key, want in reference.items():
        name, _ = split_key(key)
        if name not in params:
            err, verdict = math.inf, "fail"
        else:
            want, where = _wanted(model, key, want)
            exact = None if truth is None or key not in truth else _wanted(model, key, truth[key])[0]
            if where is None:
                continue  # (an expert another rank holds: it compares)
            grad = params[where[0]].grad
            got = None if grad is None else (grad if where[1] is None else grad[where[1]]).float()
            err, verdict = _verdict(got, want, exact)
        if verdict == "unchecked":
            unchecked.append(key)
            continue
        checked += 1
        failed += verdict == "fail"
        if err > worst or not worst_key:
            worst, worst_key = err, key
    model.zero_grad(set_to_none=True)
    box = torch.tensor([worst if math.isfinite(worst) else 3.0e38, failed], dtype=torch.float64, device=ids_BS.device)
    if dist.is_initialized():
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
    total, any_failed = float(box[0]), bool(box[1] > 0)
    return {
        "max_rel_err": total,
        "worst_param": worst_key,
        "params": checked,
        "unchecked": unchecked,
        "tol": TOL,
        "passed": not any_failed,
    }
