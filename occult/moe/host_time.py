"""A layer call's host time named in profiles: `occult::moe_forward` around the forward, and
`occult::moe_backward` from the moment its output's gradient arrives until its input's is done.

Issue 52 asks for the host time of a layer call, forward and backward. The forward is one range around
the call. The backward is several autograd nodes (combine, experts, dispatch, router), so its range opens
in a hook on the output's gradient and closes in one on the input's (both run on the autograd engine's
thread, in order). The hooks are registered only while a profiler records, and only where the input
takes a gradient, so a range never stays open; outside a profile they cost nothing.
`occult.training.step_profile` reads both ranges into its summary (`moe_host_ms_per_call`).
"""

from __future__ import annotations

import contextlib

import torch

FORWARD = "occult::moe_forward"
BACKWARD = "occult::moe_backward"


def recording() -> bool:
    """Whether a torch profiler records now (and no compiler traces: a compiled graph runs no hooks)."""
    if torch.compiler.is_compiling():
        return False
    return bool(getattr(torch.autograd.profiler, "_is_profiler_enabled", False))


def forward_range() -> contextlib.AbstractContextManager:
    """The forward's range (a context manager): a `record_function` while a profiler records, else nothing
    (a replayed call's host time is a few tens of microseconds; the range alone cost several)."""
    return torch.profiler.record_function(FORWARD) if recording() else contextlib.nullcontext()


def time_backward(x: torch.Tensor, y: torch.Tensor) -> None:
    """Name the backward of the call that made `y` from `x` in the profile being recorded (where both take
    a gradient): a range from `y`'s gradient to `x`'s."""
    if not (recording() and x.requires_grad and y.requires_grad):
        return
    open_ranges: list[torch.profiler.record_function] = []

    def begin(grad: torch.Tensor) -> torch.Tensor:
        rf = torch.profiler.record_function(BACKWARD)
        rf.__enter__()
        open_ranges.append(rf)
        return grad

    def end(grad: torch.Tensor) -> torch.Tensor:
        while open_ranges:
            open_ranges.pop().__exit__(None, None, None)
        return grad

    y.register_hook(begin)
    x.register_hook(end)
