"""Training and fine-tuning `OccultLM` on a token stream, with checkpoints that resume exactly.

`train(model, data, config, out_dir)` runs AdamW with linear warm-up then cosine decay to
`min_lr_ratio * lr`, bf16 autocast on GPU (fp32 master weights), gradient clipping, the
load-balancing auxiliary loss (`aux_loss_coef`), validation loss / perplexity (and E[C_T]
when the model has a routing placement) every `eval_every` steps, optional early stop when
validation loss flattens (`patience`), and a tqdm progress bar. `moe_only=True` updates only
the MoE blocks (routers and experts), everything else frozen (the paper's pruning-aware
fine-tuning). `finetune(init, ...)` loads weights, applies a routing rule and trains.
Evaluation (`evaluate`, `pick_device`, `autocast_for`) is in `occult.lm.evaluate`.

Files in `out_dir` (all written atomically):
    checkpoint.safetensors  latest state: `model.*` weights, `optim.<param>.<key>` AdamW state,
                            metadata (model/train config, routing, step, history, data hash)
    best.safetensors        weights at the best validation loss so far
    model.safetensors       final weights (when the run ends)
    metrics.jsonl           one JSON line per evaluation

Resume (`resume=True`): the checkpoint's model config, trajectory-relevant training settings,
routing rule, training data and (for fine-tunes) initial weights must match, or a
`CheckpointError` names what differs. Batches depend only on (seed, step), so a resumed run
continues exactly as the uninterrupted one would have.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
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
from occult.lm.evaluate import autocast_for, evaluate, pick_device
from occult.lm.model import OccultLM

CHECKPOINT = "checkpoint.safetensors"
BEST = "best.safetensors"
FINAL = "model.safetensors"
METRICS = "metrics.jsonl"


@dataclass
class TrainConfig:
    """Optimisation settings. Fields in `LOGGING_FIELDS` may change on resume; the rest may not."""

    steps: int = 2000
    batch_size: int = 32
    seq_len: int = 256
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    aux_loss_coef: float = 0.01
    moe_only: bool = False
    seed: int = 0
    precision: str = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU; or "bf16" / "fp32"
    eval_every: int = 200
    eval_tokens: int | None = 131072
    eval_batch_size: int | None = None
    eval_at_start: bool = False
    save_every: int = 500
    patience: int | None = None  # stop after this many evaluations without improvement
    min_delta: float = 0.001  # relative improvement of val loss that counts
    device: str = "auto"

    LOGGING_FIELDS = ("eval_every", "eval_tokens", "eval_batch_size", "eval_at_start", "save_every", "device", "patience", "min_delta")

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "eval_every", "save_every"):
            if int(getattr(self, name)) < (0 if name in ("eval_every", "save_every") else 1):
                raise ValueError(f"TrainConfig.{name} must be positive, got {getattr(self, name)}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"need lr > 0 and 0 <= min_lr_ratio <= 1, got {self.lr}, {self.min_lr_ratio}")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"precision must be 'auto', 'bf16' or 'fp32', got {self.precision!r}")
        if self.patience is not None and self.patience < 1:
            raise ValueError(f"patience must be >= 1 or None, got {self.patience}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TrainConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass
class TrainResult:
    step: int
    best_val_loss: float | None
    history: list[dict]
    stopped_early: bool
    out_dir: Path

    @property
    def last_eval(self) -> dict | None:
        return self.history[-1] if self.history else None


# ----------------------------------------------------------------- helpers
def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over `warmup_steps`, then cosine from `lr` to `min_lr_ratio * lr` at `steps`."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def tensor_hash(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def trainable_names(model: OccultLM, moe_only: bool) -> list[str]:
    names = model.moe_parameter_names() if moe_only else [n for n, _ in model.named_parameters()]
    if not names:
        raise ValueError("no parameters to train")
    return names


def make_optimizer(model: OccultLM, names: list[str], cfg: TrainConfig) -> torch.optim.AdamW:
    params = dict(model.named_parameters())
    wanted = set(names)
    for n, p in params.items():
        p.requires_grad_(n in wanted)
    decay = [params[n] for n in names if params[n].dim() >= 2 and not n.startswith("embed.")]
    no_decay = [params[n] for n in names if not (params[n].dim() >= 2 and not n.startswith("embed."))]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


def optimizer_tensors(model: OccultLM, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    name_of = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for p, state in opt.state.items():
        for key, v in state.items():
            t = v if isinstance(v, torch.Tensor) else torch.tensor(float(v))
            out[f"optim.{name_of[id(p)]}.{key}"] = t.detach().contiguous().cpu()
    return out


def load_optimizer_tensors(model: OccultLM, opt: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor], source: str) -> None:
    name_of = {id(p): n for n, p in model.named_parameters()}
    sd = opt.state_dict()
    order = [name_of[id(p)] for g in opt.param_groups for p in g["params"]]
    state: dict[int, dict[str, torch.Tensor]] = {}
    for i, name in enumerate(order):
        entry = {k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.startswith(f"optim.{name}.") and k.count(".") == name.count(".") + 2}
        if entry:
            state[i] = entry
    if state and len(state) != len(order):
        raise CheckpointError(f"{source}: optimizer state covers {len(state)} of {len(order)} trained parameters")
    sd["state"] = state
    opt.load_state_dict(sd)


# ------------------------------------------------------------------ training
def _check_resume(meta: Mapping[str, str], model: OccultLM, cfg: TrainConfig, data_sig: str, init_sig: str | None, path: Path) -> None:
    saved_model = config_from_metadata(meta, str(path))
    if saved_model != model.config:
        diffs = [
            f"{k}: checkpoint {getattr(saved_model, k)!r}, now {getattr(model.config, k)!r}"
            for k in model.config.to_dict()
            if getattr(saved_model, k) != getattr(model.config, k)
        ]
        raise CheckpointError(f"{path}: model config mismatch on resume ({'; '.join(diffs)}); use the same settings or another --out")
    saved = json.loads(meta.get("train_config", "{}"))
    now = cfg.to_dict()
    diffs = [
        f"{k}: checkpoint {saved.get(k)!r}, now {now[k]!r}"
        for k in now
        if k not in TrainConfig.LOGGING_FIELDS and saved.get(k) != now[k]
    ]
    if diffs:
        raise CheckpointError(f"{path}: training config mismatch on resume ({'; '.join(diffs)}); use the same settings or another --out")
    if json.loads(meta.get("routing", "null")) != json.loads(model.routing.to_json()):
        raise CheckpointError(f"{path}: routing mismatch on resume: checkpoint {meta.get('routing')}, now {model.routing.to_json()}")
    if meta.get("data_hash") != data_sig:
        raise CheckpointError(f"{path}: the training data differ from the checkpoint's (hash {meta.get('data_hash')} vs {data_sig})")
    if (meta.get("init_hash") or None) != init_sig:
        raise CheckpointError(f"{path}: the run started from other initial weights (init hash {meta.get('init_hash')} vs {init_sig})")


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
) -> TrainResult:
    """Train `model` on `data.train` for `cfg.steps` steps (see the module docstring).

    `stop_after=n` returns after n more steps (checkpoint saved; resume later with
    `resume=True`), e.g. to split a long run into jobs under a time limit.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = pick_device(cfg.device)
    model.to(device)
    if data.vocab_size > model.config.vocab_size:
        raise ValueError(f"the data use {data.vocab_size} token ids, the model's vocab_size is {model.config.vocab_size}")
    names = trainable_names(model, cfg.moe_only)
    opt = make_optimizer(model, names, cfg)
    data_sig = f"{data.train.numel()}:{tensor_hash(data.train)}"
    step, best, history, stopped = 0, None, [], False
    ckpt = out / CHECKPOINT
    if ckpt.exists():
        if not resume:
            raise CheckpointError(f"{out} already holds a checkpoint: pass --resume to continue it, or choose another --out")
        tensors, meta = read_checkpoint(ckpt)
        _check_resume(meta, model, cfg, data_sig, init_hash, ckpt)
        load_weights(model, tensors, str(ckpt))
        load_optimizer_tensors(model, opt, tensors, str(ckpt))
        step = int(meta.get("step", 0))
        best = json.loads(meta.get("best_val_loss", "null"))
        history = json.loads(meta.get("history", "[]"))
        stopped = meta.get("stopped_early") == "true"
        if log:
            log(f"resumed {ckpt} at step {step}")
    eval_bs = cfg.eval_batch_size or cfg.batch_size
    meta_base = dict(extra_metadata or {})
    meta_base.update(train_config=json.dumps(cfg.to_dict()), data_hash=data_sig, init_hash=init_hash or "")

    def save(path: Path, with_optimizer: bool) -> None:
        import safetensors.torch

        tensors = model_tensors(model)
        if with_optimizer:
            tensors.update(optimizer_tensors(model, opt))
        meta = {k: (v if isinstance(v, str) else json.dumps(v)) for k, v in meta_base.items()}
        meta.update(model_metadata(model))
        meta.update(step=str(step), best_val_loss=json.dumps(best), history=json.dumps(history),
                    stopped_early="true" if stopped else "false")
        with atomic_path(path) as tmp:
            safetensors.torch.save_file(tensors, str(tmp), metadata=meta)

    def do_eval(train_loss: float | None = None) -> dict:
        nonlocal best
        r = evaluate(model, data.val, eval_bs, cfg.seq_len, cfg.eval_tokens, cfg.precision)
        r["step"] = step
        if train_loss is not None:
            r["train_loss"] = train_loss
        history.append(r)
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

    if cfg.eval_at_start and step == 0 and not history and cfg.eval_every:
        do_eval()
    from tqdm.auto import tqdm

    bar = tqdm(total=cfg.steps, initial=step, desc="train" if not cfg.moe_only else "finetune (MoE only)",
               unit="step", disable=(not progress) if progress is not None else None, dynamic_ncols=True)
    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    tokens_per_step = cfg.batch_size * cfg.seq_len
    t_last, last_loss = time.perf_counter(), float("nan")
    last_step = cfg.steps if stop_after is None else min(cfg.steps, step + int(stop_after))
    try:
        while step < last_step and not stopped:
            lr = lr_at(step, cfg)
            for g in opt.param_groups:
                g["lr"] = lr
            x, y = train_batch(data.train, cfg.batch_size, cfg.seq_len, cfg.seed, step)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast_for(device, cfg.precision):
                out_ = model(x, y, return_logits=False)
                loss = out_.loss + cfg.aux_loss_coef * out_.aux_loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(trained, cfg.grad_clip) if cfg.grad_clip > 0 else None
            opt.step()
            step += 1
            bar.update(1)
            if step % 10 == 0 or step == cfg.steps:
                last_loss = float(out_.loss.detach())
                if not math.isfinite(last_loss):
                    raise FloatingPointError(f"training loss is {last_loss} at step {step}; lower the learning rate")
                now = time.perf_counter()
                tps = tokens_per_step * 10 / max(1e-9, now - t_last)
                t_last = now
                post = {"loss": f"{last_loss:.3f}", "aux": f"{float(out_.aux_loss.detach()):.3f}", "lr": f"{lr:.2e}", "tok/s": f"{tps:,.0f}"}
                if gnorm is not None:
                    post["gnorm"] = f"{float(gnorm):.2f}"
                if history:
                    post["val"] = f"{history[-1]['val_loss']:.3f}"
                bar.set_postfix(post, refresh=False)
            if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
                do_eval(float(out_.loss.detach()))
                if plateaued():
                    stopped = True
                    if log:
                        log(f"validation loss flat for {cfg.patience} evaluations: stopping at step {step}")
            if cfg.save_every and (step % cfg.save_every == 0 or step == cfg.steps or stopped):
                save(out / CHECKPOINT, with_optimizer=True)
    finally:
        bar.close()
    save(out / CHECKPOINT, with_optimizer=True)
    if step >= cfg.steps or stopped:
        save(out / FINAL, with_optimizer=False)
    return TrainResult(step, best, history, stopped, out)


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
) -> tuple[OccultLM, TrainResult]:
    """Load `init`'s weights (its routing rule is ignored), set the routing rule, train."""
    tensors, meta = read_checkpoint(init, prefixes=("model.",))
    model = OccultLM(config_from_metadata(meta, str(init)))
    load_weights(model, tensors, str(init))
    model.set_routing(max_devices, placement, method, similarity)
    init_sig = hashlib.sha256(b"".join(tensor_hash(tensors[k]).encode() for k in sorted(tensors))).hexdigest()[:16]
    result = train(model, data, cfg, out_dir, resume=resume, stop_after=stop_after, progress=progress, init_hash=init_sig,
                   extra_metadata={"init": str(init)}, log=log)
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
]
