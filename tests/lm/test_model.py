"""OccultLM: shapes, causality, MoE blocks vs the dense reference, routing limits, weights I/O."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from occult.distributed import run_ranks
from occult.lm.checkpoint import CheckpointError, load_model, save_model
from occult.lm.model import ModelConfig, OccultLM
from occult.moe.pruning import PruningError, devices_per_token, expert_similarity
from occult.placement import Placement

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


CFG = dict(
    vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_experts=8, top_k=2, expert_ffn_size=16, max_seq_len=24
)


def tiny(seed: int = 0, **kw) -> OccultLM:
    torch.manual_seed(seed)
    return OccultLM(ModelConfig(**{**CFG, **kw}))


def virtual_placement(seed: int = 0, layers: int = 2, experts: int = 8, devices: int = 4) -> Placement:
    rng = np.random.default_rng(seed)
    return Placement(np.stack([rng.permutation(np.arange(experts) % devices) for _ in range(layers)]), devices)


def test_config_validation():
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(**{**CFG, "num_heads": 5})
    with pytest.raises(ValueError, match="top_k"):
        ModelConfig(**{**CFG, "top_k": 9})
    with pytest.raises(ValueError, match="positive integer"):
        ModelConfig(**{**CFG, "num_layers": 0})
    with pytest.raises(ValueError, match="unknown ModelConfig"):
        ModelConfig.from_dict({**CFG, "dropout": 0.1})
    assert ModelConfig.from_dict(ModelConfig(**CFG).to_dict()) == ModelConfig(**CFG)


def test_forward_shapes_loss_and_aux():
    model = tiny()
    x = torch.randint(0, 97, (3, 24))
    out = model(x, torch.randint(0, 97, (3, 24)))
    assert out.logits.shape == (3, 24, 97)
    assert abs(float(out.loss.detach()) - math.log(97)) < 0.3  # near-uniform at init
    assert 0.9 < float(out.aux_loss.detach()) < 2.0  # 1.0 = perfectly balanced
    out.aux_loss.backward()
    assert all(r.gate.weight.grad.abs().sum() > 0 for r in model.routers())
    assert model(x).loss is None
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 25, dtype=torch.long))
    assert model.num_parameters(active=True) < model.num_parameters()
    names = model.moe_parameter_names()
    assert names and all(".moe.moe." in n for n in names)
    assert {n.rsplit(".", 1)[-1] for n in names} == {"weight", "gate_up_proj", "down_proj"}
    assert model.lm_head.weight is model.embed.weight


def test_aux_loss_and_observers_see_the_layers_routing_without_hooks():
    """The aux loss and the routing observers read the layer's routing made again beside it, not through hooks
    (a replayed layer call runs none): the same ids as the layer's router, the aux loss of the dense formula,
    its gradient into the gate; and no hook on the layer keeps it from replaying (`--layer-graphs`)."""
    from occult.moe.graphs import has_hooks

    model = tiny(seed=int(torch.randint(0, 2**31 - 1, ())))
    block = model.blocks[0].moe
    assert not has_hooks(block.moe, *block.moe._router_gate())
    x = torch.randn(3, 24, CFG["hidden_size"], requires_grad=True)
    seen = []
    with model.observe_routing(lambda layer, logits, w, ids: seen.append((layer, logits, w, ids))):
        y, aux = block(x)
    router = block.moe.router
    weights_ref, ids_ref = router(x.reshape(-1, CFG["hidden_size"]))
    [(layer, logits, weights, ids)] = seen
    assert layer == 0 and torch.equal(ids, ids_ref) and torch.equal(weights, weights_ref.detach())
    gate_W = router.gate.weight.detach().clone().requires_grad_(True)
    logits_ref = x.detach().reshape(-1, CFG["hidden_size"]) @ gate_W.T
    E = CFG["num_experts"]
    share_E = torch.bincount(ids_ref.reshape(-1), minlength=E).float() / ids_ref.numel()
    aux_ref = E * (share_E * torch.softmax(logits_ref, dim=-1).mean(0)).sum()
    torch.testing.assert_close(logits, logits_ref.detach())
    torch.testing.assert_close(aux, aux_ref.detach())
    aux.backward()
    aux_ref.backward()
    torch.testing.assert_close(router.gate.weight.grad, gate_W.grad)
    assert block.moe.gate_up_proj.grad is None  # the aux loss reaches the gate only


def test_causal():
    model = tiny()
    x = torch.randint(0, 97, (2, 20))
    y = x.clone()
    y[:, 12:] = (y[:, 12:] + 1) % 97
    a, b = model(x).logits, model(y).logits
    assert torch.allclose(a[:, :12], b[:, :12], atol=1e-5)
    assert not torch.allclose(a[:, 12:], b[:, 12:], atol=1e-3)


def test_moe_blocks_match_dense_reference():
    model = tiny().double()
    x = torch.randn(40, 32, dtype=torch.float64)
    for moe in model.moe_layers():
        dense = moe.to_dense()
        assert torch.allclose(moe(x), dense(x), atol=1e-10)


def test_virtual_device_limit_and_unchanged_when_not_binding():
    model = tiny()
    x = torch.randint(0, 97, (4, 24))
    base = model(x).logits
    placement = virtual_placement()
    seen = []
    model.set_routing(max_devices=1, placement=placement)
    with model.observe_routing(lambda l, lg, w, ids: seen.append((l, ids))):
        pruned = model(x).logits
    assert len(seen) == 2
    for layer, ids in seen:
        dev = torch.as_tensor(placement.expert_device(layer).copy())
        assert int(devices_per_token(ids, dev).max()) == 1
    assert not torch.allclose(pruned, base)
    model.set_routing(max_devices=4, placement=placement)  # >= devices any token can use
    assert torch.equal(model(x).logits, base)
    sims = [expert_similarity(torch.randn(64, 8)) for _ in range(2)]
    model.set_routing(max_devices=2, placement=placement, method="similarity", similarity=sims)
    assert "similarity" in model.routing.describe()
    model.set_routing(None)
    assert torch.equal(model(x).logits, base)
    with pytest.raises(PruningError, match="similarity"):
        model.set_routing(max_devices=2, placement=placement, method="similarity")
    with pytest.raises(PruningError, match="3 layers"):
        model.set_routing(max_devices=2, placement=virtual_placement(layers=3))


def test_a_model_whose_weights_are_copied_in_next_skips_the_random_init(tmp_path, monkeypatch):
    """`OccultLM(init_weights=False)` runs neither `reset_parameters` nor the experts' init (a shard, a checkpoint:
    every weight is copied in next); `load_model` builds it so, the same weights as the saved model, and leaves the
    caller's RNG where it was (the dense layers' constructors draw inside a forked RNG)."""
    model = tiny(seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    path = tmp_path / "m.safetensors"
    save_model(path, model)
    calls, draws = [], []
    monkeypatch.setattr(OccultLM, "reset_parameters", lambda self: calls.append(self))
    real_normal = torch.nn.init.normal_
    monkeypatch.setattr(
        torch.nn.init, "normal_", lambda t, *a, **kw: (draws.append(t.shape), real_normal(t, *a, **kw))[1]
    )
    OccultLM(ModelConfig(**CFG), init_weights=False)
    assert not calls and not [s for s in draws if len(s) == 3], draws  # no expert tensor [E, ., .] drawn
    OccultLM(ModelConfig(**CFG))
    assert len(calls) == 1
    monkeypatch.undo()
    before = torch.random.get_rng_state()
    back = load_model(path)
    assert torch.equal(torch.random.get_rng_state(), before)
    for (name, a), (_, b) in zip(model.named_parameters(), back.named_parameters()):
        assert torch.equal(a, b), name


def test_save_load_round_trip_and_errors(tmp_path):
    model = tiny()
    sims = [expert_similarity(torch.randn(64, 8)) for _ in range(2)]
    placement = virtual_placement()
    model.set_routing(max_devices=2, placement=placement, method="similarity", similarity=sims)
    path = tmp_path / "m.safetensors"
    save_model(path, model, {"note": "x"})
    back = load_model(path)
    x = torch.randint(0, 97, (2, 24))
    assert torch.equal(back(x).logits, model(x).logits)
    assert back.routing.max_devices == 2 and back.routing.method == "similarity"
    assert back.routing.placement == placement
    assert all(torch.equal(a, b) for a, b in zip(back.routing.similarity, sims))
    plain = load_model(path, routing=False)
    assert plain.routing.max_devices is None
    blob = path.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupted"):
        load_model(tmp_path / "cut.safetensors")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "none.safetensors")
    import safetensors.torch

    safetensors.torch.save_file({"a": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(CheckpointError, match="not an occult model checkpoint"):
        load_model(tmp_path / "other.safetensors")
    other = tiny(hidden_size=64)
    from occult.lm.checkpoint import load_weights, model_tensors

    with pytest.raises(CheckpointError, match="shape"):
        load_weights(other, model_tensors(model))
    t = model_tensors(model)
    del t["model.norm.weight"]
    with pytest.raises(CheckpointError, match="missing"):
        load_weights(tiny(), t)


def _ep_case(rank: int, world_size: int, state: dict, x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    torch.manual_seed(0)
    placement = Placement.contiguous(8, world_size, 2)
    model = OccultLM(ModelConfig(**CFG), placement=placement, group=dist.group.WORLD)
    with torch.no_grad():
        for name, p in model.named_parameters():
            full = state[name]
            if name.endswith(("gate_up_proj", "down_proj")):
                layer = int(name.split(".")[1])
                full = placement.shard(full, rank, layer=layer)
            p.copy_(full)
    return model(x[rank : rank + 1]).logits.detach().numpy()


def test_expert_parallel_model_matches_single_process():
    model = tiny()
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.randint(0, 97, (2, 24))
    want = model(x).logits
    got = run_ranks(_ep_case, 2, state, x)
    for r in range(2):
        assert np.allclose(got[r], want[r : r + 1].detach().numpy(), atol=1e-5)
