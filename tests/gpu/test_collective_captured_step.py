"""`occult train --captured-step` on every GPU over NCCL: the whole expert-parallel training step (forward over the
device transport, backward, the explicit gradient all-reduce after the backward or in buckets during it
(`--grad-sync overlap`), or the dense weights sharded by FSDP2 (`--grad-sync fsdp`: its gathers and
reduce-scatters recorded with the step), clipping, AdamW) recorded as one CUDA graph after 3
eager steps and replayed gives the losses, validation losses and final weights of the same run with eager steps
(FSDP2's eager steps for FSDP2, the explicit sync's for the others)
(fp32: losses within 1e-4, weights 1e-3; bf16: losses within 1e-3 over 12 steps, issue 52's bound), with an
evaluation between replays and a placement that differs per layer. Skipped over gloo (a CUDA graph cannot hold
gloo's collectives) and where the device transport cannot run (the layers' exchanges would then wait on the host)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from test_collective_train import _model_config, _placement, _rel, _token_data, _train_config, shared_fp32_dir

from occult.lm.parallel import full_model, gathered_tensors, setup_parallel, shard_model
from occult.lm.train import train

STEPS = 12
TOL = {"fp32": 1e-4, "bf16": 1e-3}  # losses and validation losses, relative
# fp32 weights: AdamW's capturable mode computes its bias corrections on the GPU in fp32 (the plain mode in Python
# doubles), and Adam turns last-bit differences of small gradients into visible weight differences
WEIGHTS_TOL_FP32 = 1e-3


def run_training(ranks, par, data, out: Path, precision: str, transport: str = "device", **settings) -> dict:
    """STEPS steps of the collective training model over `transport` (a placement that differs per layer, the
    explicit gradient sync, an evaluation every 6 steps), `settings` over the training config: losses, validation
    losses, the whole weights (a collective)."""
    cfg_m = dataclasses.replace(_model_config(ranks.world_size), transport=transport)
    torch.manual_seed(ranks.seed)
    placement = _placement(cfg_m.num_experts, cfg_m.num_layers, par.world_size, ranks.seed)
    model = shard_model(full_model(cfg_m, par), par, placement)
    cfg = _train_config(ranks, steps=STEPS, eval_every=6, grad_sync="explicit", precision=precision)
    cfg = dataclasses.replace(cfg, **settings)
    result = train(model, data, cfg, out, parallel=par, progress=False, log=None, plot=False)
    weights = {k: v.double().numpy() for k, v in gathered_tensors(model).items()}  # a collective
    return {
        "losses": np.array(result.train_losses),
        "val": np.array([h["val_loss"] for h in result.history]),
        "weights": weights,
    }


@pytest.mark.parametrize("grad_sync", ["explicit", "overlap", "fsdp", "fsdp-model"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_captured_expert_parallel_steps_give_the_eager_run(ranks, precision, grad_sync):
    """fsdp-model: `--grad-sync fsdp --fsdp-units model` (one FSDP2 unit for every dense weight), both sides."""
    if ranks.backend != "nccl":
        pytest.skip("a CUDA graph cannot hold gloo's collectives: NCCL ranks only")
    from occult.moe.symm import unavailable_reason

    if reason := unavailable_reason(dist.group.WORLD):
        pytest.skip(f"device transport: {reason}")
    par = setup_parallel()
    with shared_fp32_dir(ranks, "occult_gpu_captured_") as root:
        data = _token_data(ranks.seed)
        units = {"fsdp_units": "model"} if grad_sync == "fsdp-model" else {}
        grad_sync = grad_sync.removesuffix("-model")
        captured = dict(captured_step=True, grad_sync=grad_sync, **units)
        got = run_training(ranks, par, data, root / f"captured-{precision}", precision, **captured)
        eager_sync = "fsdp" if grad_sync == "fsdp" else "explicit"  # FSDP2's reduce-scatter sums in another order
        want = run_training(ranks, par, data, root / f"eager-{precision}", precision, grad_sync=eager_sync, **units)
    assert len(got["losses"]) == STEPS and len(got["val"]) == 2
    loss = ranks.all_max(float(np.max(np.abs(got["losses"] - want["losses"]) / np.abs(want["losses"]))))
    val = ranks.all_max(float(np.max(np.abs(got["val"] - want["val"]) / np.abs(want["val"]))))
    assert loss <= TOL[precision] and val <= TOL[precision], (precision, loss, val, ranks.seed)
    if precision == "fp32":
        worst = ranks.all_max(max(_rel(got["weights"][k], want["weights"][k]) for k in want["weights"]))
        assert worst <= WEIGHTS_TOL_FP32, (worst, ranks.seed)
