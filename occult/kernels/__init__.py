"""Triton kernels of the expert compute (docs/kernels.md).

`available(device=None)` says whether the Triton path can run: Triton imports and the device is
a CUDA GPU of compute capability >= 8.0, or `TRITON_INTERPRET=1` (Triton's CPU interpreter,
used by the tests). `expert_mlp(...)` has the signature and semantics of
`occult.moe.experts.expert_mlp_reference`; it imports Triton, so call it only when `available()`.

Modules, one kernel family each: `pairs` (expert-sorted pair lists, device tile schedule),
`grouped_gemm` (GEMM 1 gather+SwiGLU, GEMM 2 scatter), `combine` (per-row fp32 pre-reduction),
`grouped_gemm_backward` (SwiGLU dgrad with gate gradient, weight gradients), `grouped_mm` (the
backward through `torch._grouped_mm` on Hopper/bf16), `op` (the autograd op), `config` (tile sizes).
"""

from __future__ import annotations

import importlib.util

import torch

from occult import settings

__all__ = ["available", "expert_mlp"]


def available(device: torch.device | str | None = None) -> bool:
    """True when the Triton kernels can run on `device` (default: any CUDA device, or the
    interpreter). Never raises. A constant to torch.compile (its `find_spec` call would break
    the graph of every layer that asks)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    if settings.current().triton_interpret:
        return True
    try:
        if device is None:
            if not torch.cuda.is_available():
                return False
            device = torch.device("cuda", torch.cuda.current_device())
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            return False
        return torch.cuda.get_device_capability(device) >= (8, 0)
    except Exception:
        return False


# What `torch.compiler.assume_constant_result(available)` does, without importing torch._dynamo
# (which imports Triton) when this package is imported: Triton must be importable later in
# interpreter mode (TRITON_INTERPRET=1, the CPU tests), and the import costs seconds.
available._dynamo_marked_constant = True  # type: ignore[attr-defined]


def expert_mlp(x_RH, slots_RK, gates_RK, gate_up_proj_EFH, down_proj_EHF, **kwargs):
    """Fused Triton `expert_mlp`; see `occult.kernels.op.expert_mlp`."""
    from occult.kernels.op import expert_mlp as _expert_mlp

    return _expert_mlp(x_RH, slots_RK, gates_RK, gate_up_proj_EFH, down_proj_EHF, **kwargs)
