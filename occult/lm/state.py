"""Training state of `OccultLM`: settings, schedule, optimizer and its tensors, resume checks.

`TrainConfig` (optimisation settings), `TrainResult`, `lr_at` / `schedule_for` (warm-up then
cosine, `occult.training.schedule`; extended when a resumed run gets more steps),
`make_optimizer` (AdamW, no decay on norms and embeddings), `optimizer_tensors` /
`load_optimizer_tensors` (AdamW state as `optim.<param>.<key>` tensors, the layout both the
safetensors and the sharded checkpoints use) and `check_resume` (what must match to continue a
run; `steps` may grow). The loop is `occult.training.loop`, driven by `occult.lm.train`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from occult.lm.checkpoint import CheckpointError, config_from_metadata
from occult.lm.distill import TRAIN_PARTS, part_names
from occult.lm.model import OccultLM
from occult.placement.solvers import METHODS
from occult.training.dcp import load_optimizer_state
from occult.training.dtensor import is_sharded
from occult.training.optim import adamw
from occult.training.schedule import CosineSchedule
from occult.training.step_profile import parse_window

GRAD_SYNCS = ("ddp", "explicit", "overlap", "fsdp")  # how the dense gradients of N ranks are synchronised
FSDP_RESHARDS = ("after-backward", "after-forward")  # when FSDP2 frees a block's gathered dense weights
FSDP_UNITS = ("block", "model")  # what one FSDP2 unit holds: a decoder block's dense weights, or all of them


@dataclass
class TrainConfig:
    """Optimisation settings. Fields in `LOGGING_FIELDS` may change on resume, and `steps` (the
    learning-rate schedule is then extended: `occult.training.schedule`); the rest may not.

    (`grad_sync` may change: DDP, the explicit all-reduce and FSDP2 give the same gradients up to rounding.)"""

    steps: int = 2000
    batch_size: int = 32
    seq_len: int = 256
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
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
    # re-placing experts while training (occult.lm.replace; N ranks with EP size >= 2)
    replace_every: int = 0  # solve a new placement every this many steps (0 = never)
    replace_min_gain: float = 0.02  # migrate only if the sample's E[C_T] drops by this fraction
    replace_drift: float = (
        0.0  # also solve when E[C_T] rises this fraction above its level after the last decision (0 = off)
    )
    replace_check_every: int = 10  # steps between E[C_T] measurements / solver polls (one small collective each)
    replace_samples: int = 2048  # routed tokens per layer and rank kept for the next solve
    replace_method: str = "auto"  # placement solver: auto (hypergraph if Mt-KaHyPar is installed, else greedy), ...
    replace_wait: bool = False  # solve inline (training waits; deterministic) instead of in a background process
    profile_steps: str | None = None  # "A:B": profile steps A..B (occult.training.step_profile); None = off
    layer_graphs: bool = False  # MoE layer calls replayed from CUDA graphs, training ones too (occult.moe.graphs)
    captured_step: bool = False  # the whole step recorded as one CUDA graph and replayed (training.step_graph)
    two_batch: bool = False  # loss and backward as two interleaved micro-batches (training.two_batch)
    micro_batches: int = 1  # each rank's rows of a step as this many micro-batches, gradients accumulated
    pair_micro_batches: bool = False  # those paired: a forward beside the previous one's backward (combined 1F1B)
    # N ranks: dense gradients by torch DDP (overlapped with backward), "explicit" (after it), "overlap" (explicit,
    # in buckets during the backward: recordable), or "fsdp" (sharded)
    grad_sync: str = "ddp"
    # with "fsdp": a block's gathered dense weights freed after its backward (kept from its forward: no second
    # all-gather) or after its forward (gathered again for the backward: less memory; occult.lm.fsdp)
    fsdp_reshard: str = "after-backward"
    # with "fsdp": a unit per decoder block (all-gathers and reduce-scatters beside the compute) or one for the
    # whole model (one all-gather before the forward, one reduce-scatter after the backward: the least host work)
    fsdp_units: str = "block"
    # pruning-aware fine-tuning recipes (occult.lm.distill)
    distill_weight: float = 0.0  # > 0: + W * T^2 * KL(unpruned teacher || pruned student) of the logits
    distill_temperature: float = 1.0
    distill_from: str | None = (
        None  # teacher checkpoint (e.g. the standard fine-tune); None: own weights, standard routing
    )
    train_part: str | None = None  # "routers" | "experts" | "both" (the MoE blocks); None: moe_only decides

    LOGGING_FIELDS = (
        "eval_every",
        "eval_tokens",
        "eval_batch_size",
        "eval_at_start",
        "save_every",
        "device",
        "patience",
        "min_delta",
        "grad_sync",
        "fsdp_reshard",
        "fsdp_units",
        "profile_steps",
        "layer_graphs",
        "captured_step",
    )

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
        if self.replace_every < 0 or self.replace_drift < 0 or not 0 <= self.replace_min_gain < 1:
            raise ValueError(
                f"need replace_every >= 0, replace_drift >= 0, 0 <= replace_min_gain < 1; got "
                f"{self.replace_every}, {self.replace_drift}, {self.replace_min_gain}"
            )
        if self.replace_check_every < 1 or self.replace_samples < 1:
            raise ValueError(
                f"replace_check_every and replace_samples must be >= 1, got "
                f"{self.replace_check_every}, {self.replace_samples}"
            )
        if self.profile_steps:
            parse_window(self.profile_steps)
        if self.micro_batches < 1 or (self.pair_micro_batches and self.micro_batches < 2):
            raise ValueError(f"micro_batches must be >= 1 (>= 2 with pair_micro_batches), got {self.micro_batches}")
        if self.grad_sync not in GRAD_SYNCS:
            raise ValueError(f"grad_sync must be one of {GRAD_SYNCS}, got {self.grad_sync!r}")
        if self.fsdp_reshard not in FSDP_RESHARDS:
            raise ValueError(f"fsdp_reshard must be one of {FSDP_RESHARDS}, got {self.fsdp_reshard!r}")
        if self.fsdp_units not in FSDP_UNITS:
            raise ValueError(f"fsdp_units must be one of {FSDP_UNITS}, got {self.fsdp_units!r}")
        if self.fsdp_units == "model" and self.fsdp_reshard == "after-forward":
            raise ValueError(
                "fsdp_reshard='after-forward' frees a block's weights between its forward and backward, which one "
                "unit for the whole model never does (its weights stay gathered until the backward ends): use "
                "fsdp_units='block' with it"
            )
        if self.distill_weight < 0 or self.distill_temperature <= 0:
            raise ValueError(
                f"need distill_weight >= 0 and distill_temperature > 0, got {self.distill_weight}, "
                f"{self.distill_temperature}"
            )
        if self.distill_from is not None and not self.distill_weight:
            raise ValueError("distill_from (a teacher checkpoint) needs distill_weight > 0")
        if self.train_part not in (None, *TRAIN_PARTS):
            raise ValueError(f"train_part must be None or one of {TRAIN_PARTS}, got {self.train_part!r}")
        if self.replace_method not in ("auto", *METHODS):
            raise ValueError(f"replace_method must be 'auto' or one of {METHODS}, got {self.replace_method!r}")

    @property
    def replaces(self) -> bool:
        """Whether experts are re-placed while training (`occult.lm.replace`)."""
        return bool(self.replace_every or self.replace_drift)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass
class TrainResult:
    step: int
    best_val_loss: float | None
    history: list[dict]
    stopped_early: bool
    out_dir: Path
    train_losses: list[float] = field(default_factory=list)  # every step's training loss (global batch)
    migrations: list[dict] = field(default_factory=list)  # expert re-placements done (occult.lm.replace)

    @property
    def last_eval(self) -> dict | None:
        return self.history[-1] if self.history else None


# ----------------------------------------------------------------- helpers
def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over `warmup_steps`, then cosine from `lr` to `min_lr_ratio * lr` at `steps`."""
    return schedule_for(cfg)(step)


