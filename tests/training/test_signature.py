"""`occult.training.signature.ModelSignature`: the full `model_signature` at every point, recomputed only when a
module's dictionaries changed (a replaced parameter, buffer or child, `.data` swapped, a setting switched, added,
removed or renamed) and not while they are as they were (an in-place update, a replayed step)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from occult.training import signature
from occult.training.signature import ModelSignature, model_signature


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.register_buffer("scale", torch.randn(8))
        self.limit = 3
        self.ratio = 0.5


def _model() -> nn.Module:
    return nn.Sequential(Block(), Block(), nn.Linear(8, 4))


@pytest.fixture
def computed(monkeypatch) -> list[int]:
    """How many times the full signature was computed."""
    calls: list[int] = []
    full = signature.model_signature
    monkeypatch.setattr(signature, "model_signature", lambda m: calls.append(1) or full(m))
    return calls


def test_an_unchanged_model_is_checked_not_recomputed(computed):
    model = _model()
    cached = ModelSignature(model)
    first = cached()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))  # what an optimizer step does: in place, the same tensors
    assert [cached() for _ in range(5)] == [first] * 5
    assert first == model_signature(model)
    assert len(computed) == 1


def _replace_parameter(model):
    model[0].proj.weight = nn.Parameter(torch.randn(8, 8))


def _replace_parameter_by_an_equal_one(model):
    model[0].proj.bias = nn.Parameter(model[0].proj.bias.detach().clone())  # equal values, another tensor


def _swap_data(model):
    model[1].proj.bias.data = torch.randn(8)


def _replace_buffer(model):
    model[0].scale = torch.randn(8)


def _replace_child(model):
    model[1].norm = nn.LayerNorm(8)


def _switch_setting(model):
    model[0].limit = 2


def _switch_float_twice(model):
    model[1].ratio = 0.25
    model[1].ratio = 0.75  # (may reuse the memory of the 0.5 the model held: the signature holds that one)


def _add_setting(model):
    model[0].extra = 7


def _remove_setting(model):
    del model[1].limit


def _rename_setting(model):
    value = model[0].limit
    del model[0].limit
    model[0].other = value  # the same object under another name


def _evaluate(model):
    model.eval()


CHANGES = [
    _replace_parameter,
    _replace_parameter_by_an_equal_one,
    _swap_data,
    _replace_buffer,
    _replace_child,
    _switch_setting,
    _switch_float_twice,
    _add_setting,
    _remove_setting,
    _rename_setting,
    _evaluate,
]


@pytest.mark.parametrize("change", CHANGES, ids=[c.__name__.lstrip("_") for c in CHANGES])
def test_a_change_gives_the_full_signature_of_the_changed_model(change, computed):
    model = _model()
    cached = ModelSignature(model)
    before = cached()
    change(model)
    after = cached()
    assert after == model_signature(model)
    assert after != before
    assert cached() == after
    assert len(computed) == 2  # once at first, once after the change; then checked again


def test_a_change_undone_gives_the_first_signature_again():
    model = _model()
    cached = ModelSignature(model)
    before = cached()
    model[0].limit = 5
    assert cached() != before
    model[0].limit = 3
    assert cached() == before == model_signature(model)


def test_transport_generations_are_read_on_every_call(monkeypatch):
    model = _model()
    generation = [0]
    monkeypatch.setattr(signature, "OccultMoE", Block)  # the blocks stand in for MoE layers
    monkeypatch.setattr(signature, "transport_generation", lambda layer: generation[0])
    cached = ModelSignature(model)
    first = cached()
    assert first[2] == (0, 0)
    generation[0] = 1  # a transport grew its buffers: nothing in the modules' dictionaries changed
    assert cached()[2] == (1, 1) and cached() != first


def test_a_replaced_tensor_attribute_is_a_recomputation_not_an_error(computed):
    model = _model()
    model[0].cache = torch.randn(4)  # not a parameter or buffer: no part of the signature
    cached = ModelSignature(model)
    before = cached()
    model[0].cache = torch.randn(4)  # its `==` with the old one has no single truth value
    assert cached() == before == model_signature(model)
    assert len(computed) == 2
