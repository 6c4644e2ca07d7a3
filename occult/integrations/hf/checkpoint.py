"""Resumable fine-tuning of converted transformers models (`finetune(..., checkpoint_dir=...)`):
sharded checkpoints of the trained tensors and their AdamW state with torch.distributed.checkpoint.

Layout, in the run directory:

    checkpoint/latest              the name of the newest complete checkpoint (written atomically)
    checkpoint/step-00000100/      one DCP checkpoint: .metadata, one __<rank>_0.distcp per rank,
                                   occult.json (step, losses, gradient norms, the run's signature,
                                   SHA-256 of every file), written last

Only what training changes is stored: the routers as `model.<name>` (replicated: DCP writes one
copy), the experts per global expert id, `model.<name>.expert<e>` (each rank writes its own),
their AdamW state as `optim.<name>.<key>[.expert<e>]`, and each rank's CPU RNG state (Mixtral's
router jitter draws from it; restored when the world size is unchanged). The frozen weights come
from the model directory again. A rank loading asks for exactly its experts, so the checkpoint
loads onto another number of ranks or placement too.

Saving is atomic: every rank writes into `checkpoint/.partial/`, then rank 0 hashes the files,
writes occult.json, renames the directory to `step-<step>`, and only then points `latest` at it
and removes older ones: a crash at any point leaves `latest` naming a complete checkpoint. The
writer, reader and hash checks are the training core's (`occult.training.dcp`); this module adds
the document (`occult-hf-finetune-dcp-v1`: step, losses, gradient norms, signature, the optimizer
keys as `optim_keys`) and the signature check.
Loading first checks the format, every file's hash, and the signature (model type, expert counts,
model config, a digest of the frozen weights, routing rule, training settings but `steps`, data), so a
corrupt checkpoint or one of another model or expert count is a `FinetuneCheckpointError` saying
what differs, before any tensor is read.
"""

from __future__ import annotations

import hashlib
import json
import os  # noqa: F401  (tests replace os.replace through this module to crash a save half-way)
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from occult.integrations.hf.block import OccultMoeBlock
from occult.training import dcp

FORMAT = "occult-hf-finetune-dcp-v1"
DIR, LATEST, META, PARTIAL = dcp.DIR, dcp.LATEST, dcp.META, dcp.PARTIAL
_VOLATILE = ("dtype", "torch_dtype", "transformers_version", "_name_or_path")  # config keys that may differ
EXTENDABLE = ("steps",)  # settings a resumed run may change (the schedule is extended: occult.training.schedule)


class FinetuneCheckpointError(ValueError):
    """A fine-tuning checkpoint that is missing, corrupted, or of another run (model, experts, settings, data)."""


def _digest(t: torch.Tensor, n: int | None = None) -> bytes:
    flat = t.detach().reshape(-1)
    return flat[:n].float().cpu().numpy().tobytes() if n else flat.cpu().contiguous().numpy().tobytes()


def signature(model: nn.Module, tokens: torch.Tensor, settings: Mapping[str, Any]) -> dict[str, Any]:
    """What a resumed run must share with the checkpoint (JSON-able; the same on every rank)."""
    blocks = [b for b in model.modules() if isinstance(b, OccultMoeBlock)]
    config = {k: v for k, v in model.config.to_dict().items() if k not in _VOLATILE}
    frozen = hashlib.sha256()
    for name, p in model.named_parameters():
        if not p.requires_grad:  # its name, shape and first 1024 values: another model differs there
            frozen.update(f"{name}{list(p.shape)}".encode() + _digest(p, 1024))
    routing = []
    for b in blocks:
        r = b.experts.router
        limited = getattr(r, "max_devices", None) is not None
        devices = getattr(r, "expert_device_E", None)
        routing.append(
            {
                "max_devices": getattr(r, "max_devices", None),
                "method": getattr(r, "prune_method", None),
                "devices": devices.tolist() if limited and devices is not None else None,
            }
        )
    return {
        "model_type": str(getattr(model.config, "model_type", "")),
        "num_experts": [int(b.experts.num_experts) for b in blocks],
        "config": hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16],
        "frozen": frozen.hexdigest()[:16],
        "routing": routing,
        "settings": dict(settings),
        "data": f"{tokens.numel()}:{hashlib.sha256(_digest(tokens.to(torch.int64))).hexdigest()[:16]}",
    }


