"""Routers with a trace's co-activation structure (`benchmarks/_router_trace.py`, e2e.py --router-trace)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from _bench_helpers import ROOT, torchrun  # tests/tools/_bench_helpers.py

sys.path.insert(0, str(ROOT / "benchmarks"))
import _router_trace as rt  # noqa: E402

from occult.placement.layout import Placement  # noqa: E402
from occult.placement.solvers import place  # noqa: E402
from occult.placement.stats import mean_ct  # noqa: E402
from occult.placement.synthetic import planted_trace  # noqa: E402
from occult.placement.trace import Trace, write_trace  # noqa: E402

E, K, D = 32, 4, 4


def planted(seed: int) -> np.ndarray:
    return planted_trace(8192, E, K, num_groups=D, noise=0.2, seed=seed).trace.layer(0)


def gain(ids_TK: np.ndarray) -> float:
    """E[C_T] on a greedy placement solved from half the tokens / on the contiguous one, other half."""
    half = len(ids_TK) // 2
    greedy = place(Trace([ids_TK[:half]], E, K), D, method="greedy").placement.expert_device(0)
    contiguous = Placement.contiguous(E, D, 1).expert_device(0)
    return mean_ct(ids_TK[half:], greedy, D) / mean_ct(ids_TK[half:], contiguous, D)


def route(rows_EH: torch.Tensor, tokens: int, seed: int) -> np.ndarray:
    h_TH = torch.randn(tokens, rows_EH.shape[1], generator=torch.Generator().manual_seed(seed))
    return torch.topk(h_TH @ rows_EH.T, K, dim=1).indices.numpy()


def test_indicator_correlation_is_a_correlation_matrix():
    ids_TK = planted(int(np.random.default_rng().integers(1 << 30)))
    ids_TK[ids_TK == 5] = 6  # expert 5 never picked: its row stays the identity's
    corr_EE = rt.indicator_correlation(ids_TK, E)
    assert np.allclose(corr_EE, corr_EE.T) and np.allclose(np.diag(corr_EE), 1.0)
    assert np.all(corr_EE[5, np.arange(E) != 5] == 0)
    assert np.linalg.eigvalsh(corr_EE).min() > -1e-9


def test_synthetic_routing_matches_the_traces_placement_gain():
    seed = int(np.random.default_rng().integers(1 << 30))
    ids_TK = planted(seed)
    u_EE, info = rt.sharpen(ids_TK, E, D, seed=seed % 1000)
    assert info["trace_ratio"] < 0.9  # the planted groups: a placement saves rows
    assert info["synthetic_ratio"] == pytest.approx(info["trace_ratio"], abs=0.03)
    rows_EH = rt.rows_from_factor(u_EE, 256, 2.0, torch.Generator().manual_seed(seed))
    assert rows_EH.shape == (E, 256) and torch.allclose(rows_EH.norm(dim=1), torch.full((E,), 2.0), atol=1e-4)
    assert gain(route(rows_EH, 8192, seed)) < 0.9  # through a real router on isotropic hidden states
    random_EH = torch.randn(E, 256, generator=torch.Generator().manual_seed(seed))
    assert gain(route(random_EH, 8192, seed)) > 0.93  # random routers: nothing to save


def test_rows_need_hidden_at_least_experts():
    with pytest.raises(ValueError, match="hidden >= experts"):
        rt.rows_from_factor(np.eye(E), E - 1, 1.0, torch.Generator())


def test_e2e_refuses_a_trace_of_another_expert_count(tmp_path):
    trace = tmp_path / "t.safetensors"
    write_trace(trace, Trace([planted(0)], E, K))
    res = torchrun(
        ROOT / "benchmarks" / "e2e.py",
        2,
        "--model",
        "tiny",
        "--router-trace",
        str(trace),
        "--variants",
        "dedup",
        "--iters",
        "1",
        "--seq",
        "16",
        "--batch",
        "1",
    )
    assert res.returncode != 0 and "exitcode: 2" in res.stderr  # every rank: bad input, before any model
    assert res.stderr.count("32 experts, the model has 8: profile a model with 8 experts") == 1, res.stderr[-2000:]
