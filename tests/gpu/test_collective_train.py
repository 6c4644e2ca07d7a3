"""Multi-rank `OccultLM` training on the suite's ranks (`--grad-sync fsdp` and `ddp`, fp32 and bf16).

Every rank runs `occult.lm.train.train` exactly as `occult train` does (the same full model on
every rank from one seed, `shard_model` with a random placement, `train(..., parallel=par)`, which
wraps FSDP2 / DDP, syncs the expert gradients, clips over the whole model and runs AdamW), on
`ranks.device`, 10 steps of a 2-layer model (hidden 128, 8 * world experts, top-2, 0.56M
parameters at 2 ranks) on a synthetic token stream with structure (each token usually followed by a fixed
successor, so the loss falls within 10 steps). The references are single-process runs of the
same `train` on the same global batch, made by every rank on its own device (a full model with
`parallel=None`). TF32 is off for the fp32 runs. Cases:

    fp32      fsdp and ddp == one process: every step's loss, the validation losses (an
              evaluation at step 5 and 10: FSDP re-shards after it and training goes on) and
              the final weights gathered from every rank (`gathered_tensors`, the weights-file
              path), within 1e-4 relative; fsdp's dense parameters are DTensors, ddp's not
    bf16      `precision="bf16"` (autocast; under fsdp also FSDP2's MixedPrecisionPolicy): losses
              finite, falling, within 3e-2 of the fp32 one-process losses; fsdp vs ddp within
              3e-2 (losses, validation losses); each tensor's update w_10 - w_0 within 0.3
              (relative Frobenius) of the fp32 run's and of each other's (single bf16 weights
              are no measure: see UPDATE_TOL_BF16); fsdp's blocks compute with bf16 weights,
              master weights stay fp32
    resume    an fsdp run stopped after 5 steps (a DCP checkpoint, written on the device) is
              resumed under ddp by a model built from another seed: steps 6-10 and the final
              weights == the uninterrupted fsdp run within 1e-4

Every comparison is reduced with `ranks.all_max` so every rank asserts the same number; rank 0
writes the worst of each to OUT/train_errors.json. The bf16 cases run on CPU ranks too (CPU
autocast, FSDP2 mixed precision over gloo), so `OCCULT_GPU_SUITE_ON_CPU=1` checks all of it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from occult._atomic import atomic_path
from occult.lm.checkpoint import model_tensors
from occult.lm.data import TokenData
from occult.lm.fsdp import is_sharded
from occult.lm.model import ModelConfig
from occult.lm.parallel import full_model, gathered_tensors, setup_parallel, shard_model
from occult.lm.train import TrainConfig, latest_state, train
from occult.placement import Placement

VOCAB, SEQ, STEPS, STOP = 256, 64, 10, 5
RTOL_FP32 = 1e-4  # GPU fp32, TF32 off: another summation order (B/W rows per rank) over 10 AdamW steps
# adam eps 1e-5: Adam's lr * m / (sqrt(v) + eps) turns last-bit differences of gradients near eps
# into visible weight differences (docs/training.md, Exactness); with eps 1e-6 the fp32 weights
# agreed to 1e-5..3e-5 on CPU gloo ranks, with 1e-5 to 4e-6..8e-6 (the losses to 1e-7 either way).
ADAM_EPS = 1e-5
RTOL_BF16 = 3e-2  # bf16 against fp32, and fsdp against ddp in bf16 (losses)
# bf16 weights after 10 AdamW steps: Adam turns bf16 rounding of a small gradient into a full
# lr-sized step of either sign, so single weights differ by ~lr * steps (0.3 of max |w| here, fsdp
# vs ddp as much as either vs fp32). Judged instead: each tensor's update w_10 - w_0, as a whole
# (||dw_a - dw_b|| / ||dw_b||: 0.07-0.09 measured on CPU gloo ranks; 1 for a tensor left untrained).
UPDATE_TOL_BF16 = 0.3


def _model_config(world_size: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        num_layers=2,
        num_heads=4,
        num_experts=8 * world_size,
        top_k=2,
        expert_ffn_size=32,
        max_seq_len=SEQ,
    )


def _train_config(ranks, **kw) -> TrainConfig:
    base = dict(
        steps=STEPS,
        batch_size=4 * ranks.world_size,
        seq_len=SEQ,
        lr=3e-3,
        warmup_steps=2,
        eval_every=5,
        eval_tokens=4 * SEQ * ranks.world_size,
        save_every=0,
        device=str(ranks.device),
        adam_eps=ADAM_EPS,
        grad_clip=1.0,
        precision="fp32",
        seed=ranks.seed % 1000,
    )
    return TrainConfig(**{**base, **kw})


def _token_data(seed: int) -> TokenData:
    """A stream where each token is followed by its fixed successor 3 times in 4 (else a random token)."""
    rng = np.random.default_rng(seed)
    succ = rng.permutation(VOCAB)
    n = 24_000
    noise, jump = rng.random(n) < 0.25, rng.integers(0, VOCAB, n)
    out = np.empty(n, dtype=np.int64)
    out[0] = jump[0]
    for i in range(1, n):
        out[i] = jump[i] if noise[i] else succ[out[i - 1]]
    t = torch.from_numpy(out)
    return TokenData(t[:20_000].clone(), t[20_000:].clone(), VOCAB, {"synthetic": seed})


def _placement(num_experts: int, num_layers: int, world_size: int, seed: int) -> Placement:
    rng = np.random.default_rng(seed)
    return Placement(
        np.stack([rng.permutation(np.arange(num_experts) % world_size) for _ in range(num_layers)]), world_size
    )


def _snapshot(model, result, weights: dict) -> dict:
    return {
        "losses": np.array(result.train_losses, dtype=np.float64),
        "val": np.array([h["val_loss"] for h in result.history], dtype=np.float64),
        "weights": {k: v.double().numpy() for k, v in weights.items()},
    }


def _single(ranks, par, data, out: Path, **kw) -> dict:
    """One process on the whole global batch (this rank alone, on its device)."""
    torch.manual_seed(ranks.seed)
    model = full_model(_model_config(ranks.world_size), par)
    init = {k: v.double().numpy() for k, v in model_tensors(model).items()}  # copies (model_tensors is .cpu())
    result = train(model, data, _train_config(ranks, **kw), out, progress=False, log=None, plot=False)
    return {**_snapshot(model, result, model_tensors(model)), "init": init}


def _multi(
    ranks, par, data, out: Path, grad_sync: str, init_seed: int | None = None, stop_after=None, resume=False, **kw
) -> dict:
    """Every rank, as `occult train` does: the same full model, sharded, trained with `parallel=`."""
    cfg_m = _model_config(ranks.world_size)
    torch.manual_seed(ranks.seed if init_seed is None else init_seed)
    model = shard_model(
        full_model(cfg_m, par), par, _placement(cfg_m.num_experts, cfg_m.num_layers, par.world_size, ranks.seed)
    )
    seen: list[torch.dtype] = []
    model.blocks[0].attn.qkv.register_forward_pre_hook(lambda m, a: seen.append(m.weight.dtype))
    result = train(
        model,
        data,
        _train_config(ranks, grad_sync=grad_sync, **kw),
        out,
        resume=resume,
        stop_after=stop_after,
        parallel=par,
        progress=False,
        log=None,
        plot=False,
    )
    snap = _snapshot(model, result, gathered_tensors(model))  # a collective
    experts = set(model.expert_parameters())
    snap["sharded"] = {n: is_sharded(p) for n, p in model.named_parameters() if n not in experts}
    snap["compute"] = sorted({str(d) for d in seen})
    snap["master"] = sorted({str(p.dtype) for p in model.parameters()})
    return snap


FSDP_GLOO_CUDA = (
    "FSDP2 over gloo with CUDA tensors crashes the process: both ranks SIGSEGV in "
    "DTensor.full_tensor (_to_replicate_tensor), torch 2.11 on 1 x H200; FSDP runs over NCCL, "
    "or on CPU gloo ranks (OCCULT_GPU_SUITE_ON_CPU=1)"
)


@contextlib.contextmanager
def shared_fp32_dir(ranks, prefix: str) -> Iterator[Path]:
    """A temporary folder rank 0 makes and every rank gets, with TF32 matmuls off inside (fp32 runs compared to
    rounding); afterwards TF32 as it was, the ranks met, the folder gone."""
    box = [tempfile.mkdtemp(prefix=prefix) if ranks.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    root = Path(box[0])
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield root
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        dist.barrier()
        if ranks.rank == 0:
            shutil.rmtree(root, ignore_errors=True)


def _fsdp_ok(ranks) -> bool:
    return not (ranks.backend == "gloo" and ranks.device.type == "cuda")


@pytest.fixture(scope="module")
def runs(ranks):
    """Every training run of this file, on every rank in the same order (each is a collective)."""
    par = setup_parallel()
    with shared_fp32_dir(ranks, "occult_gpu_train_") as root:
        data = _token_data(ranks.seed)
        r = {"single": _single(ranks, par, data, root / f"single{ranks.rank}")}
        for mode in ("fsdp", "ddp") if _fsdp_ok(ranks) else ("ddp",):
            r[f"{mode}-fp32"] = _multi(ranks, par, data, root / f"{mode}-fp32", mode)
            r[f"{mode}-bf16"] = _multi(ranks, par, data, root / f"{mode}-bf16", mode, precision="bf16")
        if _fsdp_ok(ranks):
            _multi(ranks, par, data, root / "stop", "fsdp", stop_after=STOP)
            kind = latest_state(root / "stop")[0]
            r["resumed"] = _multi(ranks, par, data, root / "stop", "ddp", init_seed=ranks.seed + 1, resume=True)
            r["resumed"]["kind"] = kind
        r["measured"] = {}
        yield r
        out = os.environ.get("OCCULT_GPU_SUITE_OUT")
        if out and ranks.rank == 0:  # the worst errors of every check, for the record
            with atomic_path(Path(out) / "train_errors.json") as tmp:
                tmp.write_text(
                    json.dumps(
                        {
                            "ranks": ranks.world_size,
                            "device": str(ranks.device),
                            "backend": ranks.backend,
                            "seed": ranks.seed,
                            **r["measured"],
                        },
                        indent=1,
                    )
                )


def _check(ranks, runs, name: str, err: float, tol: float) -> None:
    """Assert the worst `err` over the ranks is within `tol` (recorded in OUT/train_errors.json)."""
    worst = ranks.all_max(err)
    runs["measured"][name] = worst
    assert worst <= tol, f"{name}: {worst:.3g} > {tol:g} (seed {ranks.seed})"


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(float(np.abs(b).max()), 1e-30))


def _update_err(a: dict, b: dict, init: dict) -> float:
    """The worst tensor's relative Frobenius difference of the training updates w_final - w_init."""
    errs = []
    for k, w0 in init.items():
        da, db = a["weights"][k] - w0, b["weights"][k] - w0
        errs.append(float(np.linalg.norm(da - db) / max(float(np.linalg.norm(db)), 1e-30)))
    return max(errs)


