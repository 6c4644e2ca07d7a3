"""benchmarks/_replay_check.py: e2e.py's check that a model's MoE layers train the same with their training calls
replayed as eager. On CPU nothing replays (CUDA graphs), so both passes run the same eager layers; a layer that
computes something else while set to replay stands in for a wrong replay, which the check must catch."""

from __future__ import annotations

import math
import sys
from dataclasses import replace

import pytest
import torch
from _bench_helpers import ROOT

pytest.importorskip("transformers")
sys.path.insert(0, str(ROOT / "benchmarks"))

from _replay_check import relative_error, replay_check  # noqa: E402

from occult.integrations import hf  # noqa: E402
from occult.moe.layer import OccultMoE  # noqa: E402


def _model(replays: bool) -> torch.nn.Module:
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    model = hf.convert(hf.tiny_random_model("olmoe", seed=seed), dispatcher="dedup")
    if replays:
        for layer in model.modules():
            if isinstance(layer, OccultMoE):
                layer.execution = replace(layer.execution, graphs=True, train_graphs=True)
    return model.train()


def _step(model: torch.nn.Module):
    ids = torch.randint(0, model.config.vocab_size, (2, 16))

    def step() -> None:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    return step


def test_the_same_layers_both_ways_pass_and_settings_come_back():
    model = _model(replays=True)
    result = replay_check(model, _step(model), tol=1e-6)
    assert result["passed"] and result["max_rel_err"] <= 1e-6, result
    layers = [m for m in model.modules() if isinstance(m, OccultMoE)]
    assert all(m.execution.graphs and m.execution.train_graphs for m in layers)  # restored
    assert all(p.grad is None for p in model.parameters())


def test_a_layer_that_trains_otherwise_when_replaying_fails(monkeypatch):
    model = _model(replays=True)
    forward = OccultMoE.forward

    def wrong_when_replaying(self, x, *args, **kwargs):
        y = forward(self, x, *args, **kwargs)
        return y * 1.5 if self.execution.train_graphs else y

    monkeypatch.setattr(OccultMoE, "forward", wrong_when_replaying)
    result = replay_check(model, _step(model), tol=1e-2)
    assert not result["passed"] and result["max_rel_err"] > 1e-2, result
    assert result["worst_param"], result


def test_nothing_to_check_without_replays():
    model = _model(replays=False)
    assert replay_check(model, _step(model), tol=1e-2) is None


def test_relative_error_of_missing_and_non_finite_gradients():
    want = torch.ones(4)
    assert relative_error(None, want) == math.inf
    assert relative_error(torch.full((4,), float("nan")), want) == math.inf
    assert relative_error(torch.zeros(4), torch.zeros(4)) == 0.0
    assert relative_error(torch.ones(4), torch.zeros(4)) == math.inf
    assert relative_error(want * 1.1, want) == pytest.approx(0.1)
