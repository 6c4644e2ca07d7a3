"""benchmarks/tt_model.py's `compile_blocks_as_titan`: a block whose all-to-all sizes come from the data (read back
with `.tolist()`, as TorchTitan's dispatcher does) compiles a bounded number of graphs over steps of new sizes, in
both modes: sizes traced (TorchTitan's `apply_compile` settings) and a graph break at the read-back, a size dynamic
once it changes. With static shapes (what e2e.py's `torchtitan/compile` did before) every new size was a recompile,
and the benchmark never finished on GPUs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import tt_model  # noqa: E402

sys.path.pop(0)


class SplitBlock(nn.Module):
    """Rows split by a data-dependent count per group, each group scaled, put back: sizes only the data knows."""

    def forward(self, x_RH: torch.Tensor) -> torch.Tensor:
        group_R = (x_RH[:, 0] > 0).long()
        order = torch.argsort(group_R, stable=True)
        sizes = torch.bincount(group_R, minlength=2).tolist()
        parts = torch.split(x_RH[order], sizes)
        out = torch.cat([p * (i + 2) for i, p in enumerate(parts)])
        return torch.empty_like(out).index_copy(0, order, out)


@pytest.mark.parametrize("traced_splits", [True, False])
def test_new_split_sizes_do_not_recompile_every_step(traced_splits):
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    block = SplitBlock()
    config = torch._dynamo.config  # what the function sets, restored after
    keep = {k: getattr(config, k) for k in ("recompile_limit", "accumulated_recompile_limit")}
    with config.patch(capture_scalar_outputs=False, **keep):
        mode = tt_model.compile_blocks_as_titan([block], traced_splits, backend=counting)
        assert ("traced" in mode) == traced_splits
        gen = torch.Generator().manual_seed(0)
        for step in range(8):
            x = torch.randn(64, 8, generator=gen)
            x[: 8 + 6 * step, 0] = 1.0  # a new split every step
            assert torch.equal(block(x), SplitBlock().forward(x)), step
    assert len(graphs) <= 6, f"{len(graphs)} graphs over 8 steps of new sizes: recompiling every step"
