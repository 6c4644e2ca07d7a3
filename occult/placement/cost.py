"""A cost model of one expert-parallel MoE layer: time from FLOPs, bytes per link level and overheads.

Per rank, T tokens, top-k, hidden H, expert ffn F, D GPUs on M nodes of G = D/M, bf16:

    experts   = 6 T k H F / gemm_rate                      (forward; backward adds bwd_factor x it)
    a2a       = latency + local/B_local + max(intra/B_nvlink, inter/B_internode)   per all-to-all
    forward   = experts + 2 a2a (dispatch, combine) + overhead_fwd
    fwd+bwd   = (1 + bwd_factor) experts + 4 a2a + overhead_fwd + overhead_bwd

Bytes per all-to-all are rows x H x 2. Rows per token and how they split over link levels
(a token's own GPU uniform and independent of its routing, as in `occult.placement.stats`):

- `standard` (k copies) and `dedup` (one copy per GPU, r = E[C_T]): of r rows a token sends,
  r/D stay on its GPU, r(G-1)/D go over NVLink, r(D-G)/D cross nodes;
- `two_level` (one copy per destination node, fanned out inside it: `dispatcher="dedup2"`, whose
  row counts match these on simulated nodes, `benchmarks/two_level_rows.py`; its measured times run above these,
  docs/fourgpu.md):
  E[N_T](M-1)/M rows cross nodes, E[C_T](G-1)/G move inside nodes, E[C_T]/G stay local.

The intra- and inter-node transfers of one all-to-all are taken to overlap (the max), and
per-peer latency is not modelled (it is fitted at D <= 4 only). `fit` derives the constants
from measured layer runs (`occult bench` JSON): the GEMM rate from the expert-only times, the
latency and bandwidths from the all-to-all-only times (non-negative least squares), the
overheads and the backward factor from the whole-layer times. The inter-node bandwidth cannot
be fitted from one-node runs: it is an input.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from occult.placement.stats import analytic_mean_ct

BYTES_BF16 = 2


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    ffn: int
    experts: int
    top_k: int


SHAPES = {
    "olmoe": Shape("olmoe", 2048, 1024, 64, 8),  # OLMoE-1B-7B
    "qwen3": Shape("qwen3", 2048, 768, 128, 8),  # Qwen3-30B-A3B
    "deepseek": Shape("deepseek", 2048, 1408, 64, 6),  # DeepSeek-MoE-16B (what `occult bench` calls deepseek)
    "mixtral": Shape("mixtral", 4096, 14336, 8, 2),
    "deepseek_v3": Shape("deepseek_v3", 7168, 2048, 256, 8),  # routed experts only
}


@dataclass(frozen=True)
class CostConstants:
    gemm_tflops: float  # expert forward GEMM rate
    bwd_factor: float  # expert backward time / expert forward time
    latency_ms: float  # fixed cost of one all-to-all
    local_GBps: float  # rows a GPU sends to itself
    nvlink_GBps: float  # per GPU, to other GPUs of its node
    internode_GBps: float  # per GPU, to other nodes (an assumption, not fitted)
    overhead_fwd_ms: float  # plan, gathers, count exchange, ... per forward
    overhead_bwd_ms: float  # extra per backward

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def rows_per_token(variant: str, shape: Shape, D: int, M: int, mean_ct: float, mean_nt: float) -> dict[str, float]:
    """Rows a token sends per all-to-all, split into local / intra-node / inter-node (module docstring)."""
    G = D // M
    if variant in ("standard", "dedup"):
        r = float(shape.top_k) if variant == "standard" else float(mean_ct)
        return {"local": r / D, "intra": r * (G - 1) / D, "inter": r * (D - G) / D}
    if variant == "two_level":
        return {"local": mean_ct / G, "intra": mean_ct * (G - 1) / G, "inter": mean_nt * (M - 1) / M}
    raise ValueError(f"unknown variant {variant!r}: standard, dedup, two_level")


def expert_gflop(shape: Shape, tokens: int) -> float:
    """Forward expert GFLOP per rank with balanced load: 6 T k H F."""
    return 6.0 * tokens * shape.top_k * shape.hidden * shape.ffn / 1e9


def a2a_ms(rows: dict[str, float], tokens: int, shape: Shape, c: CostConstants) -> float:
    gb = {k: v * tokens * shape.hidden * BYTES_BF16 / 1e9 for k, v in rows.items()}
    inter = gb["inter"] / c.internode_GBps * 1e3 if gb["inter"] > 0 else 0.0
    return c.latency_ms + gb["local"] / c.local_GBps * 1e3 + max(gb["intra"] / c.nvlink_GBps * 1e3, inter)


def layer_time(
    shape: Shape,
    tokens: int,
    D: int,
    M: int,
    variant: str,
    c: CostConstants,
    mean_ct: float | None = None,
    mean_nt: float | None = None,
) -> dict[str, float]:
    """Predicted ms of one layer: experts, one all-to-all, forward, forward+backward.

    `mean_ct` / `mean_nt` default to uniform routing's analytic values."""
    if mean_ct is None:
        mean_ct = analytic_mean_ct(shape.experts, shape.top_k, D)
    if mean_nt is None:
        mean_nt = analytic_mean_ct(shape.experts, shape.top_k, M)
    experts = expert_gflop(shape, tokens) / c.gemm_tflops  # GFLOP / (GFLOP/ms)
    a2a = a2a_ms(rows_per_token(variant, shape, D, M, mean_ct, mean_nt), tokens, shape, c)
    fwd = experts + 2 * a2a + c.overhead_fwd_ms
    fb = (1 + c.bwd_factor) * experts + 4 * a2a + c.overhead_fwd_ms + c.overhead_bwd_ms
    return {"experts_ms": experts, "a2a_ms": a2a, "forward_ms": fwd, "fwd_bwd_ms": fb}


