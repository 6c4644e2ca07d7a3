"""The load-balancing loss of `hf.finetune` (`aux_loss_coef`, `occult.integrations.hf.aux_loss`).

One process: the "transformers" formula equals the model's own `aux_loss`
(`output_router_logits=True`: `load_balancing_loss_func` of the family) in value and router
gradient, for OLMoE and Qwen3-MoE with pruned routing; the "switch" formula of DeepSeek-V3 (which
has none) equals a hand computation from the routed ids and normalised sigmoid scores.
One spawn of 2 gloo ranks: 8 steps with `aux_loss_coef=0.1`, OLMoE (experts over both ranks by a
non-contiguous placement, pruned to 1 of 2 devices) and DeepSeek-V3 (16 experts, contiguous) ==
one process on the global batch (losses and weights to 1e-5); the loss is over the global batch
(each rank's value is the global one), and it changes the routers (against a run without it).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from _hf_helpers import trained_weights as _trained  # noqa: E402  (tests/integrations)

from occult.distributed import run_ranks  # noqa: E402
from occult.integrations import hf  # noqa: E402
from occult.integrations.hf.aux_loss import RouterTaps, aux_formula  # noqa: E402
from occult.placement import Placement  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

VOCAB = 96
PLACEMENT = [[1, 0, 0, 1, 0, 1, 1, 0], [0, 1, 1, 0, 1, 0, 0, 1]]
CFG = dict(steps=8, batch_size=4, seq_len=16, lr=1e-2, warmup_steps=2, seed=3, precision="fp32", aux_loss_coef=0.1)
RTOL = 1e-5
# DeepSeek-V3 with adam eps 1e-4: at 1e-6 a few expert weights whose gradients are ~1e-6 (the aux
# loss reaches them only through the hidden states) turn last-bit differences of the two-half sum
# into 1.4e-5 relative (7.9e-6 without the aux loss); at 1e-4, 4e-7 even with aux_loss_coef=1.
EPS = {"olmoe": 1e-6, "deepseek_v3": 1e-4}


def mean_rtol(terms: int) -> float:
    """What summing `terms` positive fp32 numbers in another order (other formulas, another split of the
    batch over ranks) can change their mean by, relatively: `terms` eps. The aux loss is such a mean."""
    return terms * torch.finfo(torch.float32).eps


def _tokens() -> torch.Tensor:
    return torch.randint(3, VOCAB, (3000,), generator=torch.Generator().manual_seed(5))


def _load(dirs: dict, family: str, groups=None):
    if family == "olmoe":
        p = Placement(np.array(PLACEMENT), 2)
        if groups is None:
            return hf.load_sharded(dirs[family], routing_placement=p, max_devices=1)
        return hf.load_sharded(dirs[family], group=groups.ep, placement=p, max_devices=1)
    return hf.load_sharded(dirs[family], group=groups.ep if groups is not None else None)


def two_ranks(rank: int, world_size: int, dirs: dict) -> dict:
    groups = hf.setup_groups()
    out = {}
    for family in ("olmoe", "deepseek_v3"):
        model = _load(dirs, family, groups)
        result = hf.finetune(
            model, _tokens(), hf.FinetuneConfig(**CFG, adam_eps=EPS[family]), groups, progress=False, log=None
        )
        out[family] = {"losses": result.losses, "params": _trained(model)}
    model = _load(dirs, "olmoe", groups)  # the value on each rank: the global batch's, not its half
    taps = RouterTaps(model)
    x = _tokens()[:64].reshape(4, 16)
    with torch.no_grad():
        model(input_ids=x[rank * 2 : rank * 2 + 2], use_cache=False)
    out["value"] = float(taps.loss(groups.ddp))
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_aux")
    out = {}
    for family in ("olmoe", "qwen3_moe", "deepseek_v3"):
        out[family] = str(root / family)
        hf.tiny_random_model(family, out[family], seed=1, vocab_size=VOCAB)
    return out


@pytest.fixture(scope="module")
def runs(dirs):
    ranks = run_ranks(two_ranks, 2, dirs, timeout_s=300, collective_timeout_s=120)
    single = {}
    for family, coef in (("olmoe", 0.1), ("deepseek_v3", 0.1), ("olmoe-none", 0.0)):
        name = family.split("-")[0]
        model = _load(dirs, name)
        cfg = hf.FinetuneConfig(**{**CFG, "aux_loss_coef": coef, "adam_eps": EPS[name]})
        result = hf.finetune(model, _tokens(), cfg, progress=False, log=None)
        single[family] = {"losses": result.losses, "params": _trained(model)}
    return {"ranks": ranks, "single": single}


@pytest.mark.parametrize("family", ["olmoe", "qwen3_moe"])
def test_transformers_formula_is_the_models_own(dirs, family):
    model = hf.load_sharded(dirs[family], routing_placement=Placement(np.array(PLACEMENT), 2), max_devices=1)
    assert aux_formula(model) == "transformers"
    hf.trainable_parameters(model)
    model.train()
    taps = RouterTaps(model)
    x = torch.randint(3, VOCAB, (3, 10), generator=torch.Generator().manual_seed(1))
    out = model(input_ids=x, use_cache=False, output_router_logits=True)
    mine = taps.loss()
    gates = [b.gate.weight for _, b in hf.moe_blocks(model)]
    want_g = torch.autograd.grad(out.aux_loss, gates, retain_graph=True)
    got_g = torch.autograd.grad(mine, gates)
    assert float(mine) > 1.0  # E * sum(f * P) >= k for top-k counts; nonzero
    np.testing.assert_allclose(float(mine), float(out.aux_loss), rtol=mean_rtol(x.numel() * len(gates)))
    for g, w in zip(got_g, want_g):
        assert float(w.abs().max()) > 0
        # each entry a sum over the tokens and layers: near-zero ones are differences of terms of the largest's size
        atol = mean_rtol(x.numel() * len(gates)) * float(w.abs().max())
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=atol)
    taps.close()
    model(input_ids=x, use_cache=False)
    assert not taps.logits  # hooks removed


def test_switch_formula_for_deepseek(dirs):
    model = hf.load_sharded(dirs["deepseek_v3"])
    assert aux_formula(model) == "switch"
    model.train()
    taps = RouterTaps(model)
    seen = []
    for _, b in hf.moe_blocks(model):
        b.experts.router.register_forward_hook(  # sigmoid of the gate's fp32 logits, recomputed by hand
            lambda m, i, o: seen.append((torch.sigmoid(i[0].double() @ m.gate.weight.double().T), o[1]))
        )
    x = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    model(input_ids=x, use_cache=False)
    got = float(taps.loss())
    per_layer = []
    for scores, ids in seen:
        s = scores.detach().numpy().astype(np.float64)
        p = (s / s.sum(1, keepdims=True)).mean(0)
        f = np.bincount(ids.numpy().ravel(), minlength=16) / ids.numel()
        per_layer.append(16 * (f * p).sum())
    np.testing.assert_allclose(got, np.mean(per_layer), rtol=mean_rtol(x.numel() * len(per_layer)))


def test_two_ranks_equal_one_process(runs):
    single = runs["single"]
    for res in runs["ranks"]:
        for family in ("olmoe", "deepseek_v3"):
            got, want = res[family], single[family]
            np.testing.assert_allclose(got["losses"], want["losses"], rtol=RTOL, err_msg=family)
            for key, q in want["params"].items():
                err = np.abs(got["params"][key] - q).max() / np.abs(q).max()
                assert err <= RTOL, f"{family} {key}: {err:.2e}"
    gate = "model.layers.0.mlp.gate"
    a, b = single["olmoe"]["params"][gate], single["olmoe-none"]["params"][gate]
    assert np.abs(a - b).max() / np.abs(b).max() > 1e-3  # the loss did act on the routers


def test_value_is_the_global_batch(runs, dirs):
    model = _load(dirs, "olmoe")
    taps = RouterTaps(model)
    with torch.no_grad():
        model(input_ids=_tokens()[:64].reshape(4, 16), use_cache=False)
    want = float(taps.loss())
    for res in runs["ranks"]:
        np.testing.assert_allclose(res["value"], want, rtol=mean_rtol(64 * len(hf.moe_blocks(model))))


def test_setting_and_cli():
    from occult.cli import build_parser
    from occult.cli.lm import _train_config

    with pytest.raises(ValueError, match="aux_loss_coef"):
        hf.FinetuneConfig(aux_loss_coef=-1)
    assert hf.FinetuneConfig().aux_loss_coef == 0.0
    p = build_parser()
    assert p.parse_args(["finetune", "--hf", "d", "--out", "o"]).aux_loss_coef is None  # off for --hf
    assert p.parse_args(["finetune", "--hf", "d", "--out", "o", "--aux-loss-coef", "0.02"]).aux_loss_coef == 0.02
    assert (
        _train_config(p.parse_args(["finetune", "--init", "c", "--out", "o"])).aux_loss_coef == 0.01
    )  # OccultLM default


def test_taps_leave_the_layers_free_to_replay_and_layer_graphs_need_a_gpu(dirs):
    """`RouterTaps` taps the blocks, not hooks (a hooked layer never replays its CUDA graphs: `--layer-graphs`);
    one set of taps at a time; closed, the blocks are as before. `layer_graphs=True` is refused off a GPU
    before any step, the layers' settings left as they were."""
    from occult.integrations.hf.block import OccultMoeBlock
    from occult.moe.graphs import has_hooks
    from occult.moe.layer import OccultMoE

    model = _load(dirs, "olmoe")
    layers = [m for m in model.modules() if isinstance(m, OccultMoE)]
    taps = RouterTaps(model)
    assert layers and not any(has_hooks(layer, *layer._router_gate()) for layer in layers)
    with pytest.raises(ValueError, match="tapped already"):
        RouterTaps(model)
    ids = torch.randint(3, VOCAB, (2, 12))
    model(input_ids=ids)
    assert len(taps.logits) == len(taps.ids) == len(layers)
    for layer, ids_TK in zip(layers, taps.ids):
        assert ids_TK.shape[-1] == layer.top_k
    taps.close()
    assert all(b.routing_tap is None for b in model.modules() if isinstance(b, OccultMoeBlock))
    before = [layer.execution for layer in layers]
    cfg = hf.FinetuneConfig(**{**CFG, "layer_graphs": True})
    with pytest.raises(ValueError, match="on a GPU"):
        hf.finetune(model, _tokens(), cfg, progress=False, log=None)
    assert [layer.execution for layer in layers] == before
