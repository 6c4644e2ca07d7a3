"""The settings and the result of `occult.integrations.hf.finetune` (fine-tuning a converted transformers
MoE model's routers and experts): `FinetuneConfig` (AdamW, schedule, precision, recipes), `FinetuneResult`,
and `lr_at`, the learning rate of a step."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from occult.training.distill import TRAIN_PARTS
from occult.training.schedule import CosineSchedule
from occult.training.step_profile import parse_window


@dataclass
class FinetuneConfig:
    """Optimisation settings of `finetune` (AdamW, linear warm-up then cosine to `min_lr_ratio * lr`)."""

    steps: int = 100
    batch_size: int = 8  # global rows per step (divisible by the world size)
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
    distill_weight: float = 0.0  # W > 0: + W * T^2 * KL(teacher || model) of the logits, teacher = standard routing
    distill_temperature: float = 1.0  # T
    train_part: str = "both"  # what trains: "routers", "experts" or "both"
    distill_from: str | None = None  # the teacher's directory (e.g. the standard fine-tune): pass its model as teacher=
    profile_steps: str | None = None  # "A:B": profile steps A..B into checkpoint_dir (else the working directory)
    layer_graphs: bool = False  # MoE layer calls, training ones too, replayed from CUDA graphs (occult.moe.graphs)
    captured_step: bool = False  # the whole step recorded as one CUDA graph and replayed (training.step_graph)
    two_batch: bool = False  # each step's loss and backward as two interleaved micro-batches (training.two_batch)
    micro_batches: int = 1  # each rank's rows of a step as this many micro-batches, gradients accumulated
    pair_micro_batches: bool = False  # those paired: a forward beside the previous one's backward (combined 1F1B)

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1 or self.warmup_steps < 0:
            raise ValueError(
                "need lr > 0, 0 <= min_lr_ratio <= 1, warmup >= 0; "
                f"got {self.lr}, {self.min_lr_ratio}, {self.warmup_steps}"
            )
        if self.aux_loss_coef < 0:
            raise ValueError(f"aux_loss_coef must be >= 0, got {self.aux_loss_coef}")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"precision must be 'auto', 'bf16' or 'fp32', got {self.precision!r}")
        if self.distill_weight < 0 or self.distill_temperature <= 0:
            raise ValueError(
                f"need distill_weight >= 0 and distill_temperature > 0, got {self.distill_weight}, "
                f"{self.distill_temperature}"
            )
        if self.train_part not in TRAIN_PARTS:
            raise ValueError(f"train_part must be one of {', '.join(TRAIN_PARTS)}, got {self.train_part!r}")
        parse_window(self.profile_steps) if self.profile_steps else None  # a clear error for a bad window
        if self.micro_batches < 1 or (self.pair_micro_batches and self.micro_batches < 2):
            raise ValueError(f"micro_batches must be >= 1 (>= 2 with pair_micro_batches), got {self.micro_batches}")

    def signature_settings(self) -> dict:
        """The settings a resumed run must share; the recipe options only when not at their defaults
        (checkpoints written before they existed hold none of them)."""
        recipe = (
            "distill_weight",
            "distill_temperature",
            "train_part",
            "distill_from",
            "two_batch",
            "micro_batches",
            "pair_micro_batches",
        )
        default = {f.name: f.default for f in fields(self) if f.name in recipe}
        how = ("profile_steps", "layer_graphs", "captured_step")  # how the run executes, not what it computes
        return {k: v for k, v in vars(self).items() if (k not in default or v != default[k]) and k not in how}


@dataclass
class FinetuneResult:
    losses: list[float]  # per step, mean over the global batch
    grad_norms: list[float] = field(default_factory=list)
    tokens_per_s: float = 0.0  # global tokens per second over the whole run
    trained_parameters: int = 0  # on this rank


def lr_at(step: int, cfg: FinetuneConfig) -> float:
    """Linear warm-up to `lr`, then cosine decay to `min_lr_ratio * lr` at the last step."""
    return CosineSchedule(cfg.lr, cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio)(step)


__all__ = ["FinetuneConfig", "FinetuneResult", "lr_at"]