def _worst(got: dict, want: dict, steps: slice = slice(None)) -> dict:
    """Relative errors of the losses (per step), validation losses and weights (worst tensor)."""
    assert set(got["weights"]) == set(want["weights"])
    return {
        "loss": _rel(got["losses"][steps], want["losses"][steps]),
        "val": _rel(got["val"], want["val"]) if len(want["val"]) else 0.0,
        "weights": max(_rel(got["weights"][k], want["weights"][k]) for k in want["weights"]),
    }


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_train_fp32_equals_one_process(ranks, runs, mode):
    if mode == "fsdp" and not _fsdp_ok(ranks):
        pytest.skip(FSDP_GLOO_CUDA)
    got, want = runs[f"{mode}-fp32"], runs["single"]
    assert len(got["losses"]) == len(want["losses"]) == STEPS and len(got["val"]) == 2
    layout_ok = all(v == (mode == "fsdp") for v in got["sharded"].values())
    assert ranks.all_max(0.0 if layout_ok else 1.0) == 0.0, f"{mode}: dense parameters sharded {got['sharded']}"
    assert ranks.all_max(float(want["losses"][-1] >= want["losses"][0])) == 0.0, (
        f"the loss does not fall: {want['losses']}"
    )
    for what, err in _worst(got, want).items():
        _check(ranks, runs, f"fp32 {mode} vs one process: {what}", err, RTOL_FP32)


