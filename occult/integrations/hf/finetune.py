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
    parameters ignored (`_set_params_and_buffers_to_ignore_for_model`) -- everything else is
    frozen, so DDP reduces exactly the routers, averaged over the world, in buckets that overlap
    the backward. It runs on a process group of its own (`Groups.ddp`), so its asynchronous
    all-reduces never interleave with the MoE all-to-alls on the EP group.
  - experts: the all-to-all already brought back every EP-group rank's contribution; they are
    all-reduced over the replica group (only when S < W) and divided by W.
Clipping is by the norm of the whole trained model (routers once, expert shards summed over the
EP group). With precision "bf16" (default on GPUs) the forward runs under bf16 autocast with fp32
master weights. `aux_loss_coef > 0` adds the load-balancing loss over the global batch
(`occult.integrations.hf.aux_loss`); `checkpoint_dir` makes the run resumable
(`occult.integrations.hf.checkpoint`). The result equals single-process training on the same global batch
(tests/integrations/test_hf_finetune.py; docs/training.md).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from occult.integrations.hf import checkpoint as ckpt
from occult.integrations.hf.aux_loss import RouterTaps
from occult.integrations.hf.block import OccultMoeBlock


@dataclass
class FinetuneConfig:
    """Optimisation settings of `finetune` (AdamW, linear warm-up then cosine to `min_lr_ratio * lr`)."""

    steps: int = 100
    batch_size: int = 8   # global rows per step (divisible by the world size)
    seq_len: int = 256
    lr: float = 1e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.0
    adam_eps: float = 1e-8
    grad_clip: float = 1.0  # 0 = off
    aux_loss_coef: float = 0.0  # load-balancing loss weight (0 = off), over the global batch (hf.aux_loss)
    seed: int = 0
    precision: str = "auto"  # auto: bf16 autocast on CUDA, fp32 elsewhere; or "bf16" / "fp32"

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1 or self.warmup_steps < 0:
            raise ValueError(f"need lr > 0, 0 <= min_lr_ratio <= 1, warmup >= 0; got {self.lr}, {self.min_lr_ratio}, {self.warmup_steps}")
        if self.aux_loss_coef < 0:
            raise ValueError(f"aux_loss_coef must be >= 0, got {self.aux_loss_coef}")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"precision must be 'auto', 'bf16' or 'fp32', got {self.precision!r}")


@dataclass
class FinetuneResult:
    losses: list[float]            # per step, mean over the global batch
    grad_norms: list[float] = field(default_factory=list)
    tokens_per_s: float = 0.0      # global tokens per second over the whole run
    trained_parameters: int = 0    # on this rank


@dataclass
class Groups:
    """World W = (W/S EP groups of S ranks) x replicas; `ddp`: the routers' own all-reduce group."""

    rank: int
    world_size: int
    ep_size: int
    ep: Any
    replica: Any
    ddp: Any

    @property
    def replicas(self) -> int:
        return self.world_size // self.ep_size


def setup_groups(ep_size: int | None = None) -> Groups | None:
    """Groups of the initialised default process group (every rank calls it); None for one rank."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if ep_size not in (None, 1):
            raise ValueError(f"an EP size of {ep_size} needs that many ranks: run under torchrun --nproc-per-node N")
        return None
    W, rank = dist.get_world_size(), dist.get_rank()
    S = W if ep_size is None else int(ep_size)
    if S < 1 or W % S:
        raise ValueError(f"the EP size {S} must divide the world size {W}")
    ep = replica = None
    for g in range(W // S):  # every rank creates every group, in the same order
        grp = dist.group.WORLD if S == W else dist.new_group(list(range(g * S, (g + 1) * S)))
        ep = grp if rank // S == g else ep
    for j in range(S):
        grp = dist.group.WORLD if S == 1 else dist.new_group(list(range(j, W, S)))
        replica = grp if rank % S == j else replica
    return Groups(rank, W, S, ep, replica, dist.new_group(list(range(W))))


def trainable_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Freeze everything but the MoE blocks' routers and experts; return (routers, experts)."""
    model.requires_grad_(False)
    routers, experts = [], []
    for block in model.modules():
        if isinstance(block, OccultMoeBlock):
            routers += list(block.gate.parameters())
            experts += [block.experts.gate_up_proj, block.experts.down_proj]
    if not experts:
        raise ValueError("the model has no converted MoE blocks: convert it (hf.convert / hf.load_sharded) first")
    for p in routers + experts:
        p.requires_grad_(True)
    return routers, experts


