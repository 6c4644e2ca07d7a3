"""Replicated gradients through torch DDP (`grad_sync="ddp"`, the default on N ranks), 2 CPU gloo ranks.

One spawn of 2 ranks (`ranks`) checks:
    grads    one step's gradients: DDP wrapper + expert-only sync == one process on the global
             batch; the same forward without the wrapper leaves the replicated gradients
             un-averaged (so DDP, not a fallback, did the work); DDP left the rank-local buffers
             (`local_expert_ids`) alone and saw only replicated parameters
    ep2/ep1  20 steps with DDP, with the explicit all-reduce and with it in buckets during the backward
             ("overlap"), experts sharded (EP 2) or replicated (EP 1, pure data parallel): all three equal
             (bit for bit) and == one process
    moe      MoE-only fine-tuning (routers are the only replicated trained parameters), DDP == explicit
    resume   a DDP run stopped at step 10, resumed with the explicit all-reduce (grad_sync may
             change on resume) == 20 straight; the parent resumes the DDP checkpoint in one process
tests/lm/test_parallel.py (every run there uses the default, DDP) and tests/lm/test_replace.py
(migrations during DDP training == one process) cover the rest.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from _train_helpers import PLACEMENT, RTOL, assert_matches, config, one_process, rel, run
from _train_helpers import train_config as cfg
from torch.nn.parallel import DistributedDataParallel

from occult.distributed import run_ranks
from occult.lm.data import train_batch
from occult.lm.model import OccultLM
from occult.lm.parallel import (
    full_model,
    setup_parallel,
    shard_model,
    sync_gradients,
    wrap_ddp,
)
from occult.lm.train import TrainConfig, make_optimizer, trainable_names
from occult.placement import Placement

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

CLOSE = 0.0  # DDP against the explicit all-reduce on 2 ranks: bit for bit (x/2 is exact, a + b commutes)


def _grads(model: OccultLM) -> dict[str, np.ndarray]:
    return {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters() if p.grad is not None}


def _one_step(par, data, use_ddp: bool) -> dict:
    """Gradients of step 0 on this rank's rows (aux loss included), after the expert-only sync."""
    torch.manual_seed(0)
    model = shard_model(full_model(config(data), par), par, Placement.from_lists(PLACEMENT, 2))
    make_optimizer(model, trainable_names(model, False), cfg())
    ids = [m.local_expert_ids.clone() for m in model.moe_layers()]
    forward, info = model, {}
    if use_ddp:
        forward = wrap_ddp(model, par)
        assert isinstance(forward, DistributedDataParallel)
        ddp_params = {id(p) for p in forward._module_parameters}  # what DDP reduces
        info["ddp_names"] = sorted(n for n, p in model.named_parameters() if id(p) in ddp_params)
        info["ignored"] = sorted(forward.parameters_to_ignore)
        info["expected_ignored"] = sorted([*model.expert_parameters(), *(n for n, _ in model.named_buffers())])
        info["buffers_kept"] = all(torch.equal(a, m.local_expert_ids) for a, m in zip(ids, model.moe_layers()))
    x, y = train_batch(data.train, 4, 32, 0, 0, par.rank, par.world_size)
    out = forward(x, y, return_logits=False)
    (out.loss + cfg().aux_loss_coef * out.aux_loss).backward()
    sync_gradients(model, par, replicated=False)
    return {
        "grads": _grads(model),
        "ids": {n: i.numpy().copy() for n, (_, i) in model.expert_parameters().items()},
        **info,
    }


def ddp_worker(rank: int, world_size: int, data, root: str) -> dict:
    root_p = Path(root)
    par = setup_parallel()
    p2 = Placement.from_lists(PLACEMENT, 2)
    out = {"grads": _one_step(par, data, True), "plain": _one_step(par, data, False)}
    for sync in ("ddp", "explicit", "overlap"):
        out[f"ep2-{sync}"] = run(par, data, root_p / f"ep2-{sync}", p2, config=dict(grad_sync=sync))
        out[f"moe-{sync}"] = run(
            par,
            data,
            root_p / f"moe-{sync}",
            p2,
            config=dict(grad_sync=sync, moe_only=True, steps=10, eval_every=5, save_every=0),
        )
    run(par, data, root_p / "stop", p2, stop_after=10)
    if rank == 0:
        shutil.copytree(root_p / "stop", root_p / "stop1")
    par.barrier()
    out["resumed"] = run(par, data, root_p / "stop", p2, seed=9, resume=True, config=dict(grad_sync="explicit"))
    dp = setup_parallel(ep_size=1)
    for sync in ("ddp", "explicit", "overlap"):
        out[f"ep1-{sync}"] = run(dp, data, root_p / f"ep1-{sync}", config=dict(grad_sync=sync))
    return out


