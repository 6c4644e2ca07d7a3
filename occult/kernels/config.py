"""Tile configurations of the expert-MLP kernels.

One `TileConfig` per kernel. The GPU defaults were chosen for Hopper by a small sweep
(`benchmarks/bench_kernels.py --sweep`; docs/kernels.md, "Numbers", has the machine and results);
under `TRITON_INTERPRET=1` small tiles keep the interpreter fast and exercise multi-tile paths.
`override(name, ...)` replaces a kernel's tiles for the process (the benchmark uses it to sweep).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from occult import settings


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # rows (pairs) per tile; for `wgrad`, rows of the weight-gradient tile
    block_n: int  # output columns per tile (per accumulator for `gemm1`)
    block_k: int  # contraction step (pairs for `wgrad`)
    group_m: int = 8  # m-tiles that share a sweep over n-tiles (L2 reuse of weights)
    num_warps: int = 8
    num_stages: int = 3
    flatten: bool = False  # persistent kernels: flatten the tile loop and the K loop into one pipeline
    ctas_per_sm: int = 1  # persistent kernels: programs launched per SM (more only if smem/regs allow)
    split: int = 1  # `dgrad1`: epilogue in this many column slices of the tile (1 or 2)


# name -> config on a CUDA device: the winners of `benchmarks/bench_kernels.py --sweep` at the
# OLMoE shape (docs/kernels.md, "Numbers"). Hopper-tuned; on Ampere (less shared memory) the
# 4-stage configs may need `override(..., num_stages=2)`.
GPU_DEFAULTS: dict[str, TileConfig] = {
    # gather x rows, [gate; up] dual accumulator (effective 128 x 256 tile), SwiGLU epilogue
    "gemm1": TileConfig(128, 128, 64, 16, 8, 3),
    # contiguous pair rows @ per-expert weight, scatter-store of output rows
    "gemm2": TileConfig(128, 256, 64, 8, 8, 4, flatten=True),
    # the same with the fp32 atomic-add epilogue (needs shared memory for the layout change)
    "gemm2_atomic": TileConfig(128, 128, 64, 8, 8, 3),
    # backward: gather dy rows @ down[e], SwiGLU backward + gate-gradient epilogue
    "dgrad1": TileConfig(128, 128, 64, 8, 8, 4, split=2),
    # backward: dx pairs = d[a;b] @ gate_up[e] (same kernel as gemm2)
    "dgrad2": TileConfig(128, 256, 64, 8, 8, 4, flatten=True),
    # backward: per-expert weight gradients, reduction over the expert's pairs (the Triton path;
    # on Hopper in bf16 they go through torch._grouped_mm, see kernels.grouped_mm). 3 stages:
    # two programs per SM, faster than 4 stages with one (docs/kernels.md, "Backward on one H100")
    "wgrad": TileConfig(128, 128, 64, 1, 8, 3),
    # kernels.grouped_mm.gather_pair_rows: block_m rows x block_n columns per step
    # (every tile swept ran within noise of the others: docs/kernels.md, "Backward on one H200")
    "gather": TileConfig(16, 1024, 1, 1, 8, 1, ctas_per_sm=4),
    # kernels.grouped_mm.swiglu_backward_rows (the elementwise pass of the _grouped_mm dgrad):
    # block_m rows x block_n columns; 8 x 256 at 32 programs per SM won the sweep against the former
    # 8 x 512 at 16 (docs/kernels.md, "Backward on one H200")
    "swiglu_rows": TileConfig(8, 256, 1, 1, 4, 1, ctas_per_sm=32),
    # index row sums (kernels.rows): a row's K pair rows, a token's rows (block_m rows x block_n columns)
    "combine": TileConfig(4, 512, 1, 1, 4, 1),
    # kernels.small_batch (decode): block_m pairs of one expert x block_n columns per program
    "small_gate_up": TileConfig(16, 32, 128, 1, 4, 4),
    "small_down": TileConfig(16, 64, 128, 1, 4, 4),
    "small_down_row": TileConfig(1, 16, 512, 1, 4, 1),
    "small_combine": TileConfig(1, 1024, 1, 1, 4, 1),
    # kernels.adamw: block_m elements of one parameter tensor per program (2048 x 4 warps and 1024 x 4 tied ahead
    # of the sweep's others: docs/training.md, "The optimizer step")
    "adamw": TileConfig(2048, 1, 1, 1, 4, 1),
}

INTERPRET_DEFAULTS: dict[str, TileConfig] = {
    "gemm1": TileConfig(16, 16, 16, 2, 4, 1),
    "gemm2": TileConfig(16, 32, 16, 2, 4, 1),
    "gemm2_atomic": TileConfig(16, 16, 16, 2, 4, 1),
    "dgrad1": TileConfig(16, 16, 16, 2, 4, 1, split=2),
    "dgrad2": TileConfig(16, 32, 16, 2, 4, 1),
    "wgrad": TileConfig(16, 32, 16, 1, 4, 1),
    "gather": TileConfig(4, 32, 1, 1, 4, 1),
    "swiglu_rows": TileConfig(4, 32, 1, 1, 4, 1),
    "combine": TileConfig(4, 32, 1, 1, 4, 1),
    "small_gate_up": TileConfig(16, 16, 16, 1, 4, 1),
    "small_down": TileConfig(16, 16, 16, 1, 4, 1),
    "small_down_row": TileConfig(1, 16, 16, 1, 4, 1),
    "small_combine": TileConfig(2, 16, 1, 1, 4, 1),
    "adamw": TileConfig(64, 1, 1, 1, 4, 1),
}

_OVERRIDES: dict[str, TileConfig] = {}


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return settings.current().triton_interpret


def get(name: str, dtype: torch.dtype | None = None) -> TileConfig:
    """Kernel `name`'s tiles for operands of `dtype`.

    The GPU defaults are sized for 2-byte operands; 4-byte (fp32) operands get half the
    contraction block, so every pipeline stage holds the same bytes of shared memory (the bf16
    tiles at fp32 overflow Hopper's 227 KB). An `override` is used as given.
    """
    if name in _OVERRIDES:
        return _OVERRIDES[name]
    if interpreting():
        return INTERPRET_DEFAULTS[name]
    cfg = GPU_DEFAULTS[name]
    if dtype is not None and dtype.itemsize >= 4 and cfg.block_k >= 32:
        cfg = dataclasses.replace(cfg, block_k=cfg.block_k // 2)
    return cfg


def override(name: str, config: TileConfig | None = None, **fields) -> None:
    """Use `config` (or the current one with `fields` replaced) for kernel `name`; None resets."""
    if config is None and not fields:
        _OVERRIDES.pop(name, None)
        return
    base = config if config is not None else get(name)
    _OVERRIDES[name] = dataclasses.replace(base, **fields)


def reset() -> None:
    _OVERRIDES.clear()


if interpreting():  # pragma: no cover - depends on the environment
    from occult.kernels import _interpreter_fixes

    _interpreter_fixes.apply()
