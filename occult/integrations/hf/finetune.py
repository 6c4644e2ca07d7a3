"""Pruning-aware fine-tuning of a converted transformers MoE model on 1 or N ranks (`finetune`);
`occult.integrations.hf.save.save_finetuned` writes it back to the transformers layout.

What is trained: the MoE blocks' routers (the model's own gate modules) and routed experts;
everything else (embeddings, attention, norms, shared experts, dense MLPs, head) is frozen, as
in the paper's pruning-aware fine-tuning, with the routing rule the model was converted with
(e.g. `max_devices=N`: every token limited to experts on N devices).

N ranks (`Groups`, world W, expert-parallel size S dividing W): each MoE layer's experts are
sharded over an EP group of S ranks by the placement; the W/S EP groups are data-parallel
replicas. Every rank reads its own B/W rows of each global batch of B rows (windows at random
offsets of the token stream, drawn from a generator seeded by (seed, step)), so the global loss
is the mean of the ranks' mean losses. Gradients:
  - routers (replicated): torch's `DistributedDataParallel` over the whole model with the expert
    parameters ignored (`occult.training.grads.wrap_ddp`) -- everything else is
    frozen, so DDP reduces exactly the routers, averaged over the world, in buckets that overlap
    the backward. It runs on a process group of its own (`Groups.ddp`, the dense group), so its asynchronous
    all-reduces never interleave with the MoE all-to-alls on the EP group.
  - experts: the all-to-all already brought back every EP-group rank's contribution; they are
    all-reduced over the replica group (only when S < W) and divided by W.
Clipping is by the norm of the whole trained model (routers once, expert shards summed over the
EP group). With precision "bf16" (default on GPUs) the forward runs under bf16 autocast with fp32
master weights. `aux_loss_coef > 0` adds the load-balancing loss over the global batch
(`occult.integrations.hf.aux_loss`); `checkpoint_dir` makes the run resumable
(`occult.integrations.hf.checkpoint`). The result equals single-process training on the same global batch
(tests/integrations/test_hf_finetune.py; docs/training.md). The step loop, the gradient sync and
clipping, the schedule and the checkpoint writer are the training core's (`occult.training`):
this module says how a batch becomes a loss and which parameters train. `Groups` is the core's
`Parallel` (`ep`, `replica` and `ddp` name its EP, replica and dense groups). Its settings and result:
`finetune_config`; the token stream and batches: `finetune_data`; checkpoints while it runs: `finetune_state`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from occult.integrations.hf import checkpoint as ckpt
from occult.integrations.hf.aux_loss import RouterTaps
from occult.integrations.hf.block import OccultMoeBlock
from occult.integrations.hf.finetune_config import FinetuneConfig, FinetuneResult, lr_at
from occult.integrations.hf.finetune_data import batch_rows, tokenize_texts
from occult.integrations.hf.finetune_options import (
    check_captured_step,
    loop_settings,
    prepare_micro_batches,
    prepare_two_batch,
)
from occult.integrations.hf.finetune_state import CheckpointSaver, CloseTaps, resume_state
from occult.integrations.hf.graphed import masks_as_eager
from occult.moe.step import agreed_step
from occult.training import grads
from occult.training.distill import TRAIN_PARTS, distill_kl, teacher_logits, unlimited
from occult.training.hooks import StepHook
from occult.training.layer_graphs import replayed_layers
from occult.training.loop import StepLoss, StepParts, TrainLoop, to_device
from occult.training.loss import cross_entropy
from occult.training.optim import adamw
from occult.training.parallel import Parallel, global_mean, setup_parallel
from occult.training.schedule import CosineSchedule
from occult.training.signature import ModelSignature
from occult.training.step_profile import StepProfile

Groups = Parallel  # the world of a fine-tuning run: `setup_groups`


def setup_groups(ep_size: int | None = None) -> Groups | None:
    """Groups of the initialised default process group (every rank calls it); None for one rank."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if ep_size not in (None, 1):
            raise ValueError(f"an EP size of {ep_size} needs that many ranks: run under torchrun --nproc-per-node N")
        return None
    W = dist.get_world_size()
    S = W if ep_size is None else int(ep_size)
    if S < 1 or W % S:
        raise ValueError(f"the EP size {S} must divide the world size {W}")
    return setup_parallel(S)