def check_signature(saved: Mapping[str, Any], now: Mapping[str, Any], source: str) -> None:
    """Raise `FinetuneCheckpointError` naming the first thing that differs."""
    if saved.get("model_type") != now["model_type"]:
        raise FinetuneCheckpointError(
            f"{source} is of a {saved.get('model_type')!r} model, this is {now['model_type']!r}"
        )
    if saved.get("num_experts") != now["num_experts"]:
        raise FinetuneCheckpointError(
            f"{source} has {saved.get('num_experts')} experts per MoE layer, the model "
            f"{now['num_experts']}: another model"
        )
    for key, what in (
        ("config", "model config"),
        ("frozen", "frozen weights (another model directory?)"),
        ("routing", "routing rule (--max-devices / --placement / --prune-method)"),
        ("data", "training data"),
    ):
        if saved.get(key) != now[key]:
            raise FinetuneCheckpointError(
                f"{source}: the {what} differ from the checkpoint's; use the same or another --out"
            )
    before, after = saved.get("settings", {}), now["settings"]  # a key absent on one side: a setting at its default
    diffs = [
        f"{k}: checkpoint {before.get(k)!r}, now {after.get(k)!r}"
        for k in sorted(set(before) | set(after))
        if k not in EXTENDABLE and before.get(k) != after.get(k)
    ]
    if diffs:
        raise FinetuneCheckpointError(
            f"{source}: training settings differ ({'; '.join(diffs)}); use the same or another --out"
        )


def _trained(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict[str, nn.Parameter], dict[str, list[int]]]:
    """({name: parameter} of what `opt` trains, {expert parameter name: global expert id of each slot})."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    params = {name_of[id(p)]: p for g in opt.param_groups for p in g["params"]}
    experts = {}
    for b in model.modules():
        if isinstance(b, OccultMoeBlock):
            for p in (b.experts.gate_up_proj, b.experts.down_proj):
                experts[name_of[id(p)]] = b.experts.local_expert_ids.tolist()
    return params, experts


def save_state(
    out_dir: str | os.PathLike, model: nn.Module, opt: torch.optim.Optimizer, step: int, meta: Mapping[str, Any]
) -> Path:
    """Write the checkpoint at `step` (a collective: every rank calls it); see the module docstring."""
    params, experts = _trained(model, opt)
    state, kinds = dcp.state_tensors(params, experts, opt)
    doc = dict(meta, step=step, optim_keys={n: list(k) for n, k in kinds.items()})
    return dcp.save_checkpoint(out_dir, state, doc, step, FORMAT, FinetuneCheckpointError)


def find_state(out_dir: str | os.PathLike) -> Path | None:
    """The checkpoint directory `latest` names, or None when the run has none."""
    return dcp.find_checkpoint(out_dir, FinetuneCheckpointError)


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """occult.json of a checkpoint, after checking its format and every file's hash."""
    return dcp.read_checkpoint_doc(path, FORMAT, FinetuneCheckpointError, "checkpoint")


def load_state(path: str | os.PathLike, doc: Mapping[str, Any], model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Load the trained tensors, their AdamW state and (same world size) the RNG into this rank."""
    params, experts = _trained(model, opt)
    kinds = {
        n: {k: "scalar" if k == "step" else "param" for k in keys}
        for n, keys in doc.get("optim_keys", {}).items()
        if n in params
    }
    tensors = dcp.load_checkpoint(path, doc, params, experts, kinds, FinetuneCheckpointError)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(tensors[f"model.{name}"])
    dcp.load_optimizer_state(
        opt, params, {k: v for k, v in tensors.items() if k.startswith("optim.")}, FinetuneCheckpointError, str(path)
    )


__all__ = [
    "FinetuneCheckpointError",
    "signature",
    "check_signature",
    "save_state",
    "find_state",
    "read_meta",
    "load_state",
]
