"""`OccultGroupedExperts`: TorchTitan's `GroupedExperts` run by occult's fused expert kernels.

With `OccultTokenDispatcher.Config(fused_experts=True)` (`install(..., fused_experts=True)`) the dispatcher
hands the experts occult's received rows as they arrive: one row per (token, rank), the local expert slots
it carries and their gate weights (`occult.moe.contract.Received`), instead of expert-major rows with a
count per expert. These experts run occult's own expert MLP on them (`occult.moe.experts.LocalExperts`: on a
GPU the Triton kernels, gather + gate/up GEMM + SwiGLU and down GEMM + gate fused, each row's experts summed
on this rank), so the expansion to expert-major rows, TorchTitan's three `torch._grouped_mm` calls with
their SwiGLU in between, and the gate-weighted reduction before the combine are gone.

The parameters are TorchTitan's (`w1_EFD`, `w2_EDF`, `w3_EFD`: same names, shapes, sharding, initialisation
and checkpoints); the kernels read `w1` and `w3` where they are, as occult's gate and up weights kept apart
(`occult.moe.experts.GateUp`), and give each its own gradient: no joined `[gate; up]` copy a forward, no
strided gradient halves to accumulate. The experts compute in their weights'
dtype (TorchTitan's `GroupedExperts` always casts to bf16). Given expert-major rows and counts (TorchTitan's
own dispatchers, or occult's without `fused_experts`) they run TorchTitan's computation unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torchtitan.models.common.moe import GroupedExperts

from occult.moe.contract import Received
from occult.moe.experts import LocalExperts


class OccultGroupedExperts(GroupedExperts):
    """TorchTitan's grouped experts, run on occult's received rows by occult's kernels (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def forward(self, x_RD: torch.Tensor, rows: torch.Tensor | Received) -> torch.Tensor:
        """`rows`: occult's `Received` (fused dispatch) -> y_RD, each received row's experts gate-weighted and
        summed; a count per local expert (expert-major rows) -> TorchTitan's `GroupedExperts` result."""
        if not isinstance(rows, Received):
            return super().forward(x_RD, rows)
        w1_EFD, w2_EDF, w3_EFD = (
            w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD)
        )
        return rows.apply(LocalExperts((w1_EFD, w3_EFD), w2_EDF))  # (gate, up) kept apart
