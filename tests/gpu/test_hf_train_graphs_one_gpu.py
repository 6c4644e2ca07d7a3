"""Training a converted transformers model on one GPU with its MoE layers replayed from CUDA graphs
(forward and backward, `occult.moe.train_graphs`): 50 bf16 AdamW steps, in the usual loop
(`loss = model(...).loss; loss.backward()`, so the previous step's graph is alive when a layer records),
give the losses of the same model with every MoE layer eager, step by step within 1e-3 relative
(issue 52's bound). The router gate is the block's module, not the layer's: its gradient must come out
of the recorded backward too. Single-process GPU tests (tests/gpu/run.sh's second stage); the
multi-rank case is tests/gpu/test_collective_hf_train_graphs.py."""

from __future__ import annotations

import copy
import os
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'occult[hf]')")

from test_collective_hf import _random_placement  # noqa: E402
from test_collective_hf_train_graphs import LOSS_TOL, VOCAB, _losses  # noqa: E402

from occult import ExecConfig  # noqa: E402
from occult.integrations import hf  # noqa: E402
from occult.moe.layer import OccultMoE  # noqa: E402


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_fifty_bf16_steps_with_layer_graphs_give_the_eager_losses_on_one_gpu():
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    one = SimpleNamespace(rank=0, device=torch.device("cuda"))
    base = hf.tiny_random_model("olmoe", seed=seed, vocab_size=VOCAB).to(one.device, torch.bfloat16)
    E = int(hf.moe_blocks(base)[0][1].gate.weight.shape[0])
    placement = _random_placement(E, len(hf.moe_blocks(base)), 1, seed)
    graphed = hf.convert(copy.deepcopy(base), placement=placement, dispatcher="dedup", execution=ExecConfig())
    eager = hf.convert(base, placement=placement, dispatcher="dedup", execution=ExecConfig())
    layers = [m for m in graphed.modules() if isinstance(m, OccultMoE)]
    for layer in layers:
        layer.execution = replace(layer.execution, graphs=True, train_graphs=True)
    got, ref = _losses(graphed, one, seed), _losses(eager, one, seed)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    assert min(len(layer.graphs) for layer in layers) >= 1  # every layer replayed
    assert worst <= LOSS_TOL, (seed, worst, got[-3:], ref[-3:])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_finetune_with_layer_graphs_and_the_aux_loss_gives_the_eager_losses(monkeypatch):
    """`hf.finetune(FinetuneConfig(layer_graphs=True))` with the load-balancing loss on (its taps read each block's
    routing beside the layer, no hooks): every layer's training calls replayed, the eager run's losses within
    1e-3 over 20 steps; after it the layers' settings are as before and their graphs freed."""
    from occult.moe import train_graphs

    replays = []
    original = train_graphs.TrainingCapture.replay
    monkeypatch.setattr(train_graphs.TrainingCapture, "replay", lambda self, x: replays.append(1) or original(self, x))
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    base = hf.tiny_random_model("olmoe", seed=seed, vocab_size=VOCAB).to("cuda")
    E = int(hf.moe_blocks(base)[0][1].gate.weight.shape[0])
    placement = _random_placement(E, len(hf.moe_blocks(base)), 1, seed)
    tokens = torch.randint(3, VOCAB, (4000,), generator=torch.Generator().manual_seed(seed))
    losses = {}
    for graphs in (True, False):
        model = hf.convert(copy.deepcopy(base), placement=placement, dispatcher="dedup", execution=ExecConfig())
        cfg = hf.FinetuneConfig(
            steps=20,
            batch_size=4,
            seq_len=32,
            lr=1e-3,
            warmup_steps=2,
            seed=seed,
            aux_loss_coef=0.01,
            layer_graphs=graphs,
        )
        losses[graphs] = hf.finetune(model, tokens, cfg, progress=False, log=None).losses
        layers = [m for m in model.modules() if isinstance(m, OccultMoE)]
        assert not any(layer.execution.graphs or len(layer.graphs) for layer in layers)
        if graphs:
            assert len(replays) >= len(layers) * 15, len(replays)  # from the third step on
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses[True], losses[False]))
    assert worst <= LOSS_TOL, (seed, worst, losses[True][-3:], losses[False][-3:])
