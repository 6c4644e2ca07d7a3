"""`hf.finetune` with `FinetuneConfig(two_batch=True)` (`occult finetune --hf DIR --two-batch`): each step's loss
and backward as two interleaved micro-batches of a converted transformers model.

Two gloo ranks, OLMoE's experts sharded over both by a non-contiguous placement, pruned to one device per token:
15 steps equal one process's one-batch run on the same global batch (losses and weights within 1e-5, as
tests/integrations/test_hf_finetune.py), every step through the halves, the routers synced after the backward
(no DDP: its hooks expect one forward per backward). With the load-balancing loss each half taps its own routing
(`RouterTaps` keeps a thread's taps apart: both halves' in one list was an error). Refused before any step:
layer graphs, distillation, an odd number of rows per rank."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

from _hf_helpers import CFG, PLACEMENT, finetune_tokens, tiny_olmoe, trained_weights  # noqa: E402

from occult.distributed import run_ranks  # noqa: E402
from occult.integrations import hf  # noqa: E402
from occult.placement import Placement  # noqa: E402
from occult.training import loop  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

RTOL = 1e-5


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory) -> str:
    return tiny_olmoe(tmp_path_factory.mktemp("hf_two_batch"))


def _counted_finetune(model, cfg: hf.FinetuneConfig, groups) -> tuple[object, int]:
    """`hf.finetune`, and how many times the loop ran two halves."""
    calls, forward_halves = [0], loop.forward_halves

    def counted(*args, **kw):
        calls[0] += 1
        return forward_halves(*args, **kw)

    loop.forward_halves = counted
    try:
        return hf.finetune(model, finetune_tokens(), cfg, groups, progress=False, log=None), calls[0]
    finally:
        loop.forward_halves = forward_halves


def _two_batch_rank(rank: int, world_size: int, path: str) -> dict:
    groups = hf.setup_groups(2)
    placement = Placement(np.array(PLACEMENT), 2)
    model = hf.load_sharded(path, group=groups.ep, placement=placement, max_devices=1)
    result, halves = _counted_finetune(model, hf.FinetuneConfig(**CFG, two_batch=True), groups)
    aux_model = hf.load_sharded(path, group=groups.ep, placement=placement, max_devices=1)
    aux, _ = _counted_finetune(aux_model, hf.FinetuneConfig(**CFG, two_batch=True, aux_loss_coef=0.01), groups)
    return {"losses": result.losses, "params": trained_weights(model), "halves": halves, "aux_losses": aux.losses}


def test_two_interleaved_halves_finetune_as_one_process(olmoe):
    reference = hf.load_sharded(olmoe, routing_placement=Placement(np.array(PLACEMENT), 2), max_devices=1)
    want = hf.finetune(reference, finetune_tokens(), hf.FinetuneConfig(**CFG), progress=False, log=None)
    want_params = trained_weights(reference)
    for rank, got in enumerate(run_ranks(_two_batch_rank, 2, olmoe, timeout_s=300)):
        assert got["halves"] == CFG["steps"], rank
        np.testing.assert_allclose(got["losses"], want.losses, rtol=RTOL, err_msg=f"rank {rank}")
        assert got["params"].keys() == want_params.keys()
        for key, q in want_params.items():
            err = np.abs(got["params"][key] - q).max() / np.abs(q).max()
            assert err <= RTOL, f"rank {rank} {key}: max |diff| / max |weight| = {err:.2e}"
        assert len(got["aux_losses"]) == CFG["steps"] and np.isfinite(got["aux_losses"]).all()


@pytest.mark.parametrize(
    "kw, needle",
    [
        ({"layer_graphs": True}, "layer_graphs"),
        ({"distill_weight": 1.0}, "distillation"),
        ({"batch_size": 3}, "even number of rows per rank"),
    ],
)
def test_refused_before_any_step(olmoe, kw, needle):
    model = hf.load_sharded(olmoe)
    with pytest.raises(ValueError, match=needle):
        hf.finetune(
            model, finetune_tokens(), hf.FinetuneConfig(**{**CFG, **kw}, two_batch=True), progress=False, log=None
        )


def test_cli_finetune_hf_two_batch(olmoe, tmp_path, capsys):
    """`occult finetune --hf DIR --two-batch` runs, and an odd batch is refused before any work."""
    from occult.cli import main

    np.save(tmp_path / "ids.npy", finetune_tokens().numpy())
    argv = ["finetune", "--hf", olmoe, "--data", str(tmp_path / "ids.npy"), "--steps", "3", "--seq-len", "8"]
    assert main([*argv, "--out", str(tmp_path / "run"), "--batch-size", "2", "--no-progress", "--two-batch"]) == 0
    assert "model" in os.listdir(tmp_path / "run")
    capsys.readouterr()
    assert main([*argv, "--out", str(tmp_path / "odd"), "--batch-size", "3", "--two-batch"]) != 0
    assert "even number of rows per rank" in capsys.readouterr().err
    assert not (tmp_path / "odd").exists()
