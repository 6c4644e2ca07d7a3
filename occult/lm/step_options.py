"""How a run's steps execute, and what each way needs, checked before any step (`occult.lm.train._prepare`).

- `layer_graphs`: every MoE layer's calls, training ones too, replayed from CUDA graphs (`occult.moe.graphs`);
- `captured_step`: the whole step recorded as one CUDA graph (`occult.training.step_graph`);
- `two_batch`: the loss and backward as two interleaved micro-batches (`occult.training.two_batch`), the
  expert-parallel layers switched to sync-free dispatch (exact; worst-case buffers, no host wait);
- `micro_batches`: each rank's rows of a step as K micro-batches, gradients accumulated in turn or, with
  `pair_micro_batches`, paired (combined 1F1B: `occult.training.accumulation`; sync-free layers too);
  `unsynced_context`: where their data-parallel hooks hold the gradients back.

Each check raises a `ValueError` naming the setting and what to change, the same on every rank (all read the
same config), before anything is written.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from occult.lm.fsdp import gradient_sync_off, is_fsdp
from occult.lm.model import OccultLM
from occult.lm.parallel import Parallel
from occult.lm.state import TrainConfig
from occult.moe.model_layers import set_graphs, set_sync_free
from occult.training.accumulation import check_paired
from occult.training.bucketed_sync import BucketedSync
from occult.training.layer_graphs import check_recordable
from occult.training.step_graph import check_capturable
from occult.training.two_batch import check_two_batch


def apply_layer_graphs(model: OccultLM, cfg: TrainConfig) -> None:
    """`layer_graphs`: every MoE layer's calls replayed from CUDA graphs where they can be recorded
    (`occult.training.layer_graphs.check_recordable`: a `ValueError` before any step); left on after the run, as
    the model's other settings are."""
    if cfg.layer_graphs:
        check_recordable(model)
        set_graphs(model, True, training=True)


def check_captured_step(model: OccultLM, cfg: TrainConfig, par: Parallel | None) -> None:
    """`captured_step`: what the training core cannot record (`check_capturable`), and this adapter's parts a
    replayed step would skip: DDP's reducer (its host bookkeeping; the explicit sync is recorded) and
    re-placement (it moves experts between steps)."""
    if not cfg.captured_step:
        return
    if par is not None and cfg.grad_sync == "ddp":
        raise ValueError(
            "captured_step (--captured-step) on several ranks: DDP's reducer keeps host state a replayed step "
            "would skip; use --grad-sync explicit, overlap or fsdp (their collectives are recorded with the step)"
        )
    if cfg.replaces:
        raise ValueError(
            "captured_step (--captured-step) with re-placement (--replace-every / --replace-drift): a migration "
            "moves experts between steps, which a recorded step cannot follow; drop one of them"
        )
    check_capturable(model)


def prepare_two_batch(model: OccultLM, cfg: TrainConfig, par: Parallel | None) -> None:
    """`two_batch`: refused with what it cannot run beside (DDP's or FSDP2's hooks, which expect one forward per
    backward; layer graphs, whose recorded calls two halves in flight would share; re-placement, whose routing
    samples and migrations assume one forward; distillation, whose teacher runs its own forward), and for an odd
    per-rank batch; then every expert-parallel layer sync-free (what two exchanges in flight need)."""
    if not cfg.two_batch:
        return
    _refuse_beside_threads(cfg, par, "two_batch (--two-batch)", "two halves make two")
    rows = cfg.batch_size // (par.world_size if par is not None else 1)
    if rows % 2:
        raise ValueError(
            f"two_batch (--two-batch) splits each rank's {rows} rows of the batch in halves: give a --batch-size "
            "that is an even number of rows per rank"
        )
    set_sync_free(model)
    check_two_batch(model, rows)


def prepare_micro_batches(model: OccultLM, cfg: TrainConfig, par: Parallel | None) -> None:
    """`micro_batches` > 1: each rank's rows must divide into them; not with two_batch (another split of the step).
    Paired (`pair_micro_batches`): on several ranks the explicit syncs only (DDP's and FSDP2's hooks expect one
    forward per backward), not with layer graphs, re-placement or distillation (as two_batch); then every
    expert-parallel layer sync-free (two exchanges in flight)."""
    count = cfg.micro_batches
    if count == 1:
        return
    rows = cfg.batch_size // (par.world_size if par is not None else 1)
    if rows % count:
        raise ValueError(
            f"micro_batches (--micro-batches) {count} split each rank's {rows} rows of the batch: give a --batch-size "
            f"of a multiple of {count} rows per rank"
        )
    if cfg.two_batch:
        raise ValueError("micro_batches (--micro-batches) and two_batch (--two-batch) both split the step: choose one")
    if not cfg.pair_micro_batches:
        return
    _refuse_beside_threads(
        cfg, par, "pair_micro_batches (--pair-micro-batches)", "a paired step runs a forward beside a backward"
    )
    set_sync_free(model)
    check_paired(model, count)


def _refuse_beside_threads(cfg: TrainConfig, par: Parallel | None, option: str, why: str) -> None:
    """What a step whose micro-batches run on threads beside each other (two halves, paired micro-batches) cannot
    run with: several ranks with DDP's or FSDP2's hooks (they expect one forward per backward: `why` not), layer
    graphs (calls in flight would share a layer's recordings), re-placement (its samples and migrations assume one
    forward), distillation (the teacher runs a forward of its own)."""
    if par is not None and cfg.grad_sync not in ("explicit", "overlap"):
        raise ValueError(
            f"{option} on several ranks with grad_sync={cfg.grad_sync!r}: "
            + ("DDP's" if cfg.grad_sync == "ddp" else "FSDP2's")
            + f" hooks expect one forward per backward, and {why}; use --grad-sync explicit or overlap"
        )
    others = {
        "layer_graphs (--layer-graphs)": cfg.layer_graphs,
        "re-placement (--replace-every / --replace-drift)": cfg.replaces,
        "distillation (--distill-weight)": cfg.distill_weight > 0,
    }
    for name, asked in others.items():
        if asked:
            raise ValueError(f"{option} does not run with {name}: drop one of them")


def unsynced_context(model: OccultLM, ddp: Any, bucketed: BucketedSync | None) -> Callable[[], AbstractContextManager]:
    """The context a micro-batch of an accumulated step (not the last) runs in so that the data-parallel hooks do
    not reduce its gradients yet: DDP's `no_sync`, FSDP2's gradient sync off, the buckets held; nothing for the
    explicit sync (it reduces once, after the backward)."""
    if ddp is not None:
        return ddp.no_sync
    if bucketed is not None:
        return bucketed.held
    if is_fsdp(model):
        return lambda: gradient_sync_off(model)
    return nullcontext


__all__ = [
    "apply_layer_graphs",
    "check_captured_step",
    "prepare_micro_batches",
    "prepare_two_batch",
    "unsynced_context",
]