def schedule_for(cfg: TrainConfig, meta: Mapping[str, str] | None = None) -> CosineSchedule:
    """The schedule of `cfg`; with a checkpoint's metadata, the checkpoint's schedule continued from its
    step to `cfg.steps` (the rate at the resume step kept, then a cosine to the floor at the new end)."""
    schedule = CosineSchedule(cfg.lr, cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio)
    if meta is None:
        return schedule
    saved = json.loads(meta.get("train_config", "{}")).get("steps", cfg.steps)
    return schedule.resumed(json.loads(meta.get("lr_schedule", "null")), saved, int(meta.get("step", 0)))


def tensor_hash(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def trainable_names(model: OccultLM, moe_only: bool, part: str | None = None) -> list[str]:
    """What trains: `part` of the MoE blocks (`occult.lm.distill.part_names`), else the MoE blocks
    (`moe_only`), else everything."""
    if part is not None:
        names = part_names(model, part)
    else:
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
    groups = []
    for members, weight_decay in ((decay, cfg.weight_decay), (no_decay, 0.0)):
        # FSDP-sharded (DTensor) and plain (expert) parameters in groups of their own: on CUDA,
        # AdamW's foreach and fused kernels refuse a list that mixes the two
        for sharded in (False, True):
            part = [p for p in members if is_sharded(p) == sharded]
            if part:
                groups.append({"params": part, "weight_decay": weight_decay})
    return adamw(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps)


def optimizer_tensors(model: OccultLM, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    name_of = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for p, state in opt.state.items():
        for key, v in state.items():
            t = v if isinstance(v, torch.Tensor) else torch.tensor(float(v))
            out[f"optim.{name_of[id(p)]}.{key}"] = t.detach().contiguous().cpu()
    return out


def load_optimizer_tensors(
    model: OccultLM, opt: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor], source: str
) -> None:
    """Put `optim.<name>.<key>` tensors (full, or this rank's experts) into `opt`."""
    load_optimizer_state(opt, dict(model.named_parameters()), tensors, CheckpointError, source)


# ------------------------------------------------------------------ resume
def check_resume(
    meta: Mapping[str, str], model: OccultLM, cfg: TrainConfig, data_sig: str, init_sig: str | None, path: Path
) -> None:
    saved_model = dataclasses.replace(
        config_from_metadata(meta, str(path)),
        transport=model.config.transport,
        expert_backend=model.config.expert_backend,
    )
    if (
        saved_model != model.config
    ):  # (the transport and the expert kernels are how it runs, not the model: they may change)
        diffs = [
            f"{k}: checkpoint {getattr(saved_model, k)!r}, now {getattr(model.config, k)!r}"
            for k in model.config.to_dict()
            if getattr(saved_model, k) != getattr(model.config, k)
        ]
        raise CheckpointError(
            f"{path}: model config mismatch on resume ({'; '.join(diffs)}); use the same settings or another --out"
        )
    saved = json.loads(meta.get("train_config", "{}"))
    now = cfg.to_dict()
    default = TrainConfig().to_dict()  # a field newer than the checkpoint had its default then
    diffs = [
        f"{k}: checkpoint {saved.get(k, default[k])!r}, now {now[k]!r}"
        for k in now
        if k not in (*TrainConfig.LOGGING_FIELDS, "steps") and saved.get(k, default[k]) != now[k]
    ]
    if diffs:
        raise CheckpointError(
            f"{path}: training config mismatch on resume ({'; '.join(diffs)}); use the same settings or another --out"
        )
    at = int(meta.get("step", 0))
    if cfg.steps < at:
        raise CheckpointError(
            f"{path}: the checkpoint is at step {at}, past --steps {cfg.steps}; pass --steps {at} or more "
            "to continue it (a larger value continues training)"
        )
    if json.loads(meta.get("routing", "null")) != json.loads(model.routing.to_json()):
        raise CheckpointError(
            f"{path}: routing mismatch on resume: checkpoint {meta.get('routing')}, now {model.routing.to_json()}"
        )
    if meta.get("data_hash") != data_sig:
        raise CheckpointError(
            f"{path}: the training data differ from the checkpoint's (hash {meta.get('data_hash')} vs {data_sig})"
        )
    if (meta.get("init_hash") or None) != init_sig:
        raise CheckpointError(
            f"{path}: the run started from other initial weights (init hash {meta.get('init_hash')} vs {init_sig})"
        )
