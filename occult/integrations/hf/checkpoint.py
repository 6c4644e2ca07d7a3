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
and removes older ones: a crash at any point leaves `latest` naming a complete checkpoint.
Loading first checks the format, every file's hash, and the signature (model type, expert counts,
model config, a digest of the frozen weights, routing rule, training settings, data), so a
corrupt checkpoint or one of another model or expert count is a `FinetuneCheckpointError` saying
what differs, before any tensor is read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from occult._atomic import latest_step_dir, publish_step_dir, sha256_file, write_text_atomic
from occult.integrations.hf.block import OccultMoeBlock

FORMAT = "occult-hf-finetune-dcp-v1"
DIR, LATEST, META, PARTIAL = "checkpoint", "latest", "occult.json", ".partial"
_VOLATILE = ("dtype", "torch_dtype", "transformers_version", "_name_or_path")  # config keys that may differ


class FinetuneCheckpointError(ValueError):
    """A fine-tuning checkpoint that is missing, corrupted, or of another run (model, experts, settings, data)."""


def _world() -> tuple[int, int, bool]:
    on = dist.is_available() and dist.is_initialized()
    return (dist.get_rank(), dist.get_world_size(), True) if on else (0, 1, False)


@contextlib.contextmanager
def _quiet(on: bool) -> Iterator[None]:
    """DCP warns that it runs in one process whenever it does; that is what we asked for."""
    with warnings.catch_warnings():
        if not on:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _barrier() -> None:
    if _world()[1] > 1:
        dist.barrier()



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
        routing.append({"max_devices": getattr(r, "max_devices", None), "method": getattr(r, "prune_method", None),
                        "devices": devices.tolist() if limited and devices is not None else None})
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
        raise FinetuneCheckpointError(f"{source} is of a {saved.get('model_type')!r} model, this is {now['model_type']!r}")
    if saved.get("num_experts") != now["num_experts"]:
        raise FinetuneCheckpointError(f"{source} has {saved.get('num_experts')} experts per MoE layer, the model "
                                      f"{now['num_experts']}: another model")
    for key, what in (("config", "model config"), ("frozen", "frozen weights (another model directory?)"),
                      ("routing", "routing rule (--max-devices / --placement / --prune-method)"),
                      ("data", "training data")):
        if saved.get(key) != now[key]:
            raise FinetuneCheckpointError(f"{source}: the {what} differ from the checkpoint's; use the same or another --out")
    diffs = [f"{k}: checkpoint {saved['settings'].get(k)!r}, now {v!r}" for k, v in now["settings"].items()
             if saved.get("settings", {}).get(k) != v]
    if diffs:
        raise FinetuneCheckpointError(f"{source}: training settings differ ({'; '.join(diffs)}); use the same or another --out")


