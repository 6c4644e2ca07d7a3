"""Sharded training checkpoints of `OccultLM` with torch.distributed.checkpoint (DCP).

Layout, in a run directory:

    checkpoint/latest              the name of the newest complete checkpoint (written atomically)
    checkpoint/step-00000100/      one DCP checkpoint: .metadata, one __<rank>_0.distcp per rank,
                                   occult.json (settings, step, history, losses, SHA-256 of every
                                   file), written last

Tensors are keyed so that any number of ranks and any placement can load them: replicated
parameters and their AdamW state as `model.<name>` / `optim.<name>.<key>` (DCP writes one
copy; FSDP-sharded ones, `--grad-sync fsdp`, are DTensors under the same key, each rank writing
and reading its shard, so DDP and FSDP runs resume each other's checkpoints), expert weights and their AdamW state per global expert id, `model.<name>.expert<e>`
(each rank writes the experts it holds). A rank loading requests exactly its own experts, so
2 ranks resume a 1-rank checkpoint and one process resumes a 2-rank one. Each rank's RNG state
(`rng.cpu.rank<r>`) is restored when the world size is unchanged.

Saving is atomic: every rank writes into `checkpoint/.partial/`, then rank 0 hashes the files,
writes occult.json, renames the directory to `step-<step>` and only then points `latest` at
it and removes older ones. A crash at any point leaves `latest` naming a complete checkpoint.
Loading checks the format and every file's hash first (a truncated or altered file is a
`CheckpointError`, never a partial load), and the caller checks the settings (another model or
expert count is refused before any tensor is read).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist

from occult._atomic import latest_step_dir, publish_step_dir, sha256_file, write_text_atomic
from occult.lm.checkpoint import CheckpointError, load_weights
from occult.lm.fsdp import is_sharded
from occult.lm.model import OccultLM
from occult.lm.state import load_optimizer_tensors

DCP_DIR = "checkpoint"
LATEST = "latest"
META_FILE = "occult.json"
PARTIAL = ".partial"
DCP_FORMAT = "occult-lm-dcp-v1"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns that it runs in one process whenever it does; that is what we asked for."""
    with warnings.catch_warnings():
        if not _distributed():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _rank_world() -> tuple[int, int]:
    if _distributed():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if _rank_world()[1] > 1:
        dist.barrier()



def state_tensors(model: OccultLM, opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, str]]]:
    """(DCP state dict, {param: {optimizer key: "param" | "scalar"}}) of this rank."""
    experts = model.expert_parameters()
    name_of = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, torch.Tensor] = {}

    def put(key: str, name: str, t: torch.Tensor) -> None:
        if name in experts and t.dim() > 0:
            for slot, e in enumerate(experts[name][1].tolist()):
                out[f"{key}.expert{e}"] = t[slot].clone()  # a view would be written with its whole storage
        else:
            out[key] = t

    for n, p in model.named_parameters():
        put(f"model.{n}", n, p.detach())
    kinds: dict[str, dict[str, str]] = {}
    for p, st in opt.state.items():
        n = name_of[id(p)]
        for k, v in st.items():
            t = v.detach() if isinstance(v, torch.Tensor) else torch.tensor(float(v))
            kinds.setdefault(n, {})[k] = "param" if t.shape == p.shape else "scalar"
            put(f"optim.{n}.{k}", n, t if t.shape == p.shape else t.reshape(()))
    return out, kinds


def save_sharded(out_dir: str | os.PathLike, model: OccultLM, opt: torch.optim.Optimizer, meta: Mapping[str, Any], step: int) -> Path:
    """Write this rank's part of the checkpoint at `step` (every rank calls it); see the module docstring."""
    import torch.distributed.checkpoint as dcp

    root = Path(out_dir) / DCP_DIR
    rank, world = _rank_world()
    tmp = root / PARTIAL
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a save that crashed earlier
        tmp.mkdir(parents=True)
    _barrier()
    state, kinds = state_tensors(model, opt)
    state[f"rng.cpu.rank{rank}"] = torch.get_rng_state()
    with _quiet():
        dcp.save(state, checkpoint_id=str(tmp), no_dist=not _distributed())
    _barrier()
    path = None
    if rank == 0:
        placement = [m.expert_device_E.tolist() for m in model.moe_layers()]
        doc = dict(meta, format=DCP_FORMAT, world_size=world, expert_placement=placement, optim_state=kinds,
                   files={f.name: sha256_file(f) for f in sorted(tmp.iterdir()) if f.is_file()})
        write_text_atomic(tmp / META_FILE, json.dumps(doc))
        path = publish_step_dir(tmp, root, step, LATEST)
    _barrier()
    return path if path is not None else latest_step_dir(root, CheckpointError, LATEST)


