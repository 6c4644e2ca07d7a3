"""Training and fine-tuning `OccultLM` on a token stream, with checkpoints that resume exactly.

`train(model, data, config, out_dir)` runs AdamW with linear warm-up then cosine decay to
`min_lr_ratio * lr`, bf16 autocast on GPU (fp32 master weights), gradient clipping, the
load-balancing auxiliary loss (`aux_loss_coef`), validation loss / perplexity (and E[C_T]
when the model has a routing placement) every `eval_every` steps, optional early stop when
validation loss flattens (`patience`), and a tqdm progress bar (loss, tokens/s). `moe_only=True`
updates only the MoE blocks (routers and experts), everything else frozen (the paper's
pruning-aware fine-tuning). `finetune(init, ...)` loads weights, applies a routing rule and
trains. Settings, schedule and optimizer are in `occult.lm.state`; evaluation in
`occult.lm.evaluate`.

On N ranks (`parallel=`, an `occult.lm.parallel.Parallel`; the model from `shard_model`), the
experts are sharded over each EP group and everything else is data parallel: every rank reads
its own rows of each global batch of `batch_size` rows, gradients are synchronised (replicated
ones by torch DDP during the backward, `grad_sync="ddp"`, or after it, "explicit", or sharded
with FSDP2, "fsdp", `occult.lm.fsdp`; expert ones after it) and clipped over the whole model, the load-balancing loss is over the global batch,
and the result equals a single-process run on the same global batch. Rank 0 alone prints, draws the bar and writes
the weights files (gathered from every rank) and metrics.

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
continues exactly as the uninterrupted one would have.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from occult._atomic import atomic_path
from occult.lm.checkpoint import (
    CheckpointError,
    config_from_metadata,
    load_weights,
    model_metadata,
    model_tensors,
    read_checkpoint,
)
from occult.lm.data import TokenData, train_batch
from occult.lm.evaluate import autocast_dtype, autocast_for, evaluate, pick_device
from occult.lm.fsdp import reshard, wrap_fsdp
from occult.lm.migrate import follow_routing
from occult.lm.model import OccultLM
from occult.lm.parallel import (
    Parallel,
    clip_grad_norm,
    full_model,
    gathered_tensors,
    global_mean,
    shard_model,
    shard_tensors,
    sync_gradients,
    wrap_ddp,
)
from occult.lm.plot import plot_losses
from occult.lm.replace import Replacer
from occult.lm.sharded import (
    find_sharded,
    load_sharded,
    read_sharded_meta,
    save_sharded,
)
from occult.lm.state import (  # noqa: F401  (re-exported: the names lived here)
    TrainConfig,
    TrainResult,
    check_resume,
    load_optimizer_tensors,
    lr_at,
    make_optimizer,
    optimizer_tensors,
    tensor_hash,
    trainable_names,
)
from occult.placement import Placement

CHECKPOINT = "checkpoint.safetensors"
BEST = "best.safetensors"
FINAL = "model.safetensors"
METRICS = "metrics.jsonl"
PLOT = "loss.png"


def latest_state(out: Path) -> tuple[str, Path, Mapping[str, Any]] | None:
    """("dcp" | "safetensors", path, metadata) of the newest resume state in `out`, or None."""
    found = []
    sharded = find_sharded(out)
    if sharded is not None:
        found.append(("dcp", sharded, read_sharded_meta(sharded)))
    if (out / CHECKPOINT).exists():
        found.append(("safetensors", out / CHECKPOINT, read_checkpoint(out / CHECKPOINT, prefixes=())[1]))
    return max(found, key=lambda f: int(f[2].get("step", 0)), default=None)


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
    every rank of it (each rank calls `train` with its shard of the model).
    """
    par = parallel if parallel is not None and parallel.world_size > 1 else None
    main = par is None or par.is_main
    log = log if main else None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = pick_device(cfg.device)
    model.to(device)
    if data.vocab_size > model.config.vocab_size:
        raise ValueError(f"the data use {data.vocab_size} token ids, the model's vocab_size is {model.config.vocab_size}")
    if par is not None and cfg.batch_size % par.world_size:
        raise ValueError(f"batch_size {cfg.batch_size} (the global batch) is not divisible by the {par.world_size} ranks")
    if par is not None and cfg.grad_sync == "fsdp":  # before the optimizer: the dense parameters become DTensors
        wrap_fsdp(model, par, autocast_dtype(device, cfg.precision))  # bf16: FSDP2 mixed precision
    names = trainable_names(model, cfg.moe_only)
    opt = make_optimizer(model, names, cfg)
    data_sig = f"{data.train.numel()}:{tensor_hash(data.train)}"
    step, best, history, stopped, losses = 0, None, [], False, []
    replacer = Replacer(model, par, cfg, out, log) if cfg.replaces and par is not None and par.ep_size > 1 else None
    if cfg.replaces and replacer is None and log:
        log("experts are not sharded (one process or EP size 1): nothing to re-place")
    state = latest_state(out)
    if state is not None:
        kind, path, meta = state
        if not resume:
            raise CheckpointError(f"{out} already holds a checkpoint: pass --resume to continue it, or choose another --out")
        saved = json.loads(meta.get("replace") or "null")  # the placement in use when it was saved
        if saved is not None and (replacer is None or not replacer.load_state(saved)):
            follow_routing(model, Placement.from_json_dict(saved["placement"], str(path)))  # device-limited routing as it was
        check_resume(meta, model, cfg, data_sig, init_hash, path)
        if kind == "dcp":
            load_sharded(path, meta, model, opt)
        else:
            tensors, meta = read_checkpoint(path)
            if par is not None:
                tensors = shard_tensors(model, tensors)
            load_weights(model, tensors, str(path))
            load_optimizer_tensors(model, opt, tensors, str(path))
        step = int(meta.get("step", 0))
        best = json.loads(meta.get("best_val_loss", "null"))
        history = json.loads(meta.get("history", "[]"))
        losses = json.loads(meta.get("train_losses", "[]"))
        stopped = meta.get("stopped_early") == "true"
        if log:
            log(f"resumed {path} at step {step}")
    eval_bs = cfg.eval_batch_size or cfg.batch_size
    meta_base = dict(extra_metadata or {})
    meta_base.update(train_config=json.dumps(cfg.to_dict()), data_hash=data_sig, init_hash=init_hash or "")
    saved_at = -1

    def save(path: Path, with_optimizer: bool) -> None:
        nonlocal saved_at
        import safetensors.torch

        meta = {k: (v if isinstance(v, str) else json.dumps(v)) for k, v in meta_base.items()}
        meta.update(model_metadata(model))
        meta.update(step=str(step), best_val_loss=json.dumps(best), history=json.dumps(history),
                    stopped_early="true" if stopped else "false", train_losses=json.dumps(losses))
        if replacer is not None:
            meta["replace"] = json.dumps(replacer.state())
        if par is not None and with_optimizer:
            if saved_at != step:
                save_sharded(out, model, opt, meta, step)
                saved_at = step
            return
        tensors = gathered_tensors(model) if par is not None else model_tensors(model)
        if with_optimizer:
            tensors.update(optimizer_tensors(model, opt))
        if main:
            with atomic_path(path) as tmp:
                safetensors.torch.save_file(tensors, str(tmp), metadata=meta)

    clock = {"s": 0.0, "steps": 0, "since": None}  # training time since the last evaluation (evals, saves excluded)

    def pause_clock() -> None:
        if clock["since"] is not None:
            clock["s"] += time.perf_counter() - clock["since"]
            clock["since"] = None

    def do_eval(train_loss: float | None = None) -> dict:
        nonlocal best
        pause_clock()
        rate = {}
        if clock["steps"] and clock["s"] > 0:  # flush() before an eval synchronised the device (losses read back)
            tps = clock["steps"] * tokens_per_step / clock["s"]
            rate = {"train_tokens_per_s": tps, "train_tokens_per_s_per_rank": tps / (par.world_size if par else 1)}
        clock.update(s=0.0, steps=0)
        r = evaluate(model, data.val, eval_bs, cfg.seq_len, cfg.eval_tokens, cfg.precision, parallel=par)
        reshard(model)  # FSDP: the root's weights back to shards after a forward without backward
        r["step"] = step
        r.update(rate)
        if train_loss is not None:
            r["train_loss"] = train_loss
        history.append(r)
        if main:
            with open(out / METRICS, "a") as f:
                f.write(json.dumps(r) + "\n")
        if best is None or r["val_loss"] < best:
            improved = best is None or r["val_loss"] < best * (1 - cfg.min_delta)
            best = r["val_loss"]
            save(out / BEST, with_optimizer=False)
            r["improved"] = improved
        else:
            r["improved"] = False
        return r

    def plateaued() -> bool:
        if cfg.patience is None or len(history) <= cfg.patience:
            return False
        return not any(h.get("improved") for h in history[-cfg.patience:])

    pending: list[torch.Tensor] = []

    def flush() -> float:
        """Record the pending steps' losses (means over the global batch); the last one."""
        if pending:
            losses.extend(global_mean(torch.stack(pending).float(), par).tolist())
            pending.clear()
        return losses[-1] if losses else float("nan")

    tokens_per_step = cfg.batch_size * cfg.seq_len
    if cfg.eval_at_start and step == 0 and not history and cfg.eval_every:
        do_eval()
    from tqdm.auto import tqdm

    show = ((not progress) if progress is not None else None) if main else True
    bar = tqdm(total=cfg.steps, initial=step, desc="train" if not cfg.moe_only else "finetune (MoE only)",
               unit="step", disable=show, dynamic_ncols=True)
    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    t_last, s_last = time.perf_counter(), step
    if replacer is not None:
        replacer.start()
    last_step = cfg.steps if stop_after is None else min(cfg.steps, step + int(stop_after))
    shard = (par.rank, par.world_size) if par is not None else ()
    ddp = wrap_ddp(model, par) if par is not None and cfg.grad_sync == "ddp" else None
    forward = ddp if ddp is not None else model  # DDP (or FSDP's hooks) average the dense gradients during backward
    try:
        while step < last_step and not stopped:
            if clock["since"] is None:
                clock["since"] = time.perf_counter()
            lr = lr_at(step, cfg)
            for g in opt.param_groups:
                g["lr"] = lr
            x, y = train_batch(data.train, cfg.batch_size, cfg.seq_len, cfg.seed, step, *shard)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast_for(device, cfg.precision):
                out_ = forward(x, y, return_logits=False)
                loss = out_.loss + cfg.aux_loss_coef * out_.aux_loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = None
            if par is not None:
                sync_gradients(model, par, replicated=cfg.grad_sync == "explicit")  # experts (and replicated, explicit)
                gnorm = clip_grad_norm(model, par, cfg.grad_clip) if cfg.grad_clip > 0 else None
            elif cfg.grad_clip > 0:
                gnorm = torch.nn.utils.clip_grad_norm_(trained, cfg.grad_clip)
            opt.step()
            step += 1
            clock["steps"] += 1
            if replacer is not None:
                replacer.after_step(step, opt)
            pending.append(out_.loss.detach())
            bar.update(1)
            if step % 10 == 0 or step == cfg.steps:
                last_loss = flush()
                if not math.isfinite(last_loss):
                    raise FloatingPointError(f"training loss is {last_loss} at step {step}; lower the learning rate")
                now = time.perf_counter()
                tps = tokens_per_step * (step - s_last) / max(1e-9, now - t_last)
                t_last, s_last = now, step
                post = {"loss": f"{last_loss:.3f}", "aux": f"{float(out_.aux_loss.detach()):.3f}", "lr": f"{lr:.2e}", "tok/s": f"{tps:,.0f}"}
                if gnorm is not None:
                    post["gnorm"] = f"{float(gnorm):.2f}"
                if history:
                    post["val"] = f"{history[-1]['val_loss']:.3f}"
                bar.set_postfix(post, refresh=False)
            if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
                do_eval(flush())
                if plateaued():
                    stopped = True
                    if log:
                        log(f"validation loss flat for {cfg.patience} evaluations: stopping at step {step}")
            if cfg.save_every and (step % cfg.save_every == 0 or step == cfg.steps or stopped):
                flush()
                pause_clock()
                save(out / CHECKPOINT, with_optimizer=True)
    finally:
        bar.close()
        if replacer is not None:
            replacer.close()
    flush()
    save(out / CHECKPOINT, with_optimizer=True)
    if step >= cfg.steps or stopped:
        save(out / FINAL, with_optimizer=False)
        if main and plot and plot_losses(out / PLOT, losses, history, title=str(out.name)) is None and log:
            log("no loss plot: matplotlib is not installed")
    return TrainResult(step, best, history, stopped, out, losses, list(replacer.migrations) if replacer else [])


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
) -> tuple[OccultLM, TrainResult]:
    """Load `init`'s weights (its routing rule is ignored), set the routing rule, train.

    `parallel`: on every rank of it, experts sharded by `ep_placement` (default contiguous).
    """
    tensors, meta = read_checkpoint(init, prefixes=("model.",))
    model = full_model(config_from_metadata(meta, str(init)), parallel)
    load_weights(model, tensors, str(init))
    model.set_routing(max_devices, placement, method, similarity)
    if parallel is not None and parallel.world_size > 1:
        model = shard_model(model, parallel, ep_placement, dispatcher)
    init_sig = hashlib.sha256(b"".join(tensor_hash(tensors[k]).encode() for k in sorted(tensors))).hexdigest()[:16]
    result = train(model, data, cfg, out_dir, resume=resume, stop_after=stop_after, progress=progress, init_hash=init_sig,
                   extra_metadata={"init": str(init)}, log=log, parallel=parallel)
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
    "latest_state",
]
