"""Received rows <-> a framework's expert-major rows (pure torch, no communication).

occult delivers one row per (token, device) with the local expert slots it carries
(`slots_RK`, -1 = padding). TorchTitan's `GroupedExperts` and Megatron-Core's experts want one row
per (token, local expert), grouped by expert, with a count per local expert. `expand` makes those
rows; `reduce` applies the gate weights to the experts' outputs (TorchTitan; Megatron's experts
apply them themselves: `weighted=False`) and sums them back into one row per received row (the
pre-reduction that lets one row per (token, device) return), in fp32, one pass on GPUs.

Inside one expert the rows come in (source rank, token) order, the order TorchTitan's
`AllToAllTokenDispatcher` and Megatron's `MoEAlltoAllTokenDispatcher` give them, so the experts
see the same rows in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from occult.moe.gather import sum_rows


@dataclass
class Expansion:
    """Where each expert-major row came from: received row `row_N`, gate weight `gate_N`; where each received
    row's entries went (`entry_RK`: its expert-major rows, -1 for padding); the rows per local expert as read to
    the host (`counts_host_e`)."""

    row_N: torch.Tensor
    gate_N: torch.Tensor
    entry_RK: torch.Tensor
    counts_host_e: torch.Tensor


def expand(
    x_RH: torch.Tensor, slots_RK: torch.Tensor, gates_RK: torch.Tensor, num_local_experts: int
) -> tuple[torch.Tensor, torch.Tensor, Expansion]:
    """-> (rows x_NH in expert-major order, rows per local expert counts_e, `Expansion`).

    Reads the rows per expert back to the host once (their sum N is the row count of the grouped GEMMs;
    Megatron's experts take them on the host: `Expansion.counts_host_e`)."""
    R, K = slots_RK.shape
    flat_slot = slots_RK.reshape(-1)
    # invalid entries sort last (key = num_local_experts); stable keeps (source rank, token) order
    key = torch.where(flat_slot >= 0, flat_slot, num_local_experts)
    order = torch.sort(key, stable=True).indices
    counts_e = torch.zeros(num_local_experts + 1, dtype=torch.int64, device=slots_RK.device)
    counts_e = counts_e.index_add_(0, key, torch.ones_like(key))[:num_local_experts]
    counts_host_e = counts_e.cpu()  # the one host read
    num_entries = int(counts_host_e.sum())
    entry_N = order[:num_entries]
    row_N = entry_N // K
    gate_N = gates_RK.reshape(-1)[entry_N]
    entry_RK = torch.full((R * K,), -1, dtype=torch.int64, device=slots_RK.device)
    entry_RK[entry_N] = torch.arange(num_entries, device=slots_RK.device)
    expansion = Expansion(row_N, gate_N, entry_RK.view(R, K), counts_host_e)
    return x_RH[row_N], counts_e, expansion


def reduce(y_NH: torch.Tensor, expansion: Expansion, weighted: bool = True) -> torch.Tensor:
    """Gate-weighted sum of each received row's expert outputs (fp32 accumulation) -> y_RH.

    The weighting is TorchTitan's own: `(y.float() * score).to(y.dtype)`, then summed.
    `weighted=False`: the outputs are summed as they are (the experts applied the gates). The sums are
    occult's own (`occult.moe.gather.sum_rows`: one Triton pass reading every row once on GPUs, where an fp32
    copy and `index_add_` wrote and read the rows twice more)."""
    weighted_NH = (y_NH.float() * expansion.gate_N.float()[:, None]).to(y_NH.dtype) if weighted else y_NH
    return sum_rows(weighted_NH, expansion.row_N, expansion.entry_RK)