def trainable_parameters(model: nn.Module, part: str = "both") -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Freeze everything but the MoE blocks' routers and/or experts (`part`: "routers", "experts"
    or "both"); return the trained (routers, experts), the other list empty when it is frozen."""
    if part not in TRAIN_PARTS:
        raise ValueError(f"part must be one of {', '.join(TRAIN_PARTS)}, got {part!r}")
    model.requires_grad_(False)
    routers, experts = [], []
    for block in model.modules():
        if isinstance(block, OccultMoeBlock):
            routers += list(block.gate.parameters())
            experts += [block.experts.gate_up_proj, block.experts.down_proj]
    if not experts:
        raise ValueError("the model has no converted MoE blocks: convert it (hf.convert / hf.load_sharded) first")
    routers, experts = (routers if part != "experts" else []), (experts if part != "routers" else [])
    for p in routers + experts:
        p.requires_grad_(True)
    return routers, experts


def _routers(model: nn.Module) -> list[nn.Module]:
    return [b.experts.router for b in model.modules() if isinstance(b, OccultMoeBlock)]


def standard_routing(model: nn.Module) -> contextlib.AbstractContextManager:
    """Every MoE block's device limit off inside (the plain top-k: the distillation teacher), restored after."""
    return unlimited(_routers(model))


def _autocast(device: torch.device, precision: str):
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _check_inputs(
    model: nn.Module, tokens: torch.Tensor, cfg: FinetuneConfig, groups: Groups | None, experts: list[nn.Parameter]
) -> None:
    W = groups.world_size if groups is not None else 1
    if cfg.batch_size % W:
        raise ValueError(f"--batch-size {cfg.batch_size} (the global batch) is not divisible by the {W} ranks")
    vocab = int(model.config.vocab_size)
    if tokens.dim() != 1 or tokens.numel() < cfg.seq_len + 2:
        raise ValueError(
            f"need a 1-D token stream of more than seq_len + 1 = {cfg.seq_len + 1} ids, got {list(tokens.shape)}"
        )
    if int(tokens.max()) >= vocab or int(tokens.min()) < 0:
        raise ValueError(f"the data hold token ids outside the model's vocabulary [0, {vocab})")
    sharded = max(b.experts.num_ranks for b in model.modules() if isinstance(b, OccultMoeBlock))
    if groups is None and sharded > 1:
        raise ValueError(
            f"the experts are sharded over {sharded} ranks: pass groups=setup_groups(...) (the gradient sync)"
        )
    if groups is not None and sharded != groups.ep_size:
        raise ValueError(
            f"the experts are sharded over {sharded} ranks, the EP size is {groups.ep_size}: convert over groups.ep"
        )


def _step_parts(
    model: nn.Module,
    tokens: torch.Tensor,
    cfg: FinetuneConfig,
    groups: Groups | None,
    trained: tuple[list[nn.Parameter], list[nn.Parameter]],
    taps: RouterTaps | None,
    schedule: Callable[[int], float],
    teacher: nn.Module | None = None,
) -> StepParts:
    """A step of a converted transformers model: its rows, the cross-entropy (+ aux), the gradient sync."""
    routers, experts = trained
    device = (routers + experts)[0].device
    rank, W = (groups.rank, groups.world_size) if groups is not None else (0, 1)
    net: nn.Module = model
    # DDP for the routers (the experts, each rank its own, and every buffer ignored); a captured step syncs them
    # after the backward instead (DDP's reducer keeps host state a replayed step would skip), as two halves and
    # paired micro-batches do (DDP's hooks expect one forward per backward)
    if groups is not None and routers and not (cfg.captured_step or cfg.two_batch or cfg.pair_micro_batches):
        expert_ids = {id(p) for p in experts}
        ignore = [n for n, p in model.named_parameters() if id(p) in expert_ids] + [n for n, _ in model.named_buffers()]
        net = grads.wrap_ddp(model, ignore, groups, summed=True)

    # the syncs (DDP's too) sum what each rank's loss scaled by 1/W made: no pass dividing every gradient
    scale = grads.loss_scale(groups)  # (1 on one process)

    def batch(step: int) -> torch.Tensor:
        return to_device(batch_rows(tokens, cfg.batch_size, cfg.seq_len, cfg.seed, step, rank, W), device)

    def loss(win: torch.Tensor) -> StepLoss:
        x, y = win[:, :-1], win[:, 1:]
        target = None
        if cfg.distill_weight > 0:  # the teacher model's, or the same weights with standard routing; this step
            with _autocast(device, cfg.precision):
                target = teacher_logits(
                    lambda m: m(input_ids=x, use_cache=False).logits, model, _routers(model), teacher
                )
            if taps is not None:
                taps.clear()  # the aux loss is the student's routing
        with _autocast(device, cfg.precision):
            logits = net(input_ids=x, use_cache=False).logits
        ce = cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        aux = taps.loss(groups.ddp if groups is not None else None) if taps is not None else None
        total = ce if aux is None else ce + cfg.aux_loss_coef * aux
        if target is not None:
            total = total + cfg.distill_weight * distill_kl(logits, target, cfg.distill_temperature)
        return StepLoss(total, ce, aux).scaled(scale)

    def sync() -> None:
        if groups is not None:  # DDP (when routers train) has averaged the routers when the backward returns
            grads.sync_gradients(routers, experts, groups, replicated=net is model, average=False)

    return StepParts(
        batch=batch,
        loss=loss,
        sync=sync,
        clip=lambda m: grads.clip_grad_norm(routers, experts, groups, m),
        lr=schedule,
        mean=lambda t: global_mean(t, groups),
        scope=lambda win: agreed_step(model, win[:, :-1].numel()),  # every MoE call of the step sees these tokens
        signature=ModelSignature(model),
        capture_scope=masks_as_eager,  # warm-ups and recording build no causal mask, as eager
        unsynced=net.no_sync if net is not model else contextlib.nullcontext,  # (accumulated micro-batches)
    )