def test_train_bf16_near_fp32_and_fsdp_near_ddp(ranks, runs):
    fp32 = runs["single"]["losses"]
    for mode in ("fsdp", "ddp") if _fsdp_ok(ranks) else ("ddp",):
        b = runs[f"{mode}-bf16"]["losses"]
        bad = float(
            len(b) != STEPS or not np.all(np.isfinite(b)) or not b[-1] < b[0] or not b[-3:].mean() < b[:3].mean()
        )
        assert ranks.all_max(bad) == 0.0, f"{mode} bf16 losses not finite and falling: {b} (seed {ranks.seed})"
        _check(ranks, runs, f"bf16 {mode} vs fp32 one process: loss", _rel(b, fp32), RTOL_BF16)
        assert ranks.all_max(float(np.array_equal(b, fp32))) == 0.0, f"{mode}: bf16 did not round anything"
    if not _fsdp_ok(ranks):
        d, single = runs["ddp-bf16"], runs["single"]
        _check(ranks, runs, "bf16 ddp vs fp32: weight updates", _update_err(d, single, single["init"]), UPDATE_TOL_BF16)
        return  # FSDP_GLOO_CUDA
    f, d = runs["fsdp-bf16"], runs["ddp-bf16"]
    assert f["compute"] == ["torch.bfloat16"] and f["master"] == ["torch.float32"], (f["compute"], f["master"])
    assert d["master"] == ["torch.float32"], d["master"]
    errs = _worst(f, d)
    del errs["weights"]  # see UPDATE_TOL_BF16
    for what, err in errs.items():
        _check(ranks, runs, f"bf16 fsdp vs ddp: {what}", err, RTOL_BF16)
    single = runs["single"]
    for name, a, b in (("fsdp vs ddp", f, d), ("fsdp vs fp32", f, single), ("ddp vs fp32", d, single)):
        _check(ranks, runs, f"bf16 {name}: weight updates", _update_err(a, b, single["init"]), UPDATE_TOL_BF16)


def test_train_fsdp_checkpoint_resumes_under_ddp(ranks, runs):
    if not _fsdp_ok(ranks):
        pytest.skip(FSDP_GLOO_CUDA)
    got, want = runs["resumed"], runs["fsdp-fp32"]
    assert got["kind"] == "dcp", got["kind"]
    assert len(got["losses"]) == STEPS
    assert not any(got["sharded"].values())  # resumed under DDP: plain tensors
    errs = _worst(got, want)
    errs["loss"] = _rel(got["losses"][STOP:], want["losses"][STOP:])
    errs["saved losses"] = _rel(got["losses"][:STOP], want["losses"][:STOP])
    for what, err in errs.items():
        _check(ranks, runs, f"fsdp stopped at {STOP}, resumed under ddp: {what}", err, RTOL_FP32)
