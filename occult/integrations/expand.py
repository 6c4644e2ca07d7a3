"""Received rows <-> a framework's expert-major rows (pure torch, no communication).

occult delivers one row per (token, device) with the local expert slots it carries
(`slots_RK`, -1 = padding). TorchTitan's `GroupedExperts` and Megatron-Core's experts want one row
per (token, local expert), grouped by expert, with a count per local expert. `expand` makes those
rows; `reduce` applies the gate weights to the experts' outputs (TorchTitan; Megatron's experts
apply them themselves: `weighted=False`) and sums them back into one row per received row (the
pre-reduction that lets one row per (token, device) return).

Inside one expert the rows come in (source rank, token) order, the order TorchTitan's
`AllToAllTokenDispatcher` and Megatron's `MoEAlltoAllTokenDispatcher` give them, so the experts
see the same rows in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Expansion:
    """Where each expert-major row came from: received row `row_N`, gate weight `gate_N`."""

    row_N: torch.Tensor
    gate_N: torch.Tensor
    num_received: int


def expand(
    x_RH: torch.Tensor, slots_RK: torch.Tensor, gates_RK: torch.Tensor, num_local_experts: int
) -> tuple[torch.Tensor, torch.Tensor, Expansion]:
    """-> (rows x_NH in expert-major order, rows per local expert counts_e, `Expansion`).

    Reads the number of entries back to the host once (N is the row count of the grouped GEMMs)."""
    R, K = slots_RK.shape
    flat_slot = slots_RK.reshape(-1)
    # invalid entries sort last (key = num_local_experts); stable keeps (source rank, token) order
    key = torch.where(flat_slot >= 0, flat_slot, num_local_experts)
    order = torch.sort(key, stable=True).indices
    counts_e = torch.zeros(num_local_experts + 1, dtype=torch.int64, device=slots_RK.device)
    counts_e = counts_e.index_add_(0, key, torch.ones_like(key))[:num_local_experts]
    num_entries = int(counts_e.sum())  # host read: the grouped GEMMs' row count
    entry_N = order[:num_entries]
    row_N = entry_N // K
    gate_N = gates_RK.reshape(-1)[entry_N]
    return x_RH[row_N], counts_e, Expansion(row_N, gate_N, R)


def reduce(y_NH: torch.Tensor, expansion: Expansion, weighted: bool = True) -> torch.Tensor:
    """Gate-weighted sum of each received row's expert outputs (fp32 accumulation) -> y_RH.

    The weighting is TorchTitan's own: `(y.float() * score).to(y.dtype)`, then summed.
    `weighted=False`: the outputs are summed as they are (the experts applied the gates)."""
    weighted_NH = (y_NH.float() * expansion.gate_N.float()[:, None]).to(y_NH.dtype) if weighted else y_NH
    acc = torch.promote_types(y_NH.dtype, torch.float32)
    y_RH = y_NH.new_zeros((expansion.num_received, y_NH.shape[1]), dtype=acc)
    return y_RH.index_add_(0, expansion.row_N, weighted_NH.to(acc)).to(y_NH.dtype)
