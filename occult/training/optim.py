"""The optimizer occult's trainers build: AdamW on its fused kernels wherever the parameters allow.

AdamW's default on a GPU is its for-each path: several passes over every parameter, gradient and moment a
step, where the fused kernel makes one (what that saves: docs/training.md, "`--captured-step`").
The fused kernel takes floating-point CUDA tensors, FSDP2's sharded ones (DTensors) too (DTensor runs it shard by
shard, where its for-each path dispatches every elementwise operation of every parameter on the host); CPU
parameters keep the for-each path. Sharded and plain parameters stay in groups of their own (the trainers' split).

`AdamW` is torch's, with one change: a fused group (plain tensors, or FSDP2's shards through their local tensors)
where occult's kernels run steps its large tensors through `occult.kernels.adamw` (one pass a tensor, at nearer the
card's copy rate than torch's multi-tensor kernel: docs/training.md, "The optimizer step"). Same update, same state
(a checkpoint of either loads into the other).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.adamw import adamw as functional_adamw

from occult import kernels
from occult.training.dtensor import is_sharded, local_tensor


def fusable(params: Iterable[torch.Tensor]) -> bool:
    """Whether a fused optimizer kernel takes these parameters: floating-point tensors on CUDA, all sharded
    (DTensors) or none."""
    params = list(params)
    if not params or len({is_sharded(p) for p in params}) > 1:
        return False
    return all(p.is_cuda and p.is_floating_point() for p in params)


class AdamW(torch.optim.AdamW):
    """`torch.optim.AdamW` whose fused groups of floating-point tensors (plain, or FSDP2's shards: their local
    tensors), where `occult.kernels` run, step their large tensors through `occult.kernels.adamw` (one launch each)
    and the rest through torch's fused multi-tensor kernel (one launch). Every other group (CPU, amsgrad, a gradient
    scaler's step, shards and plain tensors mixed) takes torch's step, unchanged."""

    def __init__(self, params: Iterable[Any], **hyper: Any) -> None:
        if hyper.get("differentiable"):
            raise ValueError("occult's AdamW does not take differentiable=True: use torch.optim.AdamW")
        super().__init__(params, **hyper)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        ours = [g for g in self.param_groups if self._kernel_takes(g)]
        rest = [g for g in self.param_groups if not any(g is o for o in ours)]
        if rest:
            self._torch_step(rest)
        for group in ours:
            self._kernel_step(group)
        return loss

    def _kernel_takes(self, group: dict[str, Any]) -> bool:
        """Whether `group` steps through occult's kernel this step: fused, plain AdamW, its parameters with
        gradients on one device where the kernels run, all sharded or none, and each one's tensors `takes`."""
        if not group["fused"] or group["amsgrad"] or any(torch.is_tensor(b) for b in group["betas"]):
            return False
        if getattr(self, "grad_scale", None) is not None or getattr(self, "found_inf", None) is not None:
            return False  # (a gradient scaler's step: torch's fused kernel takes its scale and skip flag)
        params = [p for p in group["params"] if p.grad is not None]
        devices = {p.device for p in params}
        if len(devices) != 1 or not kernels.available(device := next(iter(devices))):
            return False
        if torch.is_tensor(group["lr"]) and not (_on(group["lr"], device) and group["lr"].numel() == 1):
            return False  # (the kernel reads the rate where the parameters are; torch's step moves it there)
        return len({is_sharded(p) for p in params}) == 1 and all(self._tensors_take(p, device) for p in params)

    def _tensors_take(self, p: torch.Tensor, device: torch.device) -> bool:
        """Whether the kernel takes `p`, its gradient and its state (made on the device if there is none yet)."""
        state = self.state.get(p)
        if state and not _on(state["step"], device, torch.float32):
            return False  # a step count kept elsewhere (a for-each AdamW's, on the host): torch's step reads it
        four = (p, p.grad, state["exp_avg"], state["exp_avg_sq"]) if state else (p, p.grad, p, p)
        if len({getattr(t, "placements", None) for t in four}) > 1:  # FSDP2: each laid out as its parameter
            return False
        return _adamw_kernel().takes(*(local_tensor(t) for t in four))

    def _kernel_step(self, group: dict[str, Any]) -> None:
        """The group's update: tensors of at least `min_numel` elements one launch each through occult's kernel,
        the others through torch's fused multi-tensor kernel in one launch (its functional AdamW)."""
        kernel = _adamw_kernel()
        params = [p for p in group["params"] if p.grad is not None]
        beta1, beta2 = group["betas"]
        hyper = {"lr": group["lr"], "beta1": beta1, "beta2": beta2, "eps": group["eps"]}
        hyper.update(weight_decay=group["weight_decay"], maximize=group["maximize"])
        small = [p for p in params if p.numel() < kernel.min_numel()]
        large = [p for p in params if p.numel() >= kernel.min_numel()]
        if small:  # (torch's functional AdamW advances their step counts itself)
            chosen, grads, exp_avgs, exp_avg_sqs, steps = self._lists(small)
            fused = {"fused": True, "capturable": group["capturable"], "amsgrad": False}
            functional_adamw(chosen, grads, exp_avgs, exp_avg_sqs, [], steps, **fused, **hyper)
        if large:
            chosen, grads, exp_avgs, exp_avg_sqs, steps = self._lists(large)
            torch._foreach_add_(steps, 1.0)
            local = [[local_tensor(t) for t in ts] for ts in (chosen, grads, exp_avgs, exp_avg_sqs)]
            kernel.adamw_update_(*local, steps, **hyper)  # an FSDP2 shard updated in place through its local tensor

    def _lists(self, params: list[torch.Tensor]) -> tuple[list[torch.Tensor], ...]:
        """Parameters, gradients, first and second moments, step counts."""
        states = [self._state_of(p) for p in params]
        moments = ([s[key] for s in states] for key in ("exp_avg", "exp_avg_sq", "step"))
        return (params, [p.grad for p in params], *moments)

    def _state_of(self, p: torch.Tensor) -> dict[str, Any]:
        """`p`'s state, created as torch's fused AdamW creates it (step count on the device, fp32)."""
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _torch_step(self, groups: list[dict[str, Any]]) -> None:
        """torch's AdamW step over `groups` only (its body, not its hooks: `step`'s own wrapper ran them)."""
        body = inspect.unwrap(torch.optim.AdamW.step, stop=lambda f: not getattr(f, "hooked", False))
        every = self.param_groups
        self.param_groups = groups
        try:
            body(self)
        finally:
            self.param_groups = every


def _on(t: Any, device: torch.device, dtype: torch.dtype | None = None) -> bool:
    """Whether `t` is a tensor on `device` (of `dtype` where given)."""
    return torch.is_tensor(t) and t.device == device and (dtype is None or t.dtype == dtype)


def _adamw_kernel():
    """`occult.kernels.adamw`, imported when first used (it imports Triton)."""
    from occult.kernels import adamw as kernel

    return kernel


def adamw(groups: list[dict[str, Any]], **hyper: Any) -> AdamW:
    """`AdamW(groups, **hyper)` with every group whose parameters `fusable` takes on a fused kernel (the update is
    AdamW's either way)."""
    fused = [{**g, "fused": True, "foreach": False} if fusable(g["params"]) else g for g in groups]
    return AdamW(fused, **hyper)


__all__ = ["AdamW", "fusable", "adamw"]
