"""Dense parameters sharded with torch FSDP2 (`grad_sync="fsdp"`), CPU gloo ranks, fp32.

One spawn of 2 ranks (`ranks`) checks:
    grads    one step: the dense parameters are DTensor shards (half the rows on each rank), the
             experts plain; full gradients == one process on the global batch; the clipping norm
             (dense shards summed over the ranks, expert shards over the EP group) == torch's
             norm of the one-process gradients, and the clipped gradients match
    ep2/ep1  20 steps, experts sharded by a non-contiguous placement (EP 2) or replicated (EP 1),
             clipping that bites (grad_clip 0.05): == one process (losses, validation, weights)
    moe      MoE-only fine-tuning (routers the only trained dense parameters; attention frozen)
    resume   an FSDP run stopped at step 10 resumed with DDP, and a DDP run stopped at 10 resumed
             with FSDP (checkpoints cross over: same full weights) == 20 straight; the parent
             resumes the FSDP checkpoint in one process
    bf16     FSDP2 mixed precision: blocks compute with bf16 weights, master weights fp32, the
             losses stay near the fp32 ones
A second spawn of 4 ranks (EP 2 x 2 replicas, 6 steps) == one process; in it, `full_tensor` gathers uneven
and empty shards (torch.chunk sizes over 4 ranks).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from _train_helpers import PLACEMENT, RTOL, assert_matches, config, one_process, rel, run, train_config

from occult.distributed import run_ranks
from occult.lm.data import train_batch
from occult.lm.fsdp import full_tensor, is_sharded, local_tensor, wrap_fsdp
from occult.lm.model import OccultLM
from occult.lm.parallel import (
    clip_grad_norm,
    full_model,
    setup_parallel,
    shard_model,
    sync_gradients,
)
from occult.lm.train import TrainConfig, make_optimizer, train, trainable_names
from occult.placement import Placement

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

CLIP = 0.05  # below every step's gradient norm here: every step is clipped


def cfg(**kw) -> TrainConfig:
    return train_config(**{"grad_clip": CLIP, "grad_sync": "fsdp", **kw})


def _run(par, data, out, placement=None, seed=0, **kw) -> dict:
    return run(par, data, out, placement, seed, cfg=cfg, **kw)


def _one_step(par, data) -> dict:
    """Step 0 under FSDP: layout, full gradients after the sync, the clipping norm, clipped gradients."""
    torch.manual_seed(0)
    model = wrap_fsdp(shard_model(full_model(config(data), par), par, Placement.from_lists(PLACEMENT, 2)), par)
    opt = make_optimizer(model, trainable_names(model, False), cfg())
    layout = {n: (is_sharded(p), tuple(local_tensor(p).shape), tuple(p.shape)) for n, p in model.named_parameters()}
    x, y = train_batch(data.train, 4, 32, 0, 0, par.rank, par.world_size)
    out = model(x, y, return_logits=False)
    (out.loss + cfg().aux_loss_coef * out.aux_loss).backward()
    sync_gradients(model, par, replicated=False)
    grads = {n: full_tensor(p.grad).numpy().copy() for n, p in model.named_parameters()}
    norm = float(clip_grad_norm(model, par, CLIP))
    clipped = {n: full_tensor(p.grad).numpy().copy() for n, p in model.named_parameters()}
    ids = {n: i.numpy().copy() for n, (_, i) in model.expert_parameters().items()}
    # AdamW's foreach kernels (the default on CUDA) refuse lists mixing DTensors and tensors: the
    # groups must not mix them (forced on here, where CPU would default to the per-tensor loop)
    kinds = [sorted({is_sharded(p) for p in g["params"]}) for g in opt.param_groups]
    for g in opt.param_groups:
        g["foreach"] = True
    opt.step()
    return {"layout": layout, "grads": grads, "norm": norm, "clipped": clipped, "ids": ids, "group_kinds": kinds}


def _signatures_around_an_evaluation(par, data) -> tuple:
    """A recorded step's model signature after a training step, after an evaluation forward (FSDP2 keeps the root's
    and the last block's weights gathered then), and after `reshard`: a step recorded before the evaluation must
    match after it, or it is recorded again (and would have read the gathered weights the evaluation made)."""
    from occult.lm.fsdp import reshard
    from occult.training.signature import ModelSignature, model_signature

    torch.manual_seed(0)
    model = wrap_fsdp(shard_model(full_model(config(data), par), par, Placement.from_lists(PLACEMENT, 2)), par)
    x, y = train_batch(data.train, 4, 32, 0, 0, par.rank, par.world_size)
    model(x, y, return_logits=False).loss.backward()
    cached = ModelSignature(model)  # the cached signature must say what the full one says at every point
    trained = model_signature(model)
    assert cached() == trained
    model.eval()
    with torch.no_grad():
        model(x, y, return_logits=False)
    model.train()
    evaluated = model_signature(model)
    assert cached() == evaluated
    reshard(model)
    resharded = model_signature(model)
    assert cached() == resharded
    return trained == evaluated, trained == resharded


def _gathered_after_forward(par, data, reshard_after_forward: bool, units: str = "block") -> list[bool]:
    """Per block, whether its dense weights are still gathered (plain tensors, not DTensor shards) between the
    forward and the backward, under `wrap_fsdp(..., reshard_after_forward, units)`; every unit resharded after it."""
    from torch.distributed.fsdp import FSDPModule

    torch.manual_seed(0)
    model = shard_model(full_model(config(data), par), par, Placement.from_lists(PLACEMENT, 2))
    wrap_fsdp(model, par, reshard_after_forward=reshard_after_forward, units=units)
    wrapped = [isinstance(block, FSDPModule) for block in model.blocks]
    assert wrapped == [units == "block"] * len(model.blocks), wrapped
    x, y = train_batch(data.train, 4, 32, 0, 0, par.rank, par.world_size)
    out = model(x, y, return_logits=False)
    gathered = [not is_sharded(block.attn.qkv.weight) for block in model.blocks]
    out.loss.backward()
    assert all(is_sharded(block.attn.qkv.weight) for block in model.blocks), "a unit kept its weights after backward"
    return gathered


def fsdp_worker(rank: int, world_size: int, data, root: str) -> dict:
    root_p = Path(root)
    par = setup_parallel()
    p2 = Placement.from_lists(PLACEMENT, 2)
    out = {"grads": _one_step(par, data), "signatures": _signatures_around_an_evaluation(par, data)}
    out["gathered"] = {free: _gathered_after_forward(par, data, free) for free in (False, True)}
    out["gathered"]["model"] = _gathered_after_forward(par, data, False, "model")
    out["ep2"] = _run(par, data, root_p / "ep2", p2)
    out["ep2_free"] = _run(par, data, root_p / "ep2free", p2, config=dict(fsdp_reshard="after-forward"))
    out["ep2_model"] = _run(par, data, root_p / "ep2model", p2, config=dict(fsdp_units="model"))
    out["moe"] = _run(par, data, root_p / "moe", p2, config=dict(moe_only=True, steps=10, eval_every=5, save_every=0))
    for first, then in (("fsdp", "ddp"), ("ddp", "fsdp")):
        _run(par, data, root_p / f"stop-{first}", p2, stop_after=10, config=dict(grad_sync=first))
        if rank == 0 and first == "fsdp":
            shutil.copytree(root_p / "stop-fsdp", root_p / "stop1")
        par.barrier()
        out[f"{first}->{then}"] = _run(
            par, data, root_p / f"stop-{first}", p2, seed=9, resume=True, config=dict(grad_sync=then)
        )
    out["bf16"] = _bf16(par, data, root_p / "bf16")
    dp = setup_parallel(ep_size=1)
    out["ep1"] = _run(dp, data, root_p / "ep1")
    return out


def _bf16(par, data, out) -> dict:
    """5 steps with --precision bf16: the dtype a block's attention computes with, and the losses."""
    torch.manual_seed(0)
    model = shard_model(full_model(config(data), par), par)
    seen = []
    model.blocks[0].attn.qkv.register_forward_pre_hook(lambda m, a: seen.append(m.weight.dtype))
    c = cfg(steps=5, eval_every=0, save_every=0, precision="bf16")
    result = train(model, data, c, out, parallel=par, progress=False, log=None, plot=False)
    return {
        "losses": result.train_losses,
        "compute": sorted({str(d) for d in seen}),
        "master": sorted({str(p.dtype) for p in model.parameters()}),
    }


