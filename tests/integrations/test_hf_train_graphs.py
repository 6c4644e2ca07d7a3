"""What a converted transformers model's MoE layer records for a training replay (`occult.moe.train_graphs`):
the model's own gate is not a submodule of the layer (its block owns it), yet its weight must be among the
parameters whose gradients the recorded backward writes, its hooks must keep the layer eager, and its
tensors must be in the graph signature. `ExecConfig.train_graphs` is off by default and needs `graphs`."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers", reason="transformers is not installed (pip install 'occult[hf]')")

from occult import ExecConfig  # noqa: E402
from occult.integrations import hf  # noqa: E402
from occult.moe.graphs import has_hooks  # noqa: E402
from occult.moe.layer import OccultMoE  # noqa: E402


def _layer() -> tuple[OccultMoE, torch.nn.Module]:
    model = hf.convert(hf.tiny_random_model("olmoe", seed=3), execution=ExecConfig(graphs=True, train_graphs=True))
    block = hf.moe_blocks(model)[0][1]
    return block.experts, block.gate


def test_the_models_gate_trains_with_the_layer_and_its_hooks_count():
    layer, gate = _layer()
    assert not any(p is gate.weight for p in layer.parameters())  # not the layer's own parameter
    x = torch.randn(5, layer.hidden_size, requires_grad=True)
    call = layer._training_call(x, None)
    assert any(p is gate.weight for p in call.params)
    assert len({id(p) for p in call.params}) == len(call.params)
    gate.weight.requires_grad_(False)
    assert not any(p is gate.weight for p in layer._training_call(x, None).params)
    with torch.no_grad():
        assert layer._training_call(x, None) is None
    assert not has_hooks(layer, *layer._router_gate())
    handle = gate.register_forward_hook(lambda m, i, o: None)
    assert has_hooks(layer, *layer._router_gate()) and not has_hooks(layer)
    handle.remove()


def test_train_graphs_is_off_by_default_and_needs_graphs():
    assert ExecConfig().train_graphs is False and ExecConfig(graphs=True).train_graphs is False
    with pytest.raises(ValueError, match="train_graphs=True needs graphs=True"):
        ExecConfig(train_graphs=True)
    with pytest.raises(ValueError, match="train_graphs must be True or False"):
        ExecConfig(graphs=True, train_graphs="yes")


def test_a_captured_finetune_is_refused_where_it_cannot_be_recorded():
    """`FinetuneConfig.captured_step` off a GPU, or with `layer_graphs` (the layers are recorded inside the step),
    is a `ValueError` before any step. The routing check `convert` hooks on the model is replay-safe (a recorded
    step reads its statuses itself), so it does not count among the hooks that refuse a recording; a user's does."""
    model = hf.convert(hf.tiny_random_model("olmoe", seed=3))
    tokens = torch.randint(3, int(model.config.vocab_size), (500,))
    for kw, needle in (({}, "needs a CUDA device"), ({"layer_graphs": True}, "set layer_graphs=False")):
        cfg = hf.FinetuneConfig(steps=2, batch_size=2, seq_len=16, captured_step=True, **kw)
        with pytest.raises(ValueError, match=needle):
            hf.finetune(model, tokens, cfg, progress=False, log=None)
    assert model._forward_hooks and not has_hooks(model)
    handle = model.model.layers[0].register_forward_hook(lambda m, i, o: None)
    assert has_hooks(model)
    handle.remove()