def find_sharded(out_dir: str | os.PathLike) -> Path | None:
    """The checkpoint directory `latest` names, or None when the run has none."""
    return latest_step_dir(Path(out_dir) / DCP_DIR, CheckpointError, LATEST)


def read_sharded_meta(path: str | os.PathLike) -> dict[str, Any]:
    """occult.json of a sharded checkpoint, after checking its format and every file's hash."""
    path = Path(path)
    f = path / META_FILE
    if not f.is_file():
        raise CheckpointError(f"{path} is not a complete occult checkpoint (no {META_FILE}); use an earlier one or train again")
    try:
        doc = json.loads(f.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{f} is corrupted ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != DCP_FORMAT or "model_config" not in doc:
        raise CheckpointError(f"{path} is not an occult sharded checkpoint (format {doc.get('format') if isinstance(doc, dict) else None!r})")
    for name, digest in sorted(doc.get("files", {}).items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{path}: {name} is missing; the checkpoint is incomplete, use an earlier one or train again")
        if sha256_file(file) != digest:
            raise CheckpointError(f"{path}: {name} is truncated or corrupted (SHA-256 mismatch); use an earlier checkpoint or train again")
    return doc


def load_sharded(path: str | os.PathLike, doc: Mapping[str, Any], model: OccultLM, opt: torch.optim.Optimizer) -> None:
    """Load weights, AdamW state and (same world size) RNG into this rank's `model` and `opt`."""
    import torch.distributed.checkpoint as dcp

    rank, world = _rank_world()
    experts = model.expert_parameters()
    params = dict(model.named_parameters())
    req: dict[str, torch.Tensor] = {}

    def ask(key: str, name: str, like: torch.Tensor) -> None:
        if name in experts and like.dim() > 0:
            for e in experts[name][1].tolist():
                req[f"{key}.expert{e}"] = torch.empty(like.shape[1:], dtype=like.dtype)
        elif is_sharded(like):  # an FSDP shard: DCP reads this rank's part of the full tensor
            req[key] = torch.empty_like(like)
        else:
            req[key] = torch.empty(like.shape, dtype=like.dtype)

    for n, p in params.items():
        ask(f"model.{n}", n, p.detach())
    kinds = doc.get("optim_state", {})
    name_of = {id(p): n for n, p in params.items()}
    trained = [name_of[id(p)] for g in opt.param_groups for p in g["params"]]
    for n in trained:
        for k, kind in kinds.get(n, {}).items():
            ask(f"optim.{n}.{k}", n, params[n].detach() if kind == "param" else torch.zeros((), dtype=torch.float32))
    rng_key = f"rng.cpu.rank{rank}"
    if doc.get("world_size") == world:
        req[rng_key] = torch.empty_like(torch.get_rng_state())
    try:
        with _quiet():
            dcp.load(req, checkpoint_id=str(path), no_dist=not _distributed())
    except Exception as exc:
        lines = [l for l in str(exc).splitlines() if l.strip()]
        raise CheckpointError(f"{path}: cannot read the sharded checkpoint ({type(exc).__name__}: {lines[-1] if lines else ''})") from None

    def take(key: str, name: str) -> torch.Tensor:
        if name in experts and f"{key}.expert{int(experts[name][1][0])}" in req:
            return torch.stack([req[f"{key}.expert{e}"] for e in experts[name][1].tolist()])
        return req[key]

    load_weights(model, {f"model.{n}": take(f"model.{n}", n) for n in params}, str(path))
    opt_tensors = {f"optim.{n}.{k}": take(f"optim.{n}.{k}", n) for n in trained for k in kinds.get(n, {})}
    load_optimizer_tensors(model, opt, opt_tensors, str(path))
    if rng_key in req:
        torch.set_rng_state(req[rng_key])


__all__ = ["DCP_DIR", "LATEST", "save_sharded", "find_sharded", "read_sharded_meta", "load_sharded", "state_tensors"]
