"""Sharded training checkpoints with torch.distributed.checkpoint (DCP): the one writer and reader.

Layout, in a run directory:

    checkpoint/latest              the name of the newest complete checkpoint (written atomically)
    checkpoint/step-00000100/      one DCP checkpoint: .metadata, one __<rank>_0.distcp per rank,
                                   occult.json (the caller's document plus format, world size and
                                   the SHA-256 of every file), written last

Tensors are keyed so that any number of ranks and any placement can load them (`state_tensors`):
a parameter as `model.<name>`, its optimizer state as `optim.<name>.<key>` (replicated ones:
DCP writes one copy; FSDP2 DTensors under the same key, each rank writing and reading its
shard), an expert parameter and its state per global expert id, `<key>.expert<e>` (each rank
writes the experts it holds, and a loading rank asks for exactly its own), plus each rank's CPU
RNG state `rng.cpu.rank<r>` (restored when the world size is unchanged).

Saving is atomic (`save_checkpoint`): every rank writes into `checkpoint/.partial/`, then rank 0
hashes the files, writes occult.json, renames the directory to `step-<step>` and only then
points `latest` at it and removes older ones; a crash at any point leaves `latest` naming a
complete checkpoint. `read_checkpoint_doc` checks the format and every file's hash first (a
truncated or altered file is an error, never a partial load), so the caller can check its
settings before `load_checkpoint` reads any tensor. Errors are raised as the caller's exception
type (`occult.lm.checkpoint.CheckpointError`, `occult.integrations.hf.FinetuneCheckpointError`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from occult._atomic import latest_step_dir, publish_step_dir, sha256_file, write_text_atomic
from occult.training.dtensor import is_sharded, like_param

DIR, LATEST, META, PARTIAL = "checkpoint", "latest", "occult.json", ".partial"
Experts = Mapping[str, Sequence[int]]  # parameter name -> global expert id of each slot (dim 0)


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


def state_tensors(
    params: Mapping[str, torch.Tensor], experts: Experts, opt: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, str]]]:
    """(DCP state dict of this rank, {param: {optimizer key: "param" | "scalar"}}) of `params`
    (name -> parameter) and the optimizer state of those among them `opt` holds."""
    out: dict[str, torch.Tensor] = {}

    def put(key: str, name: str, t: torch.Tensor) -> None:
        if name in experts and t.dim() > 0:
            for slot, e in enumerate(experts[name]):
                out[f"{key}.expert{e}"] = t[slot].clone()  # a view would be written with its whole storage
        else:
            out[key] = t

    for n, p in params.items():
        put(f"model.{n}", n, p.detach())
    kinds: dict[str, dict[str, str]] = {}
    name_of = {id(p): n for n, p in params.items()}
    for p, st in opt.state.items():
        n = name_of.get(id(p))
        if n is None:
            continue
        for k, v in st.items():
            t = v.detach() if isinstance(v, torch.Tensor) else torch.tensor(float(v))
            kinds.setdefault(n, {})[k] = "param" if t.shape == p.shape else "scalar"
            put(f"optim.{n}.{k}", n, t if t.shape == p.shape else t.reshape(()))
    return out, kinds


def save_checkpoint(
    out_dir: str | os.PathLike,
    tensors: Mapping[str, torch.Tensor],
    doc: Mapping[str, Any],
    step: int,
    fmt: str,
    error: type[Exception],
) -> Path:
    """Write this rank's `tensors` and (rank 0) `doc` as the checkpoint of `step`; every rank calls it."""
    import torch.distributed.checkpoint as dcp

    root, (rank, world, on) = Path(out_dir) / DIR, _world()
    tmp = root / PARTIAL
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a save that crashed earlier
        tmp.mkdir(parents=True)
    _barrier()
    state = dict(tensors)
    state[f"rng.cpu.rank{rank}"] = torch.get_rng_state()
    with _quiet(on):
        dcp.save(state, checkpoint_id=str(tmp), no_dist=not on)
    _barrier()
    path = None
    if rank == 0:
        full = dict(
            doc,
            format=fmt,
            world_size=world,
            files={f.name: sha256_file(f) for f in sorted(tmp.iterdir()) if f.is_file()},
        )
        write_text_atomic(tmp / META, json.dumps(full))
        path = publish_step_dir(tmp, root, step, LATEST)
    _barrier()
    return path if path is not None else latest_step_dir(root, error, LATEST)


def find_checkpoint(out_dir: str | os.PathLike, error: type[Exception]) -> Path | None:
    """The checkpoint directory `latest` names, or None when the run has none."""
    return latest_step_dir(Path(out_dir) / DIR, error, LATEST)


