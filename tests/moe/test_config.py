"""The layer's config objects: validation with clear errors, and the keyword form meaning the same."""

from __future__ import annotations

import pytest
import torch

from occult import DenseMoE, ExecConfig, MoEConfig, OccultMoE, RoutingConfig
from occult.moe.registry import DISPATCHERS, capabilities


def test_keyword_form_and_config_form_build_the_same_layer():
    torch.manual_seed(0)
    a = OccultMoE(16, 8, 8, 2, norm_topk_prob=True, dispatcher="standard", sync_free=True, dtype=torch.float64)
    torch.manual_seed(0)
    b = OccultMoE(
        MoEConfig(16, 8, 8, 2, torch.float64),
        routing=RoutingConfig(norm_topk_prob=True),
        execution=ExecConfig(dispatcher="standard", sync_free=True),
    )
    assert a.config == b.config and a.routing == b.routing and a.execution == b.execution
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    x = torch.randn(9, 16, dtype=torch.float64)
    assert torch.equal(a(x), b(x))
    assert a.dispatcher.name == "standard" and a.sync_free and a.norm_topk_prob


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: MoEConfig(16, 8, 8, 9), "top_k"),
        (lambda: MoEConfig(16, 0, 8, 2), "ffn_size"),
        (lambda: MoEConfig(16, 8, 8, 2, dtype="bf16"), "dtype"),
        (lambda: RoutingConfig(max_devices=0), "max_devices"),
        (lambda: RoutingConfig(max_nodes=1), "devices_per_node"),
        (lambda: RoutingConfig(prune_method="nearest"), "prune_method"),
        (lambda: ExecConfig(expert_backend="cuda"), "expert_backend"),
        (lambda: ExecConfig(sync_free="yes"), "sync_free"),
    ],
)
def test_bad_settings_raise_a_clear_error(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: OccultMoE(16, 8, 8), "missing"),
        (lambda: OccultMoE(16, 8, 8, 2, hidden=3), "unknown"),
        (
            lambda: OccultMoE(16, 8, 8, 2, overlap_chunks=2),
            r"unknown MoE layer settings \['overlap_chunks'\]",
        ),  # removed (issue 36)
        (lambda: ExecConfig(overlap_chunks=2), "overlap_chunks"),
        (lambda: OccultMoE(16, 8, 8, 2, top_k=2), "twice"),
        (lambda: OccultMoE(16, 8, 8, 2, execution=ExecConfig(dispatcher="standard"), dispatcher="dedup2"), "both"),
        (lambda: OccultMoE(MoEConfig(16, 8, 8, 2), 4), "positionally"),
    ],
)
def test_keyword_form_refuses_ambiguity(make, match):
    with pytest.raises(TypeError, match=match):
        make()


def test_settings_changed_later_are_validated_and_used():
    dense = DenseMoE(8, 6, 8, 3, dtype=torch.float64)
    layer = OccultMoE.from_dense(dense, execution=ExecConfig(dispatcher="standard"))
    assert layer.dispatcher.name == "standard"
    x = torch.randn(5, 8, dtype=torch.float64)
    for free in (True, False, True):
        layer.sync_free = free
        assert layer.execution == ExecConfig("standard", free)
        assert torch.allclose(layer(x), dense(x), rtol=1e-12, atol=1e-13)
    with pytest.raises(ValueError, match="sync_free"):
        layer.sync_free = None


def test_capabilities_describe_every_dispatcher():
    assert set(DISPATCHERS) == {"standard", "dedup", "dedup2"}
    assert not capabilities("standard").deduplicated and capabilities("dedup").deduplicated
    assert capabilities("dedup2").two_level and not capabilities("dedup").two_level
    assert all(capabilities(n).sync_free for n in DISPATCHERS)
    with pytest.raises(ValueError, match="unknown dispatcher 'dedup3'"):
        capabilities("dedup3")
