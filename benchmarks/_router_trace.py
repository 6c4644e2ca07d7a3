"""Router weights with a trained model's co-activation structure (e2e.py --router-trace).

A random model's routers pick experts independently of each other, so no placement can save rows
on it. A trained model's do not: experts that answer the same kind of token are picked together.
`rows_from_trace` builds router rows whose logits, for isotropic hidden states h, are Gaussian with
a correlation built from R, the correlation matrix of the trace's expert indicators (x_e = 1 when a
token picked e), R = V diag(lam) V^T:

    W = s U Q^T,  U = rownorm(V diag(lam^(p/2))),  Q: [H, E] orthonormal

so W h = s U (Q^T h) and Q^T h is isotropic: experts picked together in the trace get correlated
logits, and top-k of them co-activates the same groups. Indicators of a top-k pick correlate far
less than the logits behind them, so p = 1 (logits correlated as R) gives too little structure;
`sharpen` picks p (bisection, 1 <= p <= 8) so that the synthetic routing's E[C_T] on a greedy
placement solved from the trace, relative to its E[C_T] on the contiguous one, matches the trace's
own ratio. Each row has norm s, the scale e2e.py's random routers have. Expert popularity is not
reproduced (every logit has the same variance); e2e.py reports the E[C_T] the model's own routing
then gives.
"""

from __future__ import annotations

import numpy as np
import torch


def indicator_correlation(topk_ids_TK: np.ndarray, num_experts: int) -> np.ndarray:
    """[E, E] correlation of the experts' pick indicators over the trace's tokens (unpicked experts: identity)."""
    T = topk_ids_TK.shape[0]
    x_TE = np.zeros((T, num_experts), np.float64)
    np.put_along_axis(x_TE, topk_ids_TK.astype(np.int64), 1.0, axis=1)
    x_TE -= x_TE.mean(0)
    cov_EE = x_TE.T @ x_TE / max(T - 1, 1)
    sd_E = np.sqrt(np.diag(cov_EE))
    live_E = sd_E > 0
    corr_EE = np.eye(num_experts)
    corr_EE[np.ix_(live_E, live_E)] = cov_EE[np.ix_(live_E, live_E)] / np.outer(sd_E[live_E], sd_E[live_E])
    return corr_EE


def logit_factor(corr_EE: np.ndarray, power: float) -> np.ndarray:
    """U [E, E] with unit rows: V diag(lam^(power/2)), lam clipped at 0."""
    evals_E, evecs_EE = np.linalg.eigh(corr_EE)
    u_EE = evecs_EE * np.clip(evals_E, 0.0, None) ** (power / 2)
    return u_EE / np.maximum(np.linalg.norm(u_EE, axis=1, keepdims=True), 1e-12)


def sharpen(
    topk_ids_TK: np.ndarray, num_experts: int, num_devices: int, seed: int = 0, tokens: int = 16384
) -> tuple[np.ndarray, dict[str, float]]:
    """(U, info): the power p whose synthetic routing matches the trace's placement gain (module docstring)."""
    from occult.placement.layout import Placement
    from occult.placement.solvers import place
    from occult.placement.stats import mean_ct
    from occult.placement.trace import Trace

    k = topk_ids_TK.shape[1]
    half = topk_ids_TK.shape[0] // 2
    greedy_E = place(
        Trace([topk_ids_TK[:half]], num_experts, k), num_devices, method="greedy", seed=seed
    ).placement.expert_device(0)
    contiguous_E = Placement.contiguous(num_experts, num_devices, 1).expert_device(0)
    held_out = topk_ids_TK[half:]
    target = mean_ct(held_out, greedy_E, num_devices) / mean_ct(held_out, contiguous_E, num_devices)
    corr_EE = indicator_correlation(topk_ids_TK[:half], num_experts)
    z_TE = np.random.default_rng(seed).standard_normal((tokens, num_experts))

    def ratio(power: float) -> float:
        ids_TK = np.argpartition(-(z_TE @ logit_factor(corr_EE, power).T), k - 1, axis=1)[:, :k]
        return mean_ct(ids_TK, greedy_E, num_devices) / mean_ct(ids_TK, contiguous_E, num_devices)

    lo, hi = 1.0, 8.0  # the ratio falls as p grows (more structure)
    for _ in range(10):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ratio(mid) > target else (lo, mid)
    power = (lo + hi) / 2
    return logit_factor(corr_EE, power), {"power": power, "trace_ratio": target, "synthetic_ratio": ratio(power)}


def rows_from_factor(u_EE: np.ndarray, hidden: int, row_norm: float, gen: torch.Generator) -> torch.Tensor:
    """[E, H] float32 router rows s U Q^T, Q a random [H, E] orthonormal frame."""
    num_experts = u_EE.shape[0]
    if hidden < num_experts:
        raise ValueError(f"--router-trace needs hidden >= experts (got {hidden} < {num_experts})")
    q_HE, _ = torch.linalg.qr(torch.randn(hidden, num_experts, generator=gen, dtype=torch.float64))
    return (torch.from_numpy(u_EE) @ q_HE.T * row_norm).float()