def _trained(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict[str, nn.Parameter], dict[int, list[int]]]:
    """({name: parameter} of what `opt` trains, {id(expert parameter): global expert id of each slot})."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    params = {name_of[id(p)]: p for g in opt.param_groups for p in g["params"]}
    experts = {}
    for b in model.modules():
        if isinstance(b, OccultMoeBlock):
            for p in (b.experts.gate_up_proj, b.experts.down_proj):
                experts[id(p)] = b.experts.local_expert_ids.tolist()
    return params, experts


def save_state(out_dir: str | os.PathLike, model: nn.Module, opt: torch.optim.Optimizer, step: int,
               meta: Mapping[str, Any]) -> Path:
    """Write the checkpoint at `step` (a collective: every rank calls it); see the module docstring."""
    import torch.distributed.checkpoint as dcp

    root, (rank, world, on) = Path(out_dir) / DIR, _world()
    tmp = root / PARTIAL
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a save that crashed earlier
        tmp.mkdir(parents=True)
    _barrier()
    params, experts = _trained(model, opt)
    state: dict[str, torch.Tensor] = {f"rng.cpu.rank{rank}": torch.get_rng_state()}
    shapes: dict[str, list[str]] = {}
    for name, p in params.items():
        tensors = {f"model.{name}": p.detach()}
        for k, v in opt.state.get(p, {}).items():
            tensors[f"optim.{name}.{k}"] = v.detach() if isinstance(v, torch.Tensor) else torch.tensor(float(v))
            shapes.setdefault(name, []).append(k)
        for key, t in tensors.items():
            if id(p) in experts and t.shape == p.shape:
                for slot, e in enumerate(experts[id(p)]):
                    state[f"{key}.expert{e}"] = t[slot].clone()  # a view would be written with its whole storage
            else:
                state[key] = t
    with _quiet(on):
        dcp.save(state, checkpoint_id=str(tmp), no_dist=not on)
    _barrier()
    path = None
    if rank == 0:
        doc = dict(meta, format=FORMAT, step=step, world_size=world, optim_keys=shapes,
                   files={f.name: sha256_file(f) for f in sorted(tmp.iterdir()) if f.is_file()})
        write_text_atomic(tmp / META, json.dumps(doc))
        path = publish_step_dir(tmp, root, step, LATEST)
    _barrier()
    return path if path is not None else latest_step_dir(root, FinetuneCheckpointError, LATEST)


def find_state(out_dir: str | os.PathLike) -> Path | None:
    """The checkpoint directory `latest` names, or None when the run has none."""
    return latest_step_dir(Path(out_dir) / DIR, FinetuneCheckpointError, LATEST)


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """occult.json of a checkpoint, after checking its format and every file's hash."""
    path = Path(path)
    try:
        doc = json.loads((path / META).read_text())
    except FileNotFoundError:
        raise FinetuneCheckpointError(f"{path} is not a complete checkpoint (no {META}); use an earlier one or start again") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise FinetuneCheckpointError(f"{path / META} is corrupted ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise FinetuneCheckpointError(f"{path} is not an occult fine-tuning checkpoint of a transformers model")
    for name, digest in sorted(doc.get("files", {}).items()):
        if not (path / name).is_file():
            raise FinetuneCheckpointError(f"{path}: {name} is missing; the checkpoint is incomplete")
        if sha256_file(path / name) != digest:
            raise FinetuneCheckpointError(f"{path}: {name} is truncated or corrupted (SHA-256 mismatch); use an earlier one or start again")
    return doc


def load_state(path: str | os.PathLike, doc: Mapping[str, Any], model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Load the trained tensors, their AdamW state and (same world size) the RNG into this rank."""
    import torch.distributed.checkpoint as dcp

    rank, world, on = _world()
    params, experts = _trained(model, opt)
    req: dict[str, torch.Tensor] = {}
    keys = doc.get("optim_keys", {})

    def ask(key: str, p: torch.Tensor, like: torch.Tensor) -> None:
        if id(p) in experts and like.shape == p.shape:
            for e in experts[id(p)]:
                req[f"{key}.expert{e}"] = torch.empty(like.shape[1:], dtype=like.dtype)
        else:
            req[key] = torch.empty(like.shape, dtype=like.dtype)

    for name, p in params.items():
        ask(f"model.{name}", p, p)
        for k in keys.get(name, []):
            ask(f"optim.{name}.{k}", p, p if k != "step" else torch.zeros((), dtype=torch.float32))
    if doc.get("world_size") == world:
        req[f"rng.cpu.rank{rank}"] = torch.empty_like(torch.get_rng_state())
    try:
        with _quiet(on):
            dcp.load(req, checkpoint_id=str(path), no_dist=not on)
    except Exception as exc:
        lines = [line for line in str(exc).splitlines() if line.strip()]
        raise FinetuneCheckpointError(f"{path}: cannot read the checkpoint ({type(exc).__name__}: {lines[-1] if lines else ''})") from None

    def take(key: str, p: torch.Tensor) -> torch.Tensor:
        if id(p) in experts and f"{key}.expert{experts[id(p)][0]}" in req:
            return torch.stack([req[f"{key}.expert{e}"] for e in experts[id(p)]]).to(p.device)
        return req[key].to(p.device) if req[key].dim() else req[key]  # AdamW keeps its step on the CPU

    with torch.no_grad():
        for name, p in params.items():
            p.copy_(take(f"model.{name}", p))
    sd = opt.state_dict()
    sd["state"] = {i: {k: take(f"optim.{name}.{k}", p) for k in keys.get(name, [])}
                   for i, (name, p) in enumerate(params.items()) if keys.get(name)}
    opt.load_state_dict(sd)
    if f"rng.cpu.rank{rank}" in req:
        torch.set_rng_state(req[f"rng.cpu.rank{rank}"])


__all__ = ["FinetuneCheckpointError", "signature", "check_signature", "save_state", "find_state", "read_meta", "load_state"]
