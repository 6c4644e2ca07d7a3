"""One training run of `OccultLM` (`occult.lm.train`): its files, its state besides the step loop's
(best validation loss, evaluation history, optimizer, re-placement), its evaluations and its saves.

    TrainRun      the model, data, settings and state of one `train` call; `save` writes a weights file
                  or the resume state (sharded on N ranks), `evaluate` one line of metrics.jsonl
    EvalAndSave   the hook that evaluates every `eval_every` steps (early stop on a plateau) and
                  saves the resume state every `save_every`
    latest_state  the newest resume state in a run directory
    peak_memory   this rank's peak GPU memory so far (allocated and reserved), for metrics.jsonl
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from occult._atomic import atomic_path
from occult.lm.checkpoint import model_metadata, model_tensors, read_checkpoint
from occult.lm.data import TokenData
from occult.lm.evaluate import evaluate
from occult.lm.fsdp import reshard
from occult.lm.model import OccultLM
from occult.lm.parallel import Parallel, gathered_tensors
from occult.lm.replace import Replacer
from occult.lm.sharded import find_sharded, read_sharded_meta, save_sharded
from occult.lm.state import TrainConfig, optimizer_tensors
from occult.training.hooks import StepHook
from occult.training.loop import TrainLoop
from occult.training.schedule import CosineSchedule

CHECKPOINT = "checkpoint.safetensors"
BEST = "best.safetensors"
FINAL = "model.safetensors"
METRICS = "metrics.jsonl"
PLOT = "loss.png"


def peak_memory(device: torch.device) -> dict[str, float]:
    """This rank's peak GPU memory so far, GiB: what tensors held (`peak_memory_gib`) and what the allocator
    held (`peak_reserved_gib`: cached blocks too, a CUDA graph pool's free ones among them: what the card must
    have); empty off a GPU."""
    if device.type != "cuda":
        return {}
    return {
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
    }


def latest_state(out: Path) -> tuple[str, Path, Mapping[str, Any]] | None:
    """("dcp" | "safetensors", path, metadata) of the newest resume state in `out`, or None."""
    found = []
    sharded = find_sharded(out)
    if sharded is not None:
        found.append(("dcp", sharded, read_sharded_meta(sharded)))
    if (out / CHECKPOINT).exists():
        found.append(("safetensors", out / CHECKPOINT, read_checkpoint(out / CHECKPOINT, prefixes=())[1]))
    return max(found, key=lambda f: int(f[2].get("step", 0)), default=None)


@dataclass
class TrainRun:
    """One `train` call's model, settings and the state its checkpoints carry besides the loop's."""

    model: OccultLM
    data: TokenData
    cfg: TrainConfig
    out: Path
    par: Parallel | None
    log: Callable[[str], None] | None
    opt: torch.optim.Optimizer
    replacer: Replacer | None
    meta_base: dict[str, Any]
    schedule: CosineSchedule
    best: float | None = None
    history: list[dict] = field(default_factory=list)
    saved_at: int = -1
    loop: TrainLoop | None = None

    @property
    def main(self) -> bool:
        return self.par is None or self.par.is_main

    def metadata(self) -> dict[str, str]:
        loop = self.loop
        meta = {k: (v if isinstance(v, str) else json.dumps(v)) for k, v in self.meta_base.items()}
        meta.update(model_metadata(self.model))
        meta.update(
            step=str(loop.step),
            best_val_loss=json.dumps(self.best),
            history=json.dumps(self.history),
            stopped_early="true" if loop.stopped else "false",
            train_losses=json.dumps(loop.losses),
        )
        if self.schedule.restarts:  # extended on a resume with more steps
            meta["lr_schedule"] = json.dumps(self.schedule.to_json())
        if self.replacer is not None:
            meta["replace"] = json.dumps(self.replacer.state())
        return meta

    def save(self, path: Path, with_optimizer: bool) -> None:
        """A weights file (`with_optimizer=False`) or the resume state: sharded on N ranks (once per step)."""
        import safetensors.torch

        meta = self.metadata()
        if self.par is not None and with_optimizer:
            if self.saved_at != self.loop.step:
                save_sharded(self.out, self.model, self.opt, meta, self.loop.step)
                self.saved_at = self.loop.step
            return
        tensors = gathered_tensors(self.model) if self.par is not None else model_tensors(self.model)
        if with_optimizer:
            tensors.update(optimizer_tensors(self.model, self.opt))
        if self.main:
            with atomic_path(path) as tmp:
                safetensors.torch.save_file(tensors, str(tmp), metadata=meta)

    def evaluate(self, train_loss: float | None = None) -> dict:
        """Validation loss (one line of metrics.jsonl, with the training tokens/s since the last one)."""
        cfg, par = self.cfg, self.par
        steps, seconds = self.loop.clock.take()
        rate = {}
        if steps and seconds > 0:  # the losses read back before an evaluation synchronised the device
            tps = steps * cfg.batch_size * cfg.seq_len / seconds
            rate = {"train_tokens_per_s": tps, "train_tokens_per_s_per_rank": tps / (par.world_size if par else 1)}
        r = evaluate(
            self.model,
            self.data.val,
            cfg.eval_batch_size or cfg.batch_size,
            cfg.seq_len,
            cfg.eval_tokens,
            cfg.precision,
            parallel=par,
        )
        reshard(self.model)  # FSDP: the root's weights back to shards after a forward without backward
        r["step"] = self.loop.step
        r.update(rate)
        r.update(peak_memory(next(self.model.parameters()).device))
        if train_loss is not None:
            r["train_loss"] = train_loss
        self.history.append(r)
        if self.main:
            with open(self.out / METRICS, "a") as f:
                f.write(json.dumps(r) + "\n")
        r["improved"] = self.best is None or r["val_loss"] < self.best * (1 - cfg.min_delta)
        if self.best is None or r["val_loss"] < self.best:
            self.best = r["val_loss"]
            self.save(self.out / BEST, with_optimizer=False)
        else:
            r["improved"] = False
        self.loop.postfix["val"] = f"{r['val_loss']:.3f}"
        return r

    def plateaued(self) -> bool:
        p = self.cfg.patience
        if p is None or len(self.history) <= p:
            return False
        return not any(h.get("improved") for h in self.history[-p:])


class EvalAndSave(StepHook):
    """Evaluation every `eval_every` steps (early stop on a plateau), resume state every `save_every`."""

    def __init__(self, run: TrainRun) -> None:
        self.run = run

    def after_step(self, step: int, optimizer: torch.optim.Optimizer | None) -> None:
        run, cfg, loop = self.run, self.run.cfg, self.run.loop
        if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
            run.evaluate(loop.flush())
            if run.plateaued():
                loop.stop()
                if run.log:
                    run.log(f"validation loss flat for {cfg.patience} evaluations: stopping at step {step}")
        if cfg.save_every and (step % cfg.save_every == 0 or step == cfg.steps or loop.stopped):
            loop.flush()
            loop.clock.pause()
            run.save(run.out / CHECKPOINT, with_optimizer=True)


__all__ = ["BEST", "CHECKPOINT", "FINAL", "METRICS", "PLOT", "EvalAndSave", "TrainRun", "latest_state"]
