"""Saving a converted model back to the standard transformers layout, atomically and without
gathering the model on one rank (`save_finetuned`; `save_pretrained`, which may replace an
existing directory).

The experts of each MoE layer are gathered to one *owner* rank of rank 0's expert-parallel
group (layer i to the group's rank i mod S), which rebuilds the model's own block for that layer,
reverts transformers' weight conversion on it (e.g. fused `gate_up_proj` back to per-expert keys)
and writes it as one shard file. Rank 0 writes the rest (embeddings, attention, norms, head) with
the model's own `save_pretrained`, then names the shards `model-0000i-of-0000n.safetensors`,
writes `model.safetensors.index.json` and renames the temporary directory onto the output. No
rank holds more than its own experts plus one layer's at a time; the output is what
`save_pretrained` of the unconverted model writes, split by layer (plain `from_pretrained` loads
it). The ranks must see one filesystem (a clear error otherwise).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from occult.integrations.hf.block import moe_blocks
from occult.integrations.hf.loading import keeps_fp32

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "chat_template.jinja",
)
_LAYER_FILE = ".layer{:05d}.safetensors"  # an owner's shard before rank 0 names it


class _Status:
    """This rank's first error (collectives run regardless, so no rank is left waiting)."""

    def __init__(self) -> None:
        self.error = ""

    def run(self, fn, *args):
        if self.error:
            return None
        try:
            return fn(*args)
        except Exception as exc:  # reported to every rank by _agree
            self.error = f"{type(exc).__name__}: {exc}"
            return None


def _agree(status: _Status, distributed: bool, rank: int) -> str:
    """Every rank's errors, joined (a collective); "" when all succeeded."""
    if not distributed:
        return status.error
    flag = torch.tensor(1 if status.error else 0, dtype=torch.int64)
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag)
    if not int(flag):
        return ""
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, status.error)
    return "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)


def _cast(model: nn.Module, sd: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """`sd` on the CPU, floating-point tensors in `dtype` (but those transformers keeps in fp32)."""
    out = {}
    for k, v in sd.items():
        v = v.detach()
        if dtype is not None and v.is_floating_point():
            v = v.to(torch.float32 if keeps_fp32(model, k, dtype) else dtype)
        out[k] = v.to("cpu").contiguous()
    return out


def _write_layer(
    model: nn.Module,
    name: str,
    block: nn.Module,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    dtype: torch.dtype | None,
    path: Path,
    rank: int,
) -> None:
    """The model's own block for one layer (all experts, id order) as one shard, in checkpoint names."""
    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion

    if not path.parent.is_dir():
        raise FileNotFoundError(f"{path.parent} is not visible on this rank: the ranks must share a filesystem")
    hf_block = block.to_hf(model.config, gate_up, down)
    sd = _cast(model, {f"{name}.{k}": v for k, v in hf_block.state_dict().items()}, dtype)
    sd = revert_weight_conversion(model, sd)
    save_file(
        {k: v.contiguous() for k, v in sd.items()}, str(path), metadata={"format": "pt", "occult_writer": str(rank)}
    )


def _write_rest(model: nn.Module, moe_names: list[str], dtype: torch.dtype | None, tmp: Path) -> list[Path]:
    """Rank 0: everything outside the MoE blocks through the model's own `save_pretrained` (config,
    generation config, tied weights, renamings) into `tmp/.rest`; returns its weight files."""
    prefixes = tuple(n + "." for n in moe_names)
    sd = _cast(model, {k: v for k, v in model.state_dict().items() if not k.startswith(prefixes)}, dtype)
    rest = tmp / ".rest"
    saved_dtype = getattr(model.config, "dtype", None)
    try:
        model.save_pretrained(str(rest), state_dict=sd)
    finally:
        model.config.dtype = saved_dtype  # save_pretrained sets it from the weights in memory
    index = rest / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    )
    for p in rest.iterdir():
        if p.suffix != ".safetensors" and p.name != index.name:
            shutil.move(str(p), str(tmp / p.name))  # config.json, generation_config.json
    return [rest / f for f in files]


def _data_bytes(path: Path) -> int:
    """Bytes of tensor data in a safetensors file (its size less the 8-byte length and the header)."""
    with open(path, "rb") as f:
        (header,) = struct.unpack("<Q", f.read(8))
    return path.stat().st_size - 8 - header