def _check_teacher(cfg: FinetuneConfig, model: nn.Module, teacher: nn.Module | None) -> None:
    """A teacher model goes with `cfg.distill_from`, a distillation weight and the model's vocabulary; it is frozen."""
    if (teacher is None) != (cfg.distill_from is None):
        raise ValueError(
            "pass the teacher model (teacher=) together with FinetuneConfig.distill_from (its directory)"
            if teacher is None
            else "teacher= needs FinetuneConfig.distill_from (the teacher's directory)"
        )
    if teacher is not None:
        if cfg.distill_weight <= 0:
            raise ValueError(
                "a teacher (--distill-from) needs a distillation weight: set distill_weight > 0 (--distill-weight W)"
            )
        if teacher.config.vocab_size != model.config.vocab_size:
            raise ValueError(
                f"the teacher {cfg.distill_from} has {teacher.config.vocab_size} token ids, the model "
                f"{model.config.vocab_size}: distil from a model with the same tokenizer"
            )
        teacher.requires_grad_(False)
        teacher.eval()


def _checked_parameters(
    cfg: FinetuneConfig, model: nn.Module, tokens: torch.Tensor, groups: Groups | None, teacher: nn.Module | None
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The routers and experts that train, after every check of the run's inputs and settings (a `ValueError`
    before anything changes but the layers' sync-free switch, which `two_batch` asks for)."""
    _check_teacher(cfg, model, teacher)
    routers, experts = trainable_parameters(model, cfg.train_part)
    _check_inputs(model, tokens, cfg, groups, experts)
    prepare_two_batch(cfg, model, groups)  # (before the capture check: it reads sync-free)
    prepare_micro_batches(cfg, model, groups)
    check_captured_step(cfg, model)
    return routers, experts


def _what_trains(cfg: FinetuneConfig, routers: list[nn.Parameter], experts: list[nn.Parameter]) -> str:
    """The line `finetune` logs first: the parameters trained, and the distillation when there is one."""
    line = (
        f"training {sum(p.numel() for p in routers):,} router and {sum(p.numel() for p in experts):,} "
        "expert parameters on rank 0 (everything else frozen)"
    )
    if cfg.distill_weight > 0:
        line += (
            f"; distilling from {cfg.distill_from or 'standard routing'} (weight "
            f"{cfg.distill_weight:g}, T {cfg.distill_temperature:g})"
        )
    return line


def _hooks(
    cfg: FinetuneConfig,
    model: nn.Module,
    groups: Groups | None,
    checkpoint_dir: str | os.PathLike | None,
    log: Callable[[str], None] | None,
    saver: CheckpointSaver | None,
    taps: RouterTaps | None,
) -> list[StepHook]:
    """The loop's hooks, in order: the step profile (`profile_steps`), the checkpoint saver, the taps' closer."""
    profile = None
    if cfg.profile_steps:
        device = next(model.parameters()).device
        profile = StepProfile(cfg.profile_steps, checkpoint_dir or ".", groups.rank if groups else 0, device, log)
    return [h for h in (profile, saver, CloseTaps(taps) if taps is not None else None) if h is not None]


def finetune(
    model: nn.Module,
    tokens: torch.Tensor,
    cfg: FinetuneConfig,
    groups: Groups | None = None,
    *,
    progress: bool | None = None,
    log: Callable[[str], None] | None = print,
    checkpoint_dir: str | os.PathLike | None = None,
    save_every: int = 0,
    resume: bool = False,
    stop_after: int | None = None,
    teacher: nn.Module | None = None,
) -> FinetuneResult:
    """Fine-tune the routers and experts of a converted `model` on windows of `tokens` (1-D ids).

    `groups` (from `setup_groups`): train on every rank of the world; the model converted over
    `groups.ep` (`load_sharded(..., group=groups.ep)`). Rank 0 draws the progress bar (loss,
    tokens/s). Returns every step's global-batch loss.

    `checkpoint_dir` (the run directory): write a sharded checkpoint there every `save_every`
    steps and at the end (with `save_every=0` only when stopping early;
    `occult.integrations.hf.checkpoint`); `resume=True` continues the one
    it holds (it must be of this model, expert count, routing, settings and data; `steps` may
    grow, the schedule then extended as for `occult train`), and without
    it an existing checkpoint is an error. Batches depend on (seed, step) alone, so a resumed run
    continues exactly as the uninterrupted one. `stop_after=n`: return after n more steps.

    `teacher` (with `cfg.distill_from`, its directory, and `cfg.distill_weight` > 0): the distillation
    target is this frozen model's logits (e.g. the standard-routing fine-tune, converted over the
    same group) instead of the model's own weights with standard routing.
    """
    main = groups is None or groups.rank == 0
    log = log if main else None
    routers, experts = _checked_parameters(cfg, model, tokens, groups, teacher)
    if log is not None:
        log(_what_trains(cfg, routers, experts))
    opt = adamw(
        [{"params": routers + experts}], lr=cfg.lr, betas=(0.9, 0.95), eps=cfg.adam_eps, weight_decay=cfg.weight_decay
    )
    settings = loop_settings(cfg, progress, main)
    loop = TrainLoop(None, opt, settings)
    schedule = CosineSchedule(cfg.lr, cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio)
    sig = None
    if checkpoint_dir is not None:  # resume state: occult.integrations.hf.checkpoint
        sig = ckpt.signature(model, tokens, cfg.signature_settings())
        schedule = resume_state(loop, model, cfg, checkpoint_dir, sig, resume, log)
    elif resume:
        raise ValueError("resume=True needs checkpoint_dir (the run directory)")
    start = loop.step
    last = cfg.steps if stop_after is None else min(cfg.steps, start + int(stop_after))
    taps = RouterTaps(model) if cfg.aux_loss_coef > 0 else None
    if taps is not None and log is not None:
        log(f"load-balancing loss: {taps.formula} formula, weight {cfg.aux_loss_coef:g}, over the global batch")
    loop.parts = _step_parts(model, tokens, cfg, groups, (routers, experts), taps, schedule, teacher)
    saver = None
    if checkpoint_dir is not None:
        extra = {"signature": sig, **({"lr_schedule": schedule.to_json()} if schedule.restarts else {})}
        saver = CheckpointSaver(loop, checkpoint_dir, model, lambda: extra, save_every, last)
    loop.hooks = _hooks(cfg, model, groups, checkpoint_dir, log, saver, taps)
    model.train()
    t0 = time.perf_counter()
    with replayed_layers(model, cfg.layer_graphs):
        loop.run(last)
    if saver is not None and last > start and (save_every or last < cfg.steps):
        saver.save(last)
    model.eval()
    elapsed = time.perf_counter() - t0
    return FinetuneResult(
        loop.losses,
        loop.norms(),
        settings.tokens_per_step * (last - start) / max(elapsed, 1e-9),
        sum(p.numel() for p in routers + experts),
    )


__all__ = [
    "FinetuneConfig",
    "FinetuneResult",
    "Groups",
    "TRAIN_PARTS",
    "batch_rows",
    "finetune",
    "lr_at",
    "setup_groups",
    "standard_routing",
    "tokenize_texts",
    "trainable_parameters",
]
