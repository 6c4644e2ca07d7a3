"""occult's grouped experts for Megatron-Core (`GroupedLinear`, `use_grouped_experts`, the expert-key renames).

`grouped_matmul` equals one matmul per expert, outputs and both gradients, with experts of no rows, no rows at
all, row widths `torch._grouped_mm` takes (16-byte aligned) and ones it does not (the loop), and a gradient of
zero strides (`.sum()`). `GroupedLinear` keys its state dict as Transformer Engine's `GroupedLinear` (`weight{e}`)
and loads those keys or the stacked weight; in a sharded state dict it is one tensor over the global expert
axis (after the prepended layer axis), with an empty `_extra_state` per expert where SequentialMLP keeps its
own, and `singleton_local_shards` is refused; it refuses what it does not run. `use_grouped_experts` puts
`TEGroupedMLP` over it into 0.16's `ModuleSpec` and 0.19's `functools.partial` MoE specs. The layer's exactness
against Megatron's `SequentialMLP` on 2 ranks, and its checkpoints loading into SequentialMLP models, are in
test_megatron.py.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # as test_megatron.py: Megatron imports Triton

pytest.importorskip("megatron.core", reason="megatron-core 0.16.1 is installed by .ci/run (docs/testing.md)")

from occult.integrations.megatron import (  # noqa: E402
    GroupedLinear,
    to_grouped_expert_keys,
    to_sequential_expert_keys,
    use_grouped_experts,
)
from occult.integrations.megatron.experts import grouped_matmul, grouped_offsets  # noqa: E402


def _config(**overrides):
    settings = dict(params_dtype=torch.float32, use_cpu_initialization=True, fp8=False, gated_linear_unit=True)
    return SimpleNamespace(**{**settings, **overrides})


def _linear(experts, inputs, outputs, **overrides):
    kwargs = dict(config=_config(), init_method=torch.nn.init.normal_, bias=False, skip_bias_add=False, is_expert=True)
    return GroupedLinear(experts, inputs, outputs, **{**kwargs, **overrides})


def _reference(x_NI, weight_EOI, counts):
    bounds = torch.cumsum(torch.tensor([0, *counts]), 0).tolist()
    return torch.cat([x_NI[a:b] @ weight_EOI[e].T for e, (a, b) in enumerate(zip(bounds, bounds[1:]))])


@pytest.mark.parametrize("inputs, outputs", [(16, 24), (12, 20), (5, 7)])  # aligned fp32 rows; unaligned: the loop
@pytest.mark.parametrize("counts", [[3, 0, 9, 1], [0, 0, 0, 0], [0, 11, 0, 0]])
def test_grouped_matmul_equals_one_matmul_per_expert(inputs, outputs, counts):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 10_000, ())))
    x = torch.randn(sum(counts), inputs, generator=gen, requires_grad=True)
    w = torch.randn(len(counts), outputs, inputs, generator=gen, requires_grad=True)
    g = torch.randn(sum(counts), outputs, generator=gen)
    got = grouped_matmul(x, w, grouped_offsets(counts, x.device))
    (got * g).sum().backward()
    got_grads = x.grad.clone(), w.grad.clone()
    x.grad, w.grad = None, None
    ref = _reference(x, w, counts)
    (ref * g).sum().backward()
    scale = inputs**0.5 * 4  # terms ~ N(0, 1) products summed over `inputs` (or rows, for the weight gradients)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6 * scale)
    torch.testing.assert_close(got_grads[0], x.grad, rtol=1e-5, atol=1e-6 * scale)
    torch.testing.assert_close(got_grads[1], w.grad, rtol=1e-5, atol=1e-6 * (max(counts) + 1) ** 0.5 * 4)
    if counts == [3, 0, 9, 1]:  # an expert with no rows gets a zero gradient; a `.sum()` gradient is accepted
        assert torch.count_nonzero(got_grads[1][1]) == 0
        w.grad = None
        grouped_matmul(x, w, grouped_offsets(counts, x.device)).sum().backward()
        assert torch.isfinite(w.grad).all()


def test_grouped_linear_state_dict_is_transformer_engines():
    layer = _linear(3, 16, 8)
    assert layer.weight.shape == (3, 8, 16) and layer.weight.allreduce is False
    assert not torch.equal(layer.weight[0], layer.weight[1])  # each expert drawn on its own
    state = layer.state_dict()
    assert sorted(state) == ["weight0", "weight1", "weight2"]
    assert all(torch.equal(state[f"weight{e}"], layer.weight[e]) for e in range(3))
    other = _linear(3, 16, 8)
    other.load_state_dict({k: v.clone() for k, v in state.items()})  # per-expert keys, strict
    assert torch.equal(other.weight, layer.weight)
    stacked = torch.randn(3, 8, 16)
    other.load_state_dict({"weight": stacked})  # a distributed checkpoint's stacked weight
    assert torch.equal(other.weight, stacked)
    with pytest.raises(RuntimeError, match="Missing key"):
        other.load_state_dict({"weight0": stacked[0]})
    out, bias = layer(torch.randn(5, 16), [2, 0, 3])
    assert out.shape == (5, 8) and bias is None
    with pytest.raises(ValueError, match="3 local experts, got counts for 2"):
        layer(torch.randn(5, 16), [2, 3])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(bias=True), "expert biases"),
        (dict(is_expert=False), "experts only"),
        (dict(config=_config(delay_wgrad_compute=True)), "delay_wgrad_compute"),
        (dict(config=_config(fp8="hybrid")), "fp8"),
        (dict(pg_collection=SimpleNamespace(ep=None, expt_tp=SimpleNamespace(size=lambda: 2))), "tensor parallelism"),
    ],
)
def test_grouped_linear_refuses_what_it_does_not_run(overrides, message):
    with pytest.raises(NotImplementedError, match=message):
        _linear(2, 16, 8, **overrides)


def test_expert_key_renames_round_trip():
    state = {
        "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight": torch.ones(1),
        "decoder.layers.0.mlp.experts.local_experts.12.linear_fc2.weight": torch.ones(2),
        "decoder.layers.0.mlp.router.weight": torch.ones(3),
        "decoder.layers.1.self_attention.linear_qkv.weight": torch.ones(4),
    }
    grouped = to_grouped_expert_keys(state)
    assert sorted(grouped) == sorted(
        [
            "decoder.layers.0.mlp.experts.linear_fc1.weight3",
            "decoder.layers.0.mlp.experts.linear_fc2.weight12",
            "decoder.layers.0.mlp.router.weight",
            "decoder.layers.1.self_attention.linear_qkv.weight",
        ]
    )
    back = to_sequential_expert_keys(grouped)
    assert back.keys() == state.keys() and all(back[k] is v for k, v in state.items())


def test_use_grouped_experts_on_both_spec_forms():
    from functools import partial

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe import experts as megatron_experts
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from occult.integrations.megatron import install

    spec = get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False)
    assert use_grouped_experts(spec) == 1 and install(spec) == 1  # either order
    moe = spec.submodules.mlp
    experts = moe.submodules.experts if isinstance(moe, ModuleSpec) else moe.keywords["submodules"].experts
    module = experts.module if isinstance(experts, ModuleSpec) else experts.func
    assert module is megatron_experts.TEGroupedMLP
    assert experts.submodules.linear_fc1 is GroupedLinear if isinstance(experts, ModuleSpec) else True
    shared = MoESubmodules(experts=None)  # 0.19's form: a partial of MoELayer; the shared submodules left alone
    holder = [partial(MoELayer, submodules=shared)]
    if not hasattr(megatron_experts, "GroupedMLPSubmodules"):
        pytest.skip("the 0.19 form needs megatron-core 0.19's GroupedMLPSubmodules (the GPU image's)")
    assert use_grouped_experts(holder) == 1 and shared.experts is None
    built = holder[0].keywords["submodules"].experts
    assert built.func is megatron_experts.TEGroupedMLP and built.keywords["submodules"].linear_fc2 is GroupedLinear
    with pytest.raises(ValueError, match="has no MoELayer"):
        use_grouped_experts(get_gpt_layer_local_spec())


def test_grouped_linear_sharded_state_dict_is_one_tensor_over_the_expert_axis():
    from megatron.core.dist_checkpointing import ShardedTensor

    ep = SimpleNamespace(rank=lambda: 1, size=lambda: 2)  # this rank holds experts 3..5 of 6
    layer = _linear(3, 16, 8, pg_collection=SimpleNamespace(ep=ep, expt_tp=None, expt_dp=None))
    sharded = layer.sharded_state_dict("experts.linear_fc1.", sharded_offsets=((0, 1, 4),))  # layer 1 of 4
    weight = sharded["experts.linear_fc1.weight"]
    assert isinstance(weight, ShardedTensor) and weight.data is layer.weight
    assert tuple(weight.global_shape) == (4, 6, 8, 16) and tuple(weight.global_offset) == (1, 3, 0, 0)
    extra = [sharded[f"experts.linear_fc1._extra_state{e}"] for e in range(3)]
    assert [tuple(x.global_offset) for x in extra] == [(1, 3), (1, 4), (1, 5)]  # where SequentialMLP keeps them
    with pytest.raises(NotImplementedError, match="singleton_local_shards"):
        layer.sharded_state_dict("x.", metadata={"singleton_local_shards": True})