def lr_at(step: int, cfg: FinetuneConfig) -> float:
    """Linear warm-up to `lr`, then cosine decay to `min_lr_ratio * lr` at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    t = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def batch_rows(tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int, step: int,
               rank: int = 0, world_size: int = 1) -> torch.Tensor:
    """Rows [rank*B/W, (rank+1)*B/W) of global batch `step`: [B/W, S+1] windows of the stream."""
    n = tokens.numel() - seq_len - 1
    if n < 1:
        raise ValueError(f"the data hold {tokens.numel()} tokens, too few for seq_len={seq_len}")
    if batch_size % world_size:
        raise ValueError(f"the global batch size {batch_size} is not divisible by the {world_size} ranks")
    g = torch.Generator().manual_seed((int(seed) * 1_000_003 + int(step)) % (2**63 - 1))
    start = torch.randint(0, n + 1, (batch_size,), generator=g)
    per = batch_size // world_size
    start = start[rank * per : (rank + 1) * per]
    return tokens[start[:, None] + torch.arange(seq_len + 1)[None, :]]


def tokenize_texts(texts: list[str], model_dir: str | os.PathLike, vocab_size: int) -> tuple[torch.Tensor, str]:
    """(1-D token ids, how): the model's own tokenizer when `model_dir` has one (documents joined by
    its EOS token), else the UTF-8 bytes as ids 0-255 (needs `vocab_size` >= 256)."""
    d = Path(model_dir)
    if any((d / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(d))
        sep = [tok.eos_token_id] if tok.eos_token_id is not None else []
        ids = [i for t in texts for i in tok(t, add_special_tokens=False)["input_ids"] + sep]
        return torch.tensor(ids, dtype=torch.int64), f"the model's tokenizer {type(tok).__name__}"
    if vocab_size < 256:
        raise ValueError(f"{d} has no tokenizer and its vocabulary ({vocab_size}) is too small for UTF-8 bytes: give token ids (--data)")
    data = b"\n".join(t.encode("utf-8") for t in texts)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64), "no tokenizer in the model directory: UTF-8 bytes as ids"


def _autocast(device: torch.device, precision: str):
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _clip(routers: list[nn.Parameter], experts: list[nn.Parameter], groups: Groups | None, max_norm: float) -> torch.Tensor:
    """Scale every trained gradient by min(1, max_norm / global norm); return the global norm."""
    sq = [sum((p.grad.detach().float().pow(2).sum() for p in ps if p.grad is not None),
              torch.zeros((), device=experts[0].device)) for ps in (routers, experts)]
    if groups is not None and groups.ep_size > 1:
        dist.all_reduce(sq[1], group=groups.ep)
    total = (sq[0] + sq[1]).sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in routers + experts:
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.dtype))
    return total


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
) -> FinetuneResult:
    """Fine-tune the routers and experts of a converted `model` on windows of `tokens` (1-D ids).

    `groups` (from `setup_groups`): train on every rank of the world; the model converted over
    `groups.ep` (`load_sharded(..., group=groups.ep)`). Rank 0 draws the progress bar (loss,
    tokens/s). Returns every step's global-batch loss.

    `checkpoint_dir` (the run directory): write a sharded checkpoint there every `save_every`
    steps and at the end (with `save_every=0` only when stopping early;
    `occult.integrations.hf.checkpoint`); `resume=True` continues the one
    it holds (it must be of this model, expert count, routing, settings and data), and without
    it an existing checkpoint is an error. Batches depend on (seed, step) alone, so a resumed run
    continues exactly as the uninterrupted one. `stop_after=n`: return after n more steps.
    """
    from tqdm.auto import tqdm

    W, rank = (groups.world_size, groups.rank) if groups is not None else (1, 0)
    main = rank == 0
    if cfg.batch_size % W:
        raise ValueError(f"--batch-size {cfg.batch_size} (the global batch) is not divisible by the {W} ranks")
    vocab = int(model.config.vocab_size)
    if tokens.dim() != 1 or tokens.numel() < cfg.seq_len + 2:
        raise ValueError(f"need a 1-D token stream of more than seq_len + 1 = {cfg.seq_len + 1} ids, got {list(tokens.shape)}")
    if int(tokens.max()) >= vocab or int(tokens.min()) < 0:
        raise ValueError(f"the data hold token ids outside the model's vocabulary [0, {vocab})")
    routers, experts = trainable_parameters(model)
    sharded = max(b.experts.num_ranks for b in model.modules() if isinstance(b, OccultMoeBlock))
    if groups is None and sharded > 1:
        raise ValueError(f"the experts are sharded over {sharded} ranks: pass groups=setup_groups(...) (the gradient sync)")
    if groups is not None and sharded != groups.ep_size:
        raise ValueError(f"the experts are sharded over {sharded} ranks, the EP size is {groups.ep_size}: convert over groups.ep")
    device = experts[0].device
    net: nn.Module = model
    if groups is not None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        # DDP must touch neither the experts (each rank its own) nor any buffer (e.g. `local_expert_ids`
        # differ per rank): ignore both; it then all-reduces exactly the routers' gradients.
        expert_ids = {id(p) for p in experts}
        ignore = [n for n, p in model.named_parameters() if id(p) in expert_ids] + [n for n, _ in model.named_buffers()]
        DDP._set_params_and_buffers_to_ignore_for_model(model, ignore)
        net = DDP(model, process_group=groups.ddp, init_sync=False,
                  device_ids=[device.index] if device.type == "cuda" else None)
    if log is not None and main:
        n_r, n_e = sum(p.numel() for p in routers), sum(p.numel() for p in experts)
        log(f"training {n_r:,} router and {n_e:,} expert parameters on rank 0 (everything else frozen)")
    opt = torch.optim.AdamW(routers + experts, lr=cfg.lr, betas=(0.9, 0.95), eps=cfg.adam_eps,
                            weight_decay=cfg.weight_decay)
    start, losses, norms, pending = 0, [], [], []
    if checkpoint_dir is not None:  # resume state: occult.integrations.hf.checkpoint
        sig = ckpt.signature(model, tokens, vars(cfg))
        found = ckpt.find_state(checkpoint_dir)
        if found is not None and not resume:
            raise ckpt.FinetuneCheckpointError(f"{checkpoint_dir} already holds a checkpoint ({found.name}): resume it "
                                               "(--resume) or choose another --out")
        if found is not None:
            doc = ckpt.read_meta(found)
            ckpt.check_signature(doc.get("signature", {}), sig, str(found))
            ckpt.load_state(found, doc, model, opt)
            start, losses, norms = int(doc["step"]), list(doc["losses"]), list(doc["grad_norms"])
            if log is not None and main:
                log(f"resumed {found} at step {start}")
    elif resume:
        raise ValueError("resume=True needs checkpoint_dir (the run directory)")
    last = cfg.steps if stop_after is None else min(cfg.steps, start + int(stop_after))

    def flush() -> None:
        if pending:
            t = torch.stack(pending).float()
            if groups is not None:
                dist.all_reduce(t, group=groups.ddp)
                t /= W
            losses.extend(t.tolist())
            pending.clear()

    def save(step: int) -> None:
        flush()
        ckpt.save_state(checkpoint_dir, model, opt, step, {"signature": sig, "losses": losses,
                                                            "grad_norms": [float(n) for n in norms]})

    taps = RouterTaps(model) if cfg.aux_loss_coef > 0 else None
    if taps is not None and log is not None and main:
        log(f"load-balancing loss: {taps.formula} formula, weight {cfg.aux_loss_coef:g}, over the global batch")
    model.train()
    bar = tqdm(total=cfg.steps, initial=start, desc="finetune (routers + experts)", unit="step", dynamic_ncols=True,
               disable=((not progress) if progress is not None else None) if main else True)  # None: only on a terminal
    t0 = t_last = time.perf_counter()
    s_last, tokens_per_step = start, cfg.batch_size * cfg.seq_len
    try:
        for step in range(start, last):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, cfg)
            win = batch_rows(tokens, cfg.batch_size, cfg.seq_len, cfg.seed, step, rank, W).to(device)
            x, y = win[:, :-1], win[:, 1:]
            with _autocast(device, cfg.precision):
                logits = net(input_ids=x, use_cache=False).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
            aux = taps.loss(groups.ddp if groups is not None else None) if taps is not None else None
            opt.zero_grad(set_to_none=True)
            (loss if aux is None else loss + cfg.aux_loss_coef * aux).backward()  # DDP: routers averaged when it returns
            if groups is not None:
                for p in experts:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    if groups.replicas > 1:
                        dist.all_reduce(p.grad, group=groups.replica)
                    p.grad.div_(W)
            norms.append(_clip(routers, experts, groups, cfg.grad_clip))
            opt.step()
            pending.append(loss.detach())
            bar.update(1)
            if (step + 1) % 10 == 0 or step + 1 == cfg.steps:
                flush()
                if not math.isfinite(losses[-1]):
                    raise FloatingPointError(f"the loss is {losses[-1]} at step {step + 1}; lower the learning rate")
                now = time.perf_counter()
                tps = tokens_per_step * (step + 1 - s_last) / max(1e-9, now - t_last)
                t_last, s_last = now, step + 1
                bar.set_postfix({"loss": f"{losses[-1]:.4f}", "tok/s": f"{tps:,.0f}", "gnorm": f"{float(norms[-1]):.2f}"},
                                refresh=False)
            if checkpoint_dir is not None and save_every and (step + 1) % save_every == 0 and step + 1 < last:
                save(step + 1)
    finally:
        bar.close()
        if taps is not None:
            taps.close()
    flush()
    if checkpoint_dir is not None and last > start and (save_every or last < cfg.steps):
        save(last)
    model.eval()
    elapsed = time.perf_counter() - t0
    return FinetuneResult(losses, [float(n) for n in norms], tokens_per_step * (last - start) / max(elapsed, 1e-9),
                          sum(p.numel() for p in routers + experts))


__all__ = ["FinetuneConfig", "FinetuneResult", "Groups", "batch_rows", "finetune", "lr_at",
           "setup_groups", "tokenize_texts", "trainable_parameters"]
