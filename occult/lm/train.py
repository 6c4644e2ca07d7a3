"""Training and fine-tuning `OccultLM` on a token stream, with checkpoints that resume exactly.

`train(model, data, config, out_dir)` runs AdamW with linear warm-up then cosine decay to
`min_lr_ratio * lr`, bf16 autocast on GPU (fp32 master weights), gradient clipping, the
load-balancing auxiliary loss (`aux_loss_coef`), validation loss / perplexity (and E[C_T]
when the model has a routing placement) every `eval_every` steps, optional early stop when
validation loss flattens (`patience`), and a tqdm progress bar (loss, tokens/s). `moe_only=True`
updates only the MoE blocks (routers and experts), everything else frozen (the paper's
pruning-aware fine-tuning). `finetune(init, ...)` loads weights, applies a routing rule and trains
(recipes: `distill_weight`, `train_part`, `occult.lm.distill`). Settings, schedule and optimizer:
`occult.lm.state`; evaluation: `occult.lm.evaluate`; the run's files, evaluations and saves: `occult.lm.run`;
the step loop, gradient sync, clipping, checkpoint writer and step profile: the training core
(`occult.training`). This module says how a batch becomes a loss and adds its hooks. A run whose loss or
weights become non-finite (NaN/inf, e.g. a learning rate far too high) raises `DivergedError` naming the step.

On N ranks (`parallel=`, an `occult.lm.parallel.Parallel`; the model from `shard_model`), the experts are sharded over
each EP group and everything else is data parallel: every rank reads its own rows of each global batch of `batch_size`
rows, gradients are synchronised (replicated ones by torch DDP during the backward, `grad_sync="ddp"`, or after it,
"explicit", or in buckets during it with no host state, "overlap" (`occult.training.bucketed_sync`), or sharded with
FSDP2, "fsdp", `occult.lm.fsdp`; expert ones after it) and clipped over the whole model, the load-balancing loss is
over the global batch, and the result equals a single-process run on the same global batch. Rank 0 alone prints, draws
the bar and writes the weights files (gathered from every rank) and metrics.

Files in `out_dir` (all written atomically):
    checkpoint.safetensors  latest state of a single-process run: `model.*` weights,
                            `optim.<param>.<key>` AdamW state, metadata (model/train config,
                            routing, step, history, losses, data hash)
    checkpoint/             latest state of an N-rank run: sharded DCP checkpoint (`occult.lm.sharded`)
    best.safetensors        weights at the best validation loss so far
    model.safetensors       final weights (when the run ends)
    metrics.jsonl           one JSON line per evaluation (with the training tokens/s since the last one)
    replace.jsonl           re-placement measurements, solves and migrations (`replace_every` / `replace_drift`:
                            `occult.lm.replace`; the placement in use is saved in every checkpoint)
    loss.png                the loss curve (when the run ends; needs matplotlib)

Resume (`resume=True`) continues the newer of the two checkpoints, on any number of ranks (a
2-rank checkpoint resumes on 1 and vice versa): the checkpoint's model config, trajectory-relevant
training settings, routing rule, training data and (for fine-tunes) initial weights must match,
or a `CheckpointError` names what differs. Batches depend only on (seed, step), so a resumed run
continues exactly as the uninterrupted one would have. `steps` may grow on resume: the run goes
on to the new total, the learning rate continuing from its value at the resume step along a new
cosine to the floor at the new last step (`occult.training.schedule`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from occult.lm.checkpoint import (
    CheckpointError,
    config_from_metadata,
    load_weights,
    read_checkpoint,
)
from occult.lm.data import TokenData, train_batch
from occult.lm.distill import distilled_loss, load_teacher
from occult.lm.evaluate import autocast_dtype, autocast_for, evaluate, pick_device
from occult.lm.fsdp import wrap_fsdp
from occult.lm.migrate import follow_routing
from occult.lm.model import OccultLM
from occult.lm.parallel import (
    Parallel,
    clip_grad_norm,
    full_model,
    global_mean,
    shard_model,
    shard_tensors,
    split_trained,
    sync_gradients,
    wrap_ddp,
)
from occult.lm.plot import plot_losses
from occult.lm.replace import Replacer
from occult.lm.run import BEST, CHECKPOINT, FINAL, METRICS, PLOT, EvalAndSave, TrainRun, latest_state  # noqa: F401
from occult.lm.sharded import load_sharded
from occult.lm.state import (  # noqa: F401  (re-exported: the names lived here)
    TrainConfig,
    TrainResult,
    check_resume,
    load_optimizer_tensors,
    lr_at,
    make_optimizer,
    optimizer_tensors,
    schedule_for,
    tensor_hash,
    trainable_names,
)
from occult.lm.step_options import (
    apply_layer_graphs,
    check_captured_step,
    prepare_micro_batches,
    prepare_two_batch,
    unsynced_context,
)
from occult.moe.counts import STATUS_MESSAGES, RoutingError
from occult.moe.step import agreed_step
from occult.placement import Placement
from occult.training.bucketed_sync import BucketedSync
from occult.training.grads import loss_scale
from occult.training.loop import LoopSettings, StepLoss, StepParts, TrainLoop, to_device
from occult.training.signature import ModelSignature
from occult.training.step_profile import StepProfile


class DivergedError(ValueError):
    """The training loss or the weights became non-finite (NaN/inf): the learning rate is too high."""


def _run_steps(loop: TrainLoop, last: int) -> None:
    """`loop.run(last)`, a non-finite loss (or the router's NaN gates that non-finite weights make) as a
    `DivergedError` naming the step."""
    try:
        loop.run(last)
    except (FloatingPointError, RoutingError) as exc:
        if isinstance(exc, RoutingError) and STATUS_MESSAGES[1] not in str(exc):
            raise
        step = loop.step if isinstance(exc, FloatingPointError) else loop.step + 1  # measured after / during it
        raise DivergedError(
            f"training diverged: the loss or the weights became non-finite (NaN/inf) at step {step}; "
            "lower the learning rate"
        ) from exc


def _step_parts(run: TrainRun) -> StepParts:
    """How a step of `OccultLM` goes: its rows of the global batch, its loss (+ aux), its gradient sync."""
    model, cfg, par = run.model, run.cfg, run.par
    device = next(model.parameters()).device
    shard = (par.rank, par.world_size) if par is not None else ()
    # the syncs sum what each rank's loss scaled by 1/W made (no pass dividing every gradient: occult.training.grads);
    # FSDP2 divides its dense gradients itself, so with it the experts are divided too
    summed = par is not None and cfg.grad_sync in ("explicit", "overlap", "ddp")
    ddp = wrap_ddp(model, par, summed=True) if par is not None and cfg.grad_sync == "ddp" else None
    dense = split_trained(model)[0]
    scale = loss_scale(par) if summed else 1.0
    bucketed = None  # "overlap": the dense gradients all-reduced during the backward (occult.training.bucketed_sync)
    if par is not None and cfg.grad_sync == "overlap" and dense:
        bucketed = BucketedSync(dense, par.sync_group, 1)
    forward = ddp if ddp is not None else model  # DDP (or FSDP's hooks) average the dense gradients during backward

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = train_batch(run.data.train, cfg.batch_size, cfg.seq_len, cfg.seed, step, *shard)
        return to_device(x, device), to_device(y, device)

    teacher = load_teacher(cfg.distill_from, model, device, par) if cfg.distill_from else None

    def loss(xy: tuple[torch.Tensor, torch.Tensor]) -> StepLoss:
        with autocast_for(device, cfg.precision):
            if cfg.distill_weight:  # the unpruned model (or --distill-from) as the teacher (occult.lm.distill)
                out = distilled_loss(
                    model, forward, xy, cfg.aux_loss_coef, cfg.distill_weight, cfg.distill_temperature, teacher
                )
            else:
                lm = forward(*xy, return_logits=False)
                out = StepLoss(lm.loss + cfg.aux_loss_coef * lm.aux_loss, lm.loss, lm.aux_loss)
        return out.scaled(scale)

    def sync() -> None:
        if bucketed is not None:
            bucketed.finish()
        if par is not None:  # experts (and replicated ones with the explicit sync)
            sync_gradients(model, par, replicated=cfg.grad_sync == "explicit", average=not summed)

    return StepParts(
        batch=batch,
        loss=loss,
        sync=sync,
        clip=lambda m: clip_grad_norm(model, par, m),
        lr=run.schedule,
        mean=lambda t: global_mean(t, par),
        scope=lambda xy: agreed_step(model, xy[0].numel()),  # every MoE call of the step sees these tokens
        signature=ModelSignature(model),
        close=bucketed.close if bucketed is not None else lambda: None,
        unsynced=unsynced_context(model, ddp, bucketed),
    )


def _resume(run: TrainRun, state: tuple[str, Path, Mapping[str, Any]], data_sig: str, init_hash: str | None) -> None:
    """Check the checkpoint against this run, then load it into the model, optimizer and loop."""
    kind, path, meta = state
    model, par = run.model, run.par
    saved = json.loads(meta.get("replace") or "null")  # the placement in use when it was saved
    if saved is not None and (run.replacer is None or not run.replacer.load_state(saved)):
        follow_routing(
            model, Placement.from_json_dict(saved["placement"], str(path))
        )  # device-limited routing as it was
    check_resume(meta, model, run.cfg, data_sig, init_hash, path)
    if kind == "dcp":
        load_sharded(path, meta, model, run.opt)
    else:
        tensors, meta = read_checkpoint(path)
        if par is not None:
            tensors = shard_tensors(model, tensors)
        load_weights(model, tensors, str(path))
        load_optimizer_tensors(model, run.opt, tensors, str(path))
    loop = run.loop
    loop.step = int(meta.get("step", 0))
    loop.losses = json.loads(meta.get("train_losses", "[]"))
    loop.stopped = meta.get("stopped_early") == "true"
    run.best = json.loads(meta.get("best_val_loss", "null"))
    run.history = json.loads(meta.get("history", "[]"))
    run.schedule = schedule_for(run.cfg, meta)
    if run.schedule.restarts and run.log:
        at, rate, _ = run.schedule.restarts[-1]
        if at == loop.step:
            run.log(
                f"--steps {run.cfg.steps}: continuing from step {at} at learning rate {rate:.3g}, cosine to "
                f"{run.cfg.lr * run.cfg.min_lr_ratio:.3g} at step {run.cfg.steps}"
            )
    if run.log:
        run.log(f"resumed {path} at step {loop.step}")


def _prepare(
    model: OccultLM,
    data: TokenData,
    cfg: TrainConfig,
    out: Path,
    par: Parallel | None,
    log: Callable[[str], None] | None,
    meta_base: dict[str, Any],
) -> TrainRun:
    """Checks, device, FSDP wrapping, optimizer and re-placement of a run."""
    device = pick_device(cfg.device)
    model.to(device)
    if data.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"the data use {data.vocab_size} token ids, the model's vocab_size is {model.config.vocab_size}"
        )
    if par is not None and cfg.batch_size % par.world_size:
        raise ValueError(
            f"batch_size {cfg.batch_size} (the global batch) is not divisible by the {par.world_size} ranks"
        )
    if par is not None and cfg.grad_sync == "fsdp":  # before the optimizer: the dense parameters become DTensors
        free = cfg.fsdp_reshard == "after-forward"
        wrap_fsdp(model, par, autocast_dtype(device, cfg.precision), free, cfg.fsdp_units)
    prepare_two_batch(model, cfg, par)  # (before the layer graphs and the capture check: they read sync-free)
    prepare_micro_batches(model, cfg, par)
    apply_layer_graphs(model, cfg)
    check_captured_step(model, cfg, par)
    opt = make_optimizer(model, trainable_names(model, cfg.moe_only, cfg.train_part), cfg)
    replacer = Replacer(model, par, cfg, out, log) if cfg.replaces and par is not None and par.ep_size > 1 else None
    if cfg.replaces and replacer is None and log:
        log("experts are not sharded (one process or EP size 1): nothing to re-place")
    return TrainRun(model, data, cfg, out, par, log, opt, replacer, meta_base, schedule_for(cfg))


def train(
    model: OccultLM,
    data: TokenData,
    cfg: TrainConfig,
    out_dir: str | os.PathLike,
    *,
    resume: bool = False,
    stop_after: int | None = None,
    progress: bool | None = None,
    init_hash: str | None = None,
    extra_metadata: Mapping[str, Any] | None = None,
    log: Callable[[str], None] | None = print,
    parallel: Parallel | None = None,
    plot: bool = True,
) -> TrainResult:
    """Train `model` on `data.train` for `cfg.steps` steps (see the module docstring).

    `stop_after=n` returns after n more steps (checkpoint saved; resume later with
    `resume=True`), e.g. to split a long run into jobs under a time limit. `parallel`: train on
    every rank of it (each rank calls `train` with its shard of the model). In one process a
    Ctrl-C ends the run after the step under way, saves it (if a step was done) and raises
    KeyboardInterrupt; a second Ctrl-C raises at once.
    """
    par = parallel if parallel is not None and parallel.world_size > 1 else None
    log = log if par is None or par.is_main else None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data_sig = f"{data.train.numel()}:{tensor_hash(data.train)}"
    meta_base = dict(extra_metadata or {})
    meta_base.update(train_config=json.dumps(cfg.to_dict()), data_hash=data_sig, init_hash=init_hash or "")
    run = _prepare(model, data, cfg, out, par, log, meta_base)
    settings = LoopSettings(
        cfg.steps,
        cfg.grad_clip,
        cfg.batch_size * cfg.seq_len,
        "train" if not cfg.moe_only else "finetune (MoE only)",
        progress,
        run.main,
        stop_on_interrupt=par is None,
        captured_step=cfg.captured_step,
        two_batch=cfg.two_batch,
        micro_batches=cfg.micro_batches,
        paired=cfg.pair_micro_batches,
    )
    hooks = (
        [StepProfile(cfg.profile_steps, out, par.rank if par else 0, next(model.parameters()).device, run.log)]
        if cfg.profile_steps
        else []
    )  # first: it stops before step B's evaluation (A - 1 should have none)
    hooks += ([run.replacer] if run.replacer is not None else []) + [EvalAndSave(run)]
    run.loop = TrainLoop(None, run.opt, settings, hooks)  # its parts after the resume (DDP wraps the loaded model)
    state = latest_state(out)
    if state is not None:
        if not resume:
            raise CheckpointError(
                f"{out} already holds a checkpoint: pass --resume to continue it, or choose another --out"
            )
        _resume(run, state, data_sig, init_hash)
    elif resume and run.log:
        run.log(f"resume: {out} holds no checkpoint yet: starting at step 0")
    loop = run.loop
    if cfg.eval_at_start and loop.step == 0 and not run.history and cfg.eval_every:
        run.evaluate()
    model.train()
    loop.parts, start = _step_parts(run), loop.step
    try:
        _run_steps(loop, cfg.steps if stop_after is None else min(cfg.steps, loop.step + int(stop_after)))
    finally:
        loop.parts.close()  # (hooks the parts put on the model)
    if loop.interrupted and loop.step == start:
        raise KeyboardInterrupt
    run.save(out / CHECKPOINT, with_optimizer=True)
    if loop.interrupted:
        raise KeyboardInterrupt  # the step reached is saved: `--resume` continues it
    if loop.step >= cfg.steps or loop.stopped:
        run.save(out / FINAL, with_optimizer=False)
        if run.main and plot and plot_losses(out / PLOT, loop.losses, run.history, title=str(out.name)) is None and log:
            log("no loss plot: matplotlib is not installed")
    migrations = list(run.replacer.migrations) if run.replacer is not None else []
    return TrainResult(loop.step, run.best, run.history, loop.stopped, out, loop.losses, migrations)


def finetune(
    init: str | os.PathLike,
    data: TokenData,
    cfg: TrainConfig,
    out_dir: str | os.PathLike,
    *,
    max_devices: int | None = None,
    placement=None,
    method: str = "score",
    similarity=None,
    resume: bool = False,
    stop_after: int | None = None,
    progress: bool | None = None,
    log: Callable[[str], None] | None = print,
    parallel: Parallel | None = None,
    ep_placement=None,
    dispatcher: str = "dedup",
    transport: str = "auto",
) -> tuple[OccultLM, TrainResult]:
    """Load `init`'s weights (its routing rule is ignored), set the routing rule, train.

    `parallel`: experts sharded over its ranks by `ep_placement` (default contiguous), all-to-alls over `transport`."""
    tensors, meta = read_checkpoint(init, prefixes=("model.",))
    model = full_model(dataclasses.replace(config_from_metadata(meta, str(init)), transport=transport), parallel)
    load_weights(model, tensors, str(init))
    model.set_routing(max_devices, placement, method, similarity)
    if parallel is not None and parallel.world_size > 1:
        model = shard_model(model, parallel, ep_placement, dispatcher)
    init_sig = hashlib.sha256(b"".join(tensor_hash(tensors[k]).encode() for k in sorted(tensors))).hexdigest()[:16]
    result = train(
        model,
        data,
        cfg,
        out_dir,
        resume=resume,
        stop_after=stop_after,
        progress=progress,
        init_hash=init_sig,
        extra_metadata={"init": str(init)},
        log=log,
        parallel=parallel,
    )
    return model, result


__all__ = [
    "TrainConfig",
    "TrainResult",
    "train",
    "finetune",
    "evaluate",
    "lr_at",
    "pick_device",
    "autocast_for",
    "CheckpointError",
    "DivergedError",
    "latest_state",
]