def read_checkpoint_doc(
    path: str | os.PathLike, fmt: str, error: type[Exception], what: str, required: Sequence[str] = ()
) -> dict[str, Any]:
    """occult.json of a checkpoint, after checking its format (`fmt`, the keys `required`) and
    every file's hash; `what` names the kind of checkpoint in the errors."""
    path = Path(path)
    f = path / META
    if not f.is_file():
        raise error(f"{path} is not a complete {what} (no {META}); use an earlier one or start again")
    try:
        doc = json.loads(f.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise error(f"{f} is corrupted ({exc})") from None
    found = doc.get("format") if isinstance(doc, dict) else None
    if found != fmt or any(k not in doc for k in required):
        raise error(f"{path} is not a {what} of this kind (format {found!r}, expected {fmt!r})")
    for name, digest in sorted(doc.get("files", {}).items()):
        if not (path / name).is_file():
            raise error(f"{path}: {name} is missing; the checkpoint is incomplete, use an earlier one or start again")
        if sha256_file(path / name) != digest:
            raise error(
                f"{path}: {name} is truncated or corrupted (SHA-256 mismatch); use an earlier checkpoint or start again"
            )
    return doc


def _requests(
    params: Mapping[str, torch.Tensor], experts: Experts, kinds: Mapping[str, Mapping[str, str]]
) -> dict[str, torch.Tensor]:
    """Empty tensors for every key this rank loads (its experts only; DTensors for FSDP shards)."""
    req: dict[str, torch.Tensor] = {}

    def ask(key: str, name: str, like: torch.Tensor) -> None:
        if name in experts and like.dim() > 0:
            for e in experts[name]:
                req[f"{key}.expert{e}"] = torch.empty(like.shape[1:], dtype=like.dtype)
        elif is_sharded(like):  # an FSDP shard: DCP reads this rank's part of the full tensor
            req[key] = torch.empty_like(like)
        else:
            req[key] = torch.empty(like.shape, dtype=like.dtype)

    for n, p in params.items():
        ask(f"model.{n}", n, p.detach())
        for k, kind in kinds.get(n, {}).items():
            ask(f"optim.{n}.{k}", n, p.detach() if kind == "param" else torch.zeros((), dtype=torch.float32))
    return req


def load_checkpoint(
    path: str | os.PathLike,
    doc: Mapping[str, Any],
    params: Mapping[str, torch.Tensor],
    experts: Experts,
    kinds: Mapping[str, Mapping[str, str]],
    error: type[Exception],
) -> dict[str, torch.Tensor]:
    """Read `model.<name>` of `params` and the optimizer state `kinds` names, as this rank holds them
    (experts stacked in slot order), and restore the RNG when the world size is unchanged."""
    import torch.distributed.checkpoint as dcp

    rank, world, on = _world()
    req = _requests(params, experts, kinds)
    rng_key = f"rng.cpu.rank{rank}"
    if doc.get("world_size") == world:
        req[rng_key] = torch.empty_like(torch.get_rng_state())
    try:
        with _quiet(on):
            dcp.load(req, checkpoint_id=str(path), no_dist=not on)
    except Exception as exc:
        lines = [line for line in str(exc).splitlines() if line.strip()]
        raise error(
            f"{path}: cannot read the checkpoint ({type(exc).__name__}: {lines[-1] if lines else ''})"
        ) from None

    def take(key: str, name: str) -> torch.Tensor:
        if name in experts and f"{key}.expert{experts[name][0]}" in req:
            return torch.stack([req[f"{key}.expert{e}"] for e in experts[name]])
        return req[key]

    out = {f"model.{n}": take(f"model.{n}", n) for n in params}
    out.update({f"optim.{n}.{k}": take(f"optim.{n}.{k}", n) for n in params for k in kinds.get(n, {})})
    if rng_key in req:
        torch.set_rng_state(req[rng_key])
    return out


def load_optimizer_state(
    opt: torch.optim.Optimizer,
    params: Mapping[str, torch.Tensor],
    tensors: Mapping[str, torch.Tensor],
    error: type[Exception],
    source: str,
) -> None:
    """Put `optim.<name>.<key>` tensors into `opt` (whose parameters `params` names), cut to FSDP
    shards where a parameter is one; every trained parameter or none must have state."""
    name_of = {id(p): n for n, p in params.items()}
    sd = opt.state_dict()
    order = [name_of[id(p)] for g in opt.param_groups for p in g["params"]]
    state: dict[int, dict[str, torch.Tensor]] = {}
    for i, name in enumerate(order):
        entry = {
            k.rsplit(".", 1)[1]: like_param(v, params[name])
            for k, v in tensors.items()
            if k.startswith(f"optim.{name}.") and k.count(".") == name.count(".") + 2
        }
        if entry:
            state[i] = entry
    if state and len(state) != len(order):
        raise error(f"{source}: optimizer state covers {len(state)} of {len(order)} trained parameters")
    sd["state"] = state
    opt.load_state_dict(sd)


__all__ = [
    "DIR",
    "LATEST",
    "META",
    "PARTIAL",
    "state_tensors",
    "save_checkpoint",
    "find_checkpoint",
    "read_checkpoint_doc",
    "load_checkpoint",
    "load_optimizer_state",
]