def four_rank_worker(rank: int, world_size: int, data, root: str) -> dict:
    par = setup_parallel(ep_size=2)
    out = _run(par, data, Path(root) / "ep2x2", config=dict(steps=6, eval_every=3, save_every=0))
    return {"run": out, "gathered": _gather_uneven(rank, world_size)}  # the same spawn: no second start-up


@pytest.fixture(scope="module")
def ranks(data, tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    ranks = run_ranks(fsdp_worker, 2, data, str(root), timeout_s=300)
    single = {}
    for name, kw in (
        ("full", {}),
        ("moe", dict(moe_only=True, steps=10, eval_every=5, save_every=0)),
        ("six", dict(steps=6, eval_every=3, save_every=0)),
        ("fp32", dict(steps=5, eval_every=0, save_every=0)),
    ):
        single[name] = one_process(data, cfg(**kw), root / f"single-{name}", plot=False)
    single["stop1"] = one_process(data, cfg(), root / "stop1", seed=5, resume=True)
    return {"root": root, "ranks": ranks, "single": single}


def test_one_step_sharding_gradients_and_clipping_norm(ranks, data):
    torch.manual_seed(0)
    ref = OccultLM(config(data))
    x, y = train_batch(data.train, 4, 32, 0, 0)
    out = ref(x, y, return_logits=False)
    (out.loss + cfg().aux_loss_coef * out.aux_loss).backward()
    want = {n: p.grad.numpy().copy() for n, p in ref.named_parameters()}
    norm = float(torch.nn.utils.clip_grad_norm_(list(ref.parameters()), CLIP))
    assert norm > 2 * CLIP  # the clip bites
    clipped = {n: p.grad.numpy().copy() for n, p in ref.named_parameters()}
    experts = set(ranks["ranks"][0]["grads"]["ids"])
    for got in ranks["ranks"]:
        g = got["grads"]
        for name, (sharded, local, full) in g["layout"].items():
            assert sharded == (name not in experts), name
            if sharded:  # dim 0 split in two (every dense tensor here has an even dim 0)
                assert local == (full[0] // 2, *full[1:]), name
        assert np.isclose(g["norm"], norm, rtol=1e-5), (g["norm"], norm)
        assert all(len(k) == 1 for k in g["group_kinds"]) and len(g["group_kinds"]) >= 3, g["group_kinds"]
        for grads, ref_grads in ((g["grads"], want), (g["clipped"], clipped)):
            assert set(grads) == set(ref_grads)
            for name, grad in grads.items():
                q = ref_grads[name][g["ids"][name]] if name in g["ids"] else ref_grads[name]
                assert rel(grad, q) <= 1e-5, f"{name}: {rel(grad, q):.2e}"


def test_blocks_keep_their_gathered_weights_to_the_backward_unless_told_to_free_them(ranks):
    """The default keeps every block's gathered dense weights from its forward to its backward (no second
    all-gather); `reshard_after_forward` (`--fsdp-reshard after-forward`) frees all but the last block's after the
    forward; `units="model"` (`--fsdp-units model`) wraps no block, the root's unit holding and keeping every one's.
    Either way every unit is resharded after the backward, and trains as one process (above)."""
    layers = len(ranks["ranks"][0]["gathered"][False])
    assert layers >= 2
    for out in ranks["ranks"]:
        assert out["gathered"][False] == [True] * layers
        assert out["gathered"][True] == [False] * (layers - 1) + [True]
        assert out["gathered"]["model"] == [True] * layers  # `--fsdp-units model`: the root's unit holds them all


def test_an_evaluation_then_reshard_leaves_a_recorded_steps_signature(ranks):
    # an evaluation leaves gathered weights (the signature differs), `reshard` frees every unit's (it is back)
    assert [r["signatures"] for r in ranks["ranks"]] == [(False, True)] * 2


def test_fsdp_equals_one_process(ranks):
    """2 ranks, EP 2 (non-contiguous placement) and EP 1 (pure DP), 20 clipped steps; MoE-only 10 steps."""
    single = ranks["single"]
    for rank, out in enumerate(ranks["ranks"]):
        assert sorted(out["ep2"]["ids"]["blocks.0.moe.moe.gate_up_proj"]) == [
            i for i, d in enumerate(PLACEMENT[0]) if d == rank
        ]
        assert len(out["ep1"]["ids"]["blocks.0.moe.moe.gate_up_proj"]) == 8
        assert_matches(out["ep2"], single["full"], RTOL)
        assert_matches(out["ep2_free"], single["full"], RTOL)
        assert_matches(out["ep2_model"], single["full"], RTOL)
        assert_matches(out["ep1"], single["full"], RTOL)
        assert_matches(out["moe"], single["moe"], RTOL, steps=10)
        assert np.array_equal(
            out["moe"]["params"]["blocks.0.attn.qkv.weight"],
            ranks["single"]["moe"]["params"]["blocks.0.attn.qkv.weight"],
        )  # frozen, untouched


def test_checkpoints_cross_between_fsdp_and_ddp(ranks):
    """Stopped at 10 under one mode, resumed under the other (and in one process) == 20 straight."""
    for out in ranks["ranks"]:
        assert_matches(out["fsdp->ddp"], out["ep2"], RTOL)
        assert_matches(out["ddp->fsdp"], out["ep2"], RTOL)
    assert_matches(ranks["single"]["stop1"], ranks["single"]["full"], RTOL)


def test_bf16_mixed_precision(ranks):
    fp32 = ranks["single"]["fp32"]["losses"]
    for out in ranks["ranks"]:
        b = out["bf16"]
        assert b["compute"] == ["torch.bfloat16"] and b["master"] == ["torch.float32"]
        assert len(b["losses"]) == 5 and np.all(np.isfinite(b["losses"]))
        np.testing.assert_allclose(b["losses"], fp32, rtol=3e-2)
        assert b["losses"] != fp32  # bf16 did round


def test_four_ranks_ep2_by_2_replicas_and_uneven_shards_gathered(ranks, data, tmp_path):
    got = run_ranks(four_rank_worker, 4, data, str(tmp_path), timeout_s=240)
    for out in got:
        assert_matches(out["run"], ranks["single"]["six"], RTOL, steps=6)
        # `full_tensor` of torch.chunk sizes over 4 ranks: 2/2/2/1 and 1/1/0/0 rows, 2/2/2/1 columns (a shard
        # on dim 1), 2/2/2/0 elements; one plain all-gather each
        assert out["gathered"] == [True] * 4


def test_grad_sync_fsdp_setting_and_cli():
    from occult.cli import build_parser
    from occult.cli.lm import _train_config

    assert TrainConfig(grad_sync="fsdp").grad_sync == "fsdp"
    with pytest.raises(ValueError, match="grad_sync"):
        TrainConfig(grad_sync="zero3")
    args = build_parser().parse_args(["train", "--out", "x", "--grad-sync", "fsdp"])
    assert _train_config(args).grad_sync == "fsdp" and _train_config(args).fsdp_reshard == "after-backward"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--out", "x", "--grad-sync", "zero3"])
    with pytest.raises(ValueError, match="fsdp_reshard"):
        TrainConfig(fsdp_reshard="never")
    args = build_parser().parse_args(["train", "--out", "x", "--grad-sync", "fsdp", "--fsdp-reshard", "after-forward"])
    assert _train_config(args).fsdp_reshard == "after-forward"
    assert _train_config(args).fsdp_units == "block"
    args = build_parser().parse_args(["train", "--out", "x", "--grad-sync", "fsdp", "--fsdp-units", "model"])
    assert _train_config(args).fsdp_units == "model"
    with pytest.raises(ValueError, match="fsdp_units"):
        TrainConfig(fsdp_units="layer")
    with pytest.raises(ValueError, match="fsdp_units='block'"):
        TrainConfig(grad_sync="fsdp", fsdp_units="model", fsdp_reshard="after-forward")
    with pytest.raises(ValueError, match="units"):
        wrap_fsdp(None, None, units="layer")  # refused before it touches the model


def _gather_uneven(rank: int, world_size: int) -> list:
    """Uneven and empty FSDP-style shards (torch.chunk sizes) gathered whole by `full_tensor`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    out = []
    for shape, dim in (((7, 5), 0), ((2, 5), 0), ((4, 7), 1), ((6,), 0)):
        full = torch.arange(float(np.prod(shape))).reshape(shape)
        d = distribute_tensor(full, mesh, [Shard(dim)])
        out.append(bool(torch.equal(full_tensor(d), full)))
    return out