# ------------------------------------------------------------------ fitting
@dataclass(frozen=True)
class Measured:
    """One measured layer run (an `occult bench` JSON row), one node."""

    shape: Shape
    tokens: int
    world: int
    variant: str  # standard / dedup (dedup+placement counts as dedup with its own E[C_T])
    mean_ct: float
    forward_ms: float
    fwd_bwd_ms: float
    expert_ms: float
    a2a_ms: float  # both all-to-alls of a forward
    label: str = ""


def measured_from_bench(doc: dict[str, Any], shapes: dict[str, Shape] = SHAPES) -> list[Measured]:
    """The runs of an `occult bench --out` JSON document."""
    out = []
    for r in doc["runs"]:
        variant = "standard" if r["variant"] == "standard" else "dedup"
        label = f"{r['world']}x {r['shape']} {r['routing']} {r['variant']}"
        out.append(
            Measured(
                shapes[r["shape"]],
                int(r["tokens"]),
                int(r["world"]),
                variant,
                float(r["mean_ct"]),
                float(r["forward_ms"]),
                float(r["fwd_bwd_ms"]),
                float(r["expert_ms"]),
                float(r["all_to_all_ms"]),
                label,
            )
        )
    return out


def _nnls(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a few unknowns: the best feasible least-squares solution
    over every support (exact, since the optimum is the plain least-squares fit on its support)."""
    n = A.shape[1]
    best, best_res = np.zeros(n), float(np.sum(b**2))
    for mask in range(1, 2**n):
        cols = [j for j in range(n) if mask >> j & 1]
        sol = np.linalg.lstsq(A[:, cols], b, rcond=None)[0]
        if np.all(sol >= 0):
            x = np.zeros(n)
            x[cols] = sol
            res = float(np.sum((A @ x - b) ** 2))
            if res < best_res:
                best, best_res = x, res
    return best


def _bytes(m: Measured) -> dict[str, float]:
    rows = rows_per_token(m.variant, m.shape, m.world, 1, m.mean_ct, 1.0)
    return {k: v * m.tokens * m.shape.hidden * BYTES_BF16 / 1e9 for k, v in rows.items()}


def fit(points: Iterable[Measured], internode_GBps: float = 40.0) -> CostConstants:
    """Constants from one-node measurements (module docstring); every fit weighs relative error."""
    pts = list(points)
    if not pts:
        raise ValueError("no measured points to fit")
    # GEMM rate: expert-only times against FLOPs.
    fl = np.array([expert_gflop(m.shape, m.tokens) for m in pts])
    ex = np.array([m.expert_ms for m in pts])
    ms_per_gflop = float(np.sum(fl / ex) / np.sum((fl / ex) ** 2))  # relative least squares through 0
    # Latency and bandwidths: the all-to-all-only times (two per forward).
    by = [_bytes(m) for m in pts]
    A = np.array([[2.0, 2 * b["local"], 2 * b["intra"]] for b in by])
    y = np.array([m.a2a_ms for m in pts])
    lat, inv_local, inv_nv = _nnls(A / y[:, None], np.ones(len(pts)))
    base = CostConstants(
        1 / ms_per_gflop, 0.0, float(lat), 1e3 / max(inv_local, 1e-9), 1e3 / max(inv_nv, 1e-9), internode_GBps, 0.0, 0.0
    )
    # Forward overhead: what experts + two all-to-alls leave of the forward.
    pred = [layer_time(m.shape, m.tokens, m.world, 1, m.variant, base, m.mean_ct) for m in pts]
    fwd = np.array([m.forward_ms for m in pts])
    rest = fwd - np.array([p["forward_ms"] for p in pred])
    o_f = float(np.sum(rest / fwd**2) / np.sum(1 / fwd**2))
    # Backward: a multiple of the expert forward plus a fixed extra.
    fb = np.array([m.fwd_bwd_ms for m in pts])
    rest_b = fb - np.array([p["experts_ms"] + 4 * p["a2a_ms"] for p in pred]) - o_f
    B = np.stack([np.array([p["experts_ms"] for p in pred]), np.ones(len(pts))], 1)
    bwd, o_b = _nnls(B / fb[:, None], rest_b / fb)
    return replace(base, bwd_factor=float(bwd), overhead_fwd_ms=max(o_f, 0.0), overhead_bwd_ms=float(o_b))


def validate(points: Iterable[Measured], c: CostConstants) -> list[dict[str, Any]]:
    """Predicted against measured forward and forward+backward, with relative errors."""
    rows = []
    for m in points:
        p = layer_time(m.shape, m.tokens, m.world, 1, m.variant, c, m.mean_ct)
        rows.append(
            {
                "point": m.label,
                "world": m.world,
                "mean_ct": m.mean_ct,
                "forward_ms": m.forward_ms,
                "forward_pred_ms": p["forward_ms"],
                "forward_err": p["forward_ms"] / m.forward_ms - 1,
                "fwd_bwd_ms": m.fwd_bwd_ms,
                "fwd_bwd_pred_ms": p["fwd_bwd_ms"],
                "fwd_bwd_err": p["fwd_bwd_ms"] / m.fwd_bwd_ms - 1,
            }
        )
    return rows