@pytest.fixture(scope="module")
def ranks(data, tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    ranks = run_ranks(ddp_worker, 2, data, str(root), timeout_s=240)
    single = {}
    for name, kw in (("full", {}), ("moe", dict(moe_only=True, steps=10, eval_every=5, save_every=0))):
        single[name] = one_process(data, cfg(**kw), root / f"single-{name}")
    single["stop1"] = one_process(data, cfg(), root / "stop1", seed=5, resume=True)
    return {"root": root, "ranks": ranks, "single": single}


def test_one_step_gradients_are_those_of_the_global_batch(ranks, data):
    torch.manual_seed(0)
    ref = OccultLM(config(data))
    x, y = train_batch(data.train, 4, 32, 0, 0)
    out = ref(x, y, return_logits=False)
    (out.loss + cfg().aux_loss_coef * out.aux_loss).backward()
    want = _grads(ref)
    replicated = [n for n in want if n not in ranks["ranks"][0]["grads"]["ids"]]
    assert replicated and len(replicated) < len(want)
    for got in ranks["ranks"]:
        g = got["grads"]
        assert g["ignored"] == g["expected_ignored"]  # DDP may broadcast no buffer: each rank has its own
        assert g["buffers_kept"] and any("local_expert_ids" in n for n in g["ignored"])  # rank 1 kept its own
        assert g["ddp_names"] == sorted(replicated)  # experts ignored, every replicated parameter reduced
        assert set(g["grads"]) == set(want)
        for name, grad in g["grads"].items():
            q = want[name][g["ids"][name]] if name in g["ids"] else want[name]
            assert rel(grad, q) <= 1e-5, f"{name}: {rel(grad, q):.2e}"
        # Without the wrapper (expert-only sync) the replicated gradients are this rank's alone.
        assert max(rel(got["plain"]["grads"][n], want[n]) for n in replicated) > 1e-2


def test_ddp_equals_explicit_and_one_process(ranks):
    """2 ranks, EP 2 (non-contiguous placement) and EP 1 (pure DP), 20 steps; MoE-only 10 steps; the explicit
    all-reduce in buckets during the backward (`grad_sync="overlap"`) too."""
    single = ranks["single"]
    for rank, out in enumerate(ranks["ranks"]):
        assert sorted(out["ep2-ddp"]["ids"]["blocks.0.moe.moe.gate_up_proj"]) == [
            i for i, d in enumerate(PLACEMENT[0]) if d == rank
        ]
        assert len(out["ep1-ddp"]["ids"]["blocks.0.moe.moe.gate_up_proj"]) == 8
        for layout in ("ep2", "ep1"):
            assert_matches(out[f"{layout}-ddp"], single["full"], RTOL)
            assert_matches(out[f"{layout}-ddp"], out[f"{layout}-explicit"], CLOSE)
            assert_matches(out[f"{layout}-overlap"], out[f"{layout}-explicit"], CLOSE)
        assert_matches(out["moe-ddp"], single["moe"], RTOL, steps=10)
        assert_matches(out["moe-ddp"], out["moe-explicit"], CLOSE, steps=10)
        assert_matches(out["moe-overlap"], out["moe-explicit"], CLOSE, steps=10)
        frozen = "blocks.0.attn.qkv.weight"
        if frozen in out["moe-ddp"]["params"]:
            assert np.array_equal(out["moe-ddp"]["params"][frozen], out["moe-explicit"]["params"][frozen])


def test_resume_a_ddp_checkpoint(ranks):
    """Stopped at 10 under DDP: resumed on 2 ranks with the explicit all-reduce, and in one process."""
    for out in ranks["ranks"]:
        assert_matches(out["resumed"], out["ep2-ddp"], CLOSE)
    assert_matches(ranks["single"]["stop1"], ranks["single"]["full"], RTOL)


def test_grad_sync_setting_and_cli():
    from occult.cli import build_parser

    with pytest.raises(ValueError, match="grad_sync"):
        TrainConfig(grad_sync="zero3")
    assert TrainConfig().grad_sync == "ddp" and "grad_sync" in TrainConfig.LOGGING_FIELDS
    from occult.cli.lm import _train_config

    args = build_parser().parse_args(["train", "--out", "x", "--grad-sync", "explicit"])
    assert _train_config(args).grad_sync == "explicit"
    args = build_parser().parse_args(["train", "--out", "x", "--grad-sync", "overlap"])
    assert _train_config(args).grad_sync == "overlap"
    assert _train_config(build_parser().parse_args(["train", "--out", "x"])).grad_sync == "ddp"


def test_ddp_buffer_switch_follows_the_installed_torch(monkeypatch):
    """torch 2.13 calls it `forward_sync_buffers`, the GPU image's torch 2.11 `broadcast_buffers`
    (passing the new name there failed every multi-rank `occult train` on GPUs)."""
    import occult.training.grads as grads

    assert grads.no_buffer_sync() in ({"forward_sync_buffers": False}, {"broadcast_buffers": False})

    class OldDDP:
        def __init__(
            self,
            module,
            device_ids=None,
            broadcast_buffers=True,
            init_sync=True,
            process_group=None,
            gradient_as_bucket_view=False,
        ):
            pass

    monkeypatch.setattr(grads, "DistributedDataParallel", OldDDP)
    assert grads.no_buffer_sync() == {"broadcast_buffers": False}
