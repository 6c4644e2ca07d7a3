"""Expert MLPs on the rows a rank received: SwiGLU experts, gate-weighted and pre-reduced.

The contract (docs/design.md): `y[r] = sum_k gates[r,k] * expert[slots[r,k]](x[r])`, summed in
fp32 on this rank so one row per (token, device) pair goes back. This is the torch reference
path; `occult.kernels` provides fused Triton kernels with the same signature for GPUs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu_expert(x_NH: torch.Tensor, gate_up_FH: torch.Tensor, down_HF: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert: down @ (silu(gate @ x) * (up @ x)); gate_up holds [gate; up] rows."""
    gate_NF, up_NF = (x_NH @ gate_up_FH.t()).chunk(2, dim=-1)
    return (F.silu(gate_NF) * up_NF) @ down_HF.t()


def expert_mlp_reference(
    x_RH: torch.Tensor,
    slots_RK: torch.Tensor,
    gates_RK: torch.Tensor,
    gate_up_proj_EFH: torch.Tensor,
    down_proj_EHF: torch.Tensor,
) -> torch.Tensor:
    """Gate-weighted sum over each row's local experts (slot -1 = padding), fp32 accumulation.

    Expands rows to (row, slot) pairs grouped by expert and runs each expert once on its rows.
    Differentiable w.r.t. x, gates and both weights through plain autograd.
    """
    num_rows, hidden = x_RH.shape
    num_local = gate_up_proj_EFH.shape[0]
    flat_slot = slots_RK.reshape(-1)
    valid = flat_slot >= 0
    pair_index = valid.nonzero().squeeze(1)
    pair_row_P = pair_index // slots_RK.shape[1]
    pair_slot_P = flat_slot[pair_index]
    order = torch.argsort(pair_slot_P, stable=True)
    pair_index, pair_row_P, pair_slot_P = pair_index[order], pair_row_P[order], pair_slot_P[order]
    counts = torch.bincount(pair_slot_P, minlength=num_local).tolist()
    pair_gate_P = gates_RK.reshape(-1)[pair_index]
    acc_dtype = torch.promote_types(x_RH.dtype, torch.float32)
    y_RH = x_RH.new_zeros((num_rows, hidden), dtype=acc_dtype)
    x_PH = x_RH[pair_row_P]
    outs = []
    for slot, x_NH in enumerate(torch.split(x_PH, counts)):
        if torch.compiler.is_compiling() or x_NH.shape[0]:  # (traced, the count may be unknown: run it, empty or not)
            outs.append(swiglu_expert(x_NH, gate_up_proj_EFH[slot], down_proj_EHF[slot]))
    if outs:
        o_PH = torch.cat(outs).to(acc_dtype)
        y_RH = y_RH.index_add(0, pair_row_P, o_PH * pair_gate_P.to(acc_dtype)[:, None])
    elif num_local:
        # Keep every weight in the graph so gradients are zeros, not None.
        y_RH = (
            y_RH + 0 * (gate_up_proj_EFH.sum() + down_proj_EHF.sum()).to(acc_dtype) + 0 * gates_RK.sum().to(acc_dtype)
        )
    return y_RH.to(x_RH.dtype)


GateUp = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""The experts' gate and up weights: one `[E, 2F, H]` tensor (each expert's gate rows, then its up rows), or a
pair (gate, up) of `[E, F, H]` tensors kept apart (TorchTitan's `w1`, `w3`)."""


def expert_mlp(
    x_RH: torch.Tensor,
    slots_RK: torch.Tensor,
    gates_RK: torch.Tensor,
    gate_up_proj_EFH: GateUp,
    down_proj_EHF: torch.Tensor,
    backend: str = "auto",
    dense: bool = False,
) -> torch.Tensor:
    """Run the local experts on received rows; `backend` is "torch", "triton" or "auto".

    "auto" takes the Triton kernels for bf16/fp16/fp32 on a CUDA GPU (fp32 with exact, not tf32,
    products) and the torch reference path otherwise (CPU, float64). Under autocast the Triton
    kernels run in the autocast dtype, as the reference's matmuls do; the output keeps x's dtype.
    `dense`: no slot is padding (`Received.dense`); the kernels may then keep buffers sized by R*K.
    """
    if backend == "auto":
        backend = "torch"
        if x_RH.is_cuda and x_RH.dtype in (torch.bfloat16, torch.float16, torch.float32):
            try:
                from occult import kernels

                if kernels.available():
                    backend = "triton"
            except ImportError:
                pass
    if backend == "triton":
        from occult import kernels

        out_dtype = x_RH.dtype
        if torch.is_autocast_enabled(x_RH.device.type):  # autocast casts a matmul's inputs, a custom kernel's not:
            x_RH = x_RH.to(torch.get_autocast_dtype(x_RH.device.type))  # the kernels run in x's dtype (weights too)
        return kernels.expert_mlp(x_RH, slots_RK, gates_RK, gate_up_proj_EFH, down_proj_EHF, dense=dense).to(out_dtype)
    if backend != "torch":
        raise ValueError(f"unknown expert backend {backend!r}; use 'auto', 'torch' or 'triton'")
    if isinstance(gate_up_proj_EFH, tuple):  # (the Triton kernels read a pair where it is; the reference joins it)
        gate_up_proj_EFH = torch.cat(gate_up_proj_EFH, dim=1)
    return expert_mlp_reference(x_RH, slots_RK, gates_RK, gate_up_proj_EFH, down_proj_EHF)


class LocalExperts:
    """This rank's experts as the function `Received.apply` runs: (x_RH, slots_RK, gates_RK) -> y_RH.

    Gates are promoted to at least fp32 before the gate-weighted sum. `weights` are the tensors
    it differentiates through.
    """

    def __init__(self, gate_up_proj_EFH: GateUp, down_proj_EHF: torch.Tensor, backend: str = "auto") -> None:
        self.weights = (gate_up_proj_EFH, down_proj_EHF)
        self.backend = backend

    def __call__(
        self, x_RH: torch.Tensor, slots_RK: torch.Tensor, gates_RK: torch.Tensor, dense: bool = False
    ) -> torch.Tensor:
        gates_RK = gates_RK.to(torch.promote_types(x_RH.dtype, torch.float32))
        return expert_mlp(x_RH, slots_RK, gates_RK, *self.weights, backend=self.backend, dense=dense)