def _finish(
    tmp: Path, out: Path, rest: list[Path], layers: list[Path], source: Any, dtype: torch.dtype | None, overwrite: bool
) -> None:
    """Rank 0: shard names, the index, config dtype, tokenizer files; then rename `tmp` onto `out`."""
    from safetensors import safe_open

    shards = [*rest, *layers]
    weight_map, total = {}, 0
    for j, src in enumerate(shards, 1):
        dst = tmp / f"model-{j:05d}-of-{len(shards):05d}.safetensors"
        with safe_open(str(src), framework="pt") as f:
            for key in f.keys():
                if key in weight_map:
                    raise RuntimeError(f"{key} is in two shards ({weight_map[key]}, {dst.name})")
                weight_map[key] = dst.name
        total += _data_bytes(src)
        os.replace(src, dst)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    shutil.rmtree(tmp / ".rest", ignore_errors=True)
    if dtype is not None:  # config.json says what the files hold
        cfg = json.loads((tmp / "config.json").read_text())
        cfg["dtype"] = str(dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for name in TOKENIZER_FILES if source is not None else ():
        src = Path(source) / name
        if src.is_file() and not (tmp / name).exists():
            shutil.copyfile(src, tmp / name)
    if not out.exists():
        os.replace(tmp, out)
    elif overwrite and out.is_dir():  # the old directory is moved aside, the new one put in its place
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        raise FileExistsError(f"{out} already exists: choose another --out")


def save_finetuned(
    model: nn.Module, out: str | os.PathLike, source: str | os.PathLike | None = None, dtype: torch.dtype | None = None
) -> Path:
    """Write the converted model in the transformers layout to `out`, atomically (a collective).

    `dtype`: store floating-point weights in it (e.g. the source checkpoint's bf16 after fp32
    training), but for those transformers keeps in fp32 (`_keep_in_fp32_modules_strict`).
    `source`: a model directory whose tokenizer files are copied along.

    Each MoE layer's experts go to one rank of rank 0's expert-parallel group (module docstring),
    which writes that layer's shard; rank 0 writes the rest and the index into a temporary
    directory beside `out` and renames it onto `out`, which must not exist. Other data-parallel
    replicas only take part in agreeing on the outcome. Every rank raises if any rank's part fails,
    and the temporary directory is removed.
    """
    return _save_by_layer(model, Path(out), source, dtype, overwrite=False)


def save_pretrained(model: nn.Module, save_directory: str | os.PathLike, *, group: Any = None, **kwargs: Any) -> None:
    """Save a converted model in the standard transformers layout (experts un-permuted), loadable
    by plain `from_pretrained`; an existing `save_directory` is replaced. A collective: every rank
    calls it.

    Written as `save_finetuned` writes (one shard per MoE layer by its owner rank, no rank holding
    the whole model). With extra `kwargs` for the model's own `save_pretrained` (e.g.
    `max_shard_size`), every rank gathers all experts (`hf_layout`) and rank 0 of `group` writes
    the directory with them.
    """
    if not kwargs:
        _save_by_layer(model, Path(save_directory), None, None, overwrite=True)
        return
    from occult.integrations.hf.convert import hf_layout
    from occult.integrations.hf.families import group_size

    _, rank = group_size(group)
    with hf_layout(model):
        if rank == 0:
            model.save_pretrained(save_directory, **kwargs)
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)


def _save_by_layer(model: nn.Module, out: Path, source: Any, dtype: torch.dtype | None, overwrite: bool) -> Path:
    """`save_finetuned`'s body; `overwrite`: replace an existing directory `out`."""
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    status = _Status()
    tmp: Path | None = None

    def make_tmp() -> Path:
        if out.exists() and not (overwrite and out.is_dir()):
            raise FileExistsError(f"{out} already exists: choose another --out")
        out.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))

    if rank == 0:
        tmp = status.run(make_tmp)
    if distributed:
        shared = [str(tmp) if tmp is not None else None]
        dist.broadcast_object_list(shared, src=0)
        tmp = Path(shared[0]) if shared[0] is not None else None
    error = _agree(status, distributed, rank)
    if error or tmp is None:
        raise OSError(f"saving {out} failed: {error or 'no temporary directory'}")

    blocks = moe_blocks(model)
    layers: list[Path] = []
    for i, (name, block) in enumerate(blocks):
        moe = block.experts
        group = moe.dispatcher.group
        ranks = dist.get_process_group_ranks(group) if group is not None else [rank]
        if 0 not in ranks:
            continue  # another data-parallel replica: rank 0's EP group holds every expert once
        owner = ranks[i % len(ranks)]
        full = []
        for local in (moe.gate_up_proj.detach().contiguous(), moe.down_proj.detach().contiguous()):
            if group is not None and len(ranks) > 1:
                if dist.get_backend(group) == "gloo":
                    local = local.cpu()  # gloo gathers host tensors
                shards = [torch.empty_like(local) for _ in ranks] if rank == owner else None
                dist.gather(local, shards, dst=owner, group=group)
                local = torch.cat(shards) if rank == owner else local
            full.append(moe.placement.invert(local).cpu() if rank == owner else None)
        layers.append(tmp / _LAYER_FILE.format(i))
        if rank == owner:
            status.run(_write_layer, model, name, block, full[0], full[1], dtype, layers[-1], rank)
        del full
    rest = status.run(_write_rest, model, [n for n, _ in blocks], dtype, tmp) if rank == 0 else None
    error = _agree(status, distributed, rank)
    if not error and rank == 0:
        status.run(_finish, tmp, out, rest, layers, source, dtype, overwrite)
    error = error or _agree(status, distributed, rank)
    if error:
        if rank == 0 and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        raise OSError(f"saving {out} failed: {error}")
    return out


__all__ = ["TOKENIZER_FILES", "save_finetuned", "save_pretrained"]
