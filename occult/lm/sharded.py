"""Sharded training checkpoints of `OccultLM`: the `occult-lm-dcp-v1` document over the one DCP
writer and reader of `occult.training.dcp`.

Layout, in a run directory:

    checkpoint/latest              the name of the newest complete checkpoint (written atomically)
    checkpoint/step-00000100/      one DCP checkpoint: .metadata, one __<rank>_0.distcp per rank,
                                   occult.json (settings, step, history, losses, SHA-256 of every
                                   file), written last

Every parameter is stored (`model.<name>`) with its AdamW state (`optim.<name>.<key>`);
replicated ones once, FSDP-sharded ones (`--grad-sync fsdp`) as DTensors under the same key (DDP
and FSDP runs resume each other's checkpoints), expert weights and their state per global expert
id, `<key>.expert<e>`. A rank loading requests exactly its own experts, so 2 ranks resume a
1-rank checkpoint and one process resumes a 2-rank one. occult.json adds to the training
metadata (`occult.lm.train`) the format, world size, the expert placement, the optimizer's
state keys (`optim_state`) and every file's hash. Atomic saving, hash checks and the RNG are
`occult.training.dcp`'s; the caller checks the settings before `load_sharded` reads any tensor.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from occult.lm.checkpoint import CheckpointError, load_weights
from occult.lm.model import OccultLM
from occult.lm.state import load_optimizer_tensors
from occult.training import dcp

DCP_DIR = dcp.DIR
LATEST = dcp.LATEST
DCP_FORMAT = "occult-lm-dcp-v1"


def _experts(model: OccultLM) -> dict[str, list[int]]:
    return {name: ids.tolist() for name, (_, ids) in model.expert_parameters().items()}


def state_tensors(
    model: OccultLM, opt: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, str]]]:
    """(DCP state dict, {param: {optimizer key: "param" | "scalar"}}) of this rank."""
    return dcp.state_tensors(dict(model.named_parameters()), _experts(model), opt)


def save_sharded(
    out_dir: str | os.PathLike, model: OccultLM, opt: torch.optim.Optimizer, meta: Mapping[str, Any], step: int
) -> Path:
    """Write this rank's part of the checkpoint at `step` (every rank calls it); see the module docstring."""
    state, kinds = state_tensors(model, opt)
    placement = [m.expert_device_E.tolist() for m in model.moe_layers()]
    doc = dict(meta, expert_placement=placement, optim_state=kinds)
    return dcp.save_checkpoint(out_dir, state, doc, step, DCP_FORMAT, CheckpointError)


def find_sharded(out_dir: str | os.PathLike) -> Path | None:
    """The checkpoint directory `latest` names, or None when the run has none."""
    return dcp.find_checkpoint(out_dir, CheckpointError)


def read_sharded_meta(path: str | os.PathLike) -> dict[str, Any]:
    """occult.json of a sharded checkpoint, after checking its format and every file's hash."""
    return dcp.read_checkpoint_doc(path, DCP_FORMAT, CheckpointError, "occult checkpoint", required=("model_config",))


def load_sharded(path: str | os.PathLike, doc: Mapping[str, Any], model: OccultLM, opt: torch.optim.Optimizer) -> None:
    """Load weights, AdamW state and (same world size) RNG into this rank's `model` and `opt`."""
    params = dict(model.named_parameters())
    name_of = {id(p): n for n, p in params.items()}
    trained = {name_of[id(p)] for g in opt.param_groups for p in g["params"]}
    kinds = {n: k for n, k in doc.get("optim_state", {}).items() if n in trained}
    tensors = dcp.load_checkpoint(path, doc, params, _experts(model), kinds, CheckpointError)
    load_weights(model, {k: v for k, v in tensors.items() if k.startswith("model.")}, str(path))
    load_optimizer_tensors(model, opt, {k: v for k, v in tensors.items() if k.startswith("optim.")}, str(path))


__all__ = [
    "DCP_DIR",
    "LATEST",
    "DCP_FORMAT",
    "save_sharded",
    "find_sharded",
    "read_sharded_meta",
    "load_sharded",
    "state_tensors",
]
