"""The single-process `DenseMoE` reference of the layer tests (test_layer.py, test_two_level.py): its
forward and backward on every rank's tokens, and the relative errors of one rank's output and gradients.

Imported by those modules at module level, so the ranks they spawn (`run_ranks`) import it too.
"""

from __future__ import annotations

import torch


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (||a - b|| where b is zero)."""
    a, b = a.detach().double(), b.detach().double()
    denom = b.norm().item()
    return (a - b).norm().item() / (denom if denom > 0 else 1.0)


def dense_backward(
    dense: torch.nn.Module, x_all: torch.Tensor, g_all: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_ref, y_ref): `dense` on all tokens x_all [T, H], then backward of sum(y_ref * g_all); the input's and
    every parameter's gradient zero where nothing reached it (with no tokens at all, nothing does)."""
    x_ref = x_all.clone().requires_grad_()
    y_ref = dense(x_ref)
    if y_ref.requires_grad:
        (y_ref * g_all).sum().backward()
    for p in (x_ref, *dense.parameters()):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return x_ref, y_ref


def layer_errors(
    layer: torch.nn.Module,
    dense: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    x_ref: torch.Tensor,
    y_ref: torch.Tensor,
    rows: slice,
    router_grad: torch.Tensor,
) -> dict[str, float]:
    """Relative errors of this rank's output, input gradient, router gradient (`router_grad`: already summed
    over the ranks) and its experts' weight gradients against the reference (`rows`: this rank's tokens)."""
    ids = layer.local_expert_ids
    return {
        "output": rel(y, y_ref[rows]),
        "grad_x": rel(x.grad, x_ref.grad[rows]),
        "grad_router": rel(router_grad, dense.router.gate.weight.grad),
        "grad_gate_up": rel(layer.gate_up_proj.grad, dense.gate_up_proj.grad[ids]),
        "grad_down": rel(layer.down_proj.grad, dense.down_proj.grad[ids]),
    }
