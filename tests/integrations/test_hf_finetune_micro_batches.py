"""`hf.finetune` with `FinetuneConfig(micro_batches=K[, pair_micro_batches=True])` (`occult finetune --hf DIR
--micro-batches K [--pair-micro-batches]`): each step's rows as K micro-batches of a converted transformers model,
their gradients accumulated in turn or paired (combined 1F1B, `occult.training.accumulation`).

Two gloo ranks, OLMoE's experts sharded over both by a non-contiguous placement, pruned to one device per token:
15 steps equal one process's one-batch run on the same global batch (losses and weights within 1e-5, as
tests/integrations/test_hf_finetune.py): in turn, the routers by DDP, which reduces them once a step (`no_sync`
around the earlier micro-batches: as many buckets as the one-batch run's); paired, the routers synced after the
backward (no DDP), the later micro-batches' exchanges issued from the paired forward's thread. With the
load-balancing loss each micro-batch taps its own routing. Refused before any step: rows per rank that K does not
divide, with two_batch; paired with layer graphs or distillation; the same at the command line."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

import torch.distributed as dist  # noqa: E402
from _hf_helpers import CFG, PLACEMENT, finetune_tokens, tiny_olmoe, trained_weights  # noqa: E402

from occult.distributed import run_ranks  # noqa: E402
from occult.integrations import hf  # noqa: E402
from occult.moe import comm  # noqa: E402
from occult.placement import Placement  # noqa: E402
from occult.training import grads  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

RTOL = 1e-5


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory) -> str:
    return tiny_olmoe(tmp_path_factory.mktemp("hf_micro_batches"))


def _watched_finetune(model, cfg: hf.FinetuneConfig, groups) -> tuple[object, int, list[str]]:
    """`hf.finetune`, how many router buckets DDP reduced (a comm hook on its DDP, if any), and the thread that
    issued each exchange."""
    buckets, issuers = [0], []
    wrap_ddp, exchange = grads.wrap_ddp, comm._Exchange.forward

    def counted(state, bucket):  # (summed, as the hook wrap_ddp(summed=True) registers: the losses are scaled)
        buckets[0] += 1
        work = dist.all_reduce(bucket.buffer(), group=state, async_op=True)
        return work.get_future().then(lambda f: f.value()[0])

    def wrapped(*args, **kw):
        ddp = wrap_ddp(*args, **{**kw, "summed": False})  # (one hook a DDP: this one, counting)
        ddp.register_comm_hook(ddp.process_group, counted)
        return ddp

    def logged(ctx, *args):
        issuers.append(threading.current_thread().name)
        return exchange(ctx, *args)

    grads.wrap_ddp, comm._Exchange.forward = wrapped, staticmethod(logged)
    try:
        return hf.finetune(model, finetune_tokens(), cfg, groups, progress=False, log=None), buckets[0], issuers
    finally:
        grads.wrap_ddp, comm._Exchange.forward = wrap_ddp, staticmethod(exchange)


def _micro_batch_rank(rank: int, world_size: int, path: str) -> dict:
    groups = hf.setup_groups(2)
    placement = Placement(np.array(PLACEMENT), 2)
    out = {}
    for name, kw in (
        ("one", {}),
        ("turn", {"micro_batches": 2}),
        ("paired", {"micro_batches": 2, "pair_micro_batches": True}),
    ):
        model = hf.load_sharded(path, group=groups.ep, placement=placement, max_devices=1)
        result, buckets, issuers = _watched_finetune(model, hf.FinetuneConfig(**CFG, **kw), groups)
        out[name] = {
            "losses": result.losses,
            "params": trained_weights(model),
            "buckets": buckets,
            "paired_exchanges": sum(n == "occult-1f1b-forward" for n in issuers),
        }
    aux_model = hf.load_sharded(path, group=groups.ep, placement=placement, max_devices=1)
    aux_cfg = hf.FinetuneConfig(**CFG, micro_batches=2, pair_micro_batches=True, aux_loss_coef=0.01)
    out["aux_losses"] = _watched_finetune(aux_model, aux_cfg, groups)[0].losses
    out["layers"] = len(hf.moe_blocks(aux_model))
    return out


def test_accumulated_micro_batches_finetune_as_one_process(olmoe):
    reference = hf.load_sharded(olmoe, routing_placement=Placement(np.array(PLACEMENT), 2), max_devices=1)
    want = hf.finetune(reference, finetune_tokens(), hf.FinetuneConfig(**CFG), progress=False, log=None)
    want_params = trained_weights(reference)
    for rank, got in enumerate(run_ranks(_micro_batch_rank, 2, olmoe, timeout_s=300)):
        for name in ("turn", "paired"):
            run = got[name]
            np.testing.assert_allclose(run["losses"], want.losses, rtol=RTOL, err_msg=f"rank {rank} {name}")
            assert run["params"].keys() == want_params.keys()
            for key, q in want_params.items():
                err = np.abs(run["params"][key] - q).max() / np.abs(q).max()
                assert err <= RTOL, f"rank {rank} {name} {key}: max |diff| / max |weight| = {err:.2e}"
        assert got["turn"]["buckets"] == got["one"]["buckets"] > 0, (got["turn"]["buckets"], got["one"]["buckets"])
        assert got["paired"]["buckets"] == 0  # no DDP: the routers synced after the backward
        # steps x (the second micro-batch's forward) x layers x (dispatch, combine)
        assert got["paired"]["paired_exchanges"] == CFG["steps"] * got["layers"] * 2 > 0, got["paired"]
        assert got["turn"]["paired_exchanges"] == 0
        assert len(got["aux_losses"]) == CFG["steps"] and np.isfinite(got["aux_losses"]).all()


@pytest.mark.parametrize(
    "kw, needle",
    [
        ({"micro_batches": 3}, "multiple of 3 rows per rank"),
        ({"micro_batches": 2, "two_batch": True}, "choose one"),
        ({"micro_batches": 2, "pair_micro_batches": True, "layer_graphs": True}, "layer_graphs"),
        ({"micro_batches": 2, "pair_micro_batches": True, "distill_weight": 1.0}, "distillation"),
    ],
)
def test_refused_before_any_step(olmoe, kw, needle):
    model = hf.load_sharded(olmoe)
    with pytest.raises(ValueError, match=needle):
        hf.finetune(model, finetune_tokens(), hf.FinetuneConfig(**{**CFG, **kw}), progress=False, log=None)


def test_a_count_that_cannot_be_is_refused_by_the_config():
    for kw in ({"micro_batches": 0}, {"micro_batches": 1, "pair_micro_batches": True}):
        with pytest.raises(ValueError, match="micro_batches must be"):
            hf.FinetuneConfig(**CFG, **kw)


def test_cli_finetune_hf_micro_batches(olmoe, tmp_path, capsys):
    """`occult finetune --hf DIR --micro-batches 2 --pair-micro-batches` runs, and a batch K does not divide is
    refused before any work."""
    from occult.cli import main

    np.save(tmp_path / "ids.npy", finetune_tokens().numpy())
    argv = ["finetune", "--hf", olmoe, "--data", str(tmp_path / "ids.npy"), "--steps", "3", "--seq-len", "8"]
    flags = ["--micro-batches", "2", "--pair-micro-batches"]
    assert main([*argv, "--out", str(tmp_path / "run"), "--batch-size", "2", "--no-progress", *flags]) == 0
    assert "model" in os.listdir(tmp_path / "run")
    capsys.readouterr()
    assert main([*argv, "--out", str(tmp_path / "odd"), "--batch-size", "3", *flags]) != 0
    assert "multiple of 2 rows per rank" in capsys.readouterr().err
    assert not (tmp_path / "odd").exists()
