"""Saving a fine-tuned converted model back to the standard transformers layout, atomically
(`save_finetuned`): the experts gathered to rank 0 over its EP group, the model's own blocks put
back, `save_pretrained` into a temporary directory renamed onto the output.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from occult.integrations.hf.block import moe_blocks
from occult.integrations.hf.loading import _fp32_kept

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja")


def _hf_blocks_on_rank0(model: nn.Module, rank: int) -> list[tuple[str, nn.Module, nn.Module]]:
    """Rank 0: (name, converted block, the model's own block with every expert), experts gathered
    to it over its EP group (the other ranks of that group send, the rest do nothing); else []."""
    out = []
    for name, block in moe_blocks(model):
        moe = block.experts
        group = moe.dispatcher.group
        ranks = dist.get_process_group_ranks(group) if group is not None else [0]
        if rank not in ranks or 0 not in ranks:
            continue  # another data-parallel replica: rank 0's EP group holds every expert
        full = []
        for local in (moe.gate_up_proj.detach().contiguous(), moe.down_proj.detach().contiguous()):
            if group is not None and moe.num_ranks > 1:
                shards = [torch.empty_like(local) for _ in range(moe.num_ranks)] if rank == 0 else None
                dist.gather(local, shards, dst=0, group=group)
                local = torch.cat(shards) if rank == 0 else local
            full.append(moe.placement.invert(local) if rank == 0 else None)
        if rank == 0:
            out.append((name, block, block.to_hf(model.config, full[0].cpu(), full[1].cpu())))
    return out


def save_finetuned(model: nn.Module, out: str | os.PathLike, source: str | os.PathLike | None = None,
                   dtype: torch.dtype | None = None) -> Path:
    """Write the model in the transformers layout to `out`, atomically (a collective).

    `dtype`: store floating-point weights in it (e.g. the source checkpoint's bf16 after fp32
    training), but for those transformers keeps in fp32 (`_keep_in_fp32_modules_strict`).

    The experts are gathered to rank 0 alone (the other ranks never hold more than their own);
    rank 0 writes a temporary directory beside `out` (the model's own `save_pretrained`, plus
    the tokenizer files of `source`) and renames it onto `out`, which must not exist. Every
    rank raises if rank 0's write fails.
    """
    out = Path(out)
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    status = torch.zeros((), dtype=torch.int64)
    error = ""
    swapped = _hf_blocks_on_rank0(model, rank)
    if rank == 0:
        tmp = None
        try:
            for name, _, hf_block in swapped:
                model.set_submodule(name, hf_block)
            if out.exists():
                raise FileExistsError(f"{out} already exists: choose another --out")
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
            kwargs: dict[str, Any] = {}
            if dtype is not None:
                kwargs["state_dict"] = {
                    k: v.to(torch.float32 if _fp32_kept(model, k, dtype) else dtype) if v.is_floating_point() else v
                    for k, v in model.state_dict().items()
                }
            saved_dtype = getattr(model.config, "dtype", None)
            try:
                model.save_pretrained(str(tmp), **kwargs)
            finally:
                model.config.dtype = saved_dtype  # save_pretrained sets it from the weights in memory
            if dtype is not None:  # config.json says what the files hold
                cfg = json.loads((tmp / "config.json").read_text())
                cfg["dtype"] = str(dtype).removeprefix("torch.")
                (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
            for name in TOKENIZER_FILES if source is not None else ():
                src = Path(source) / name
                if src.is_file() and not (tmp / name).exists():
                    shutil.copyfile(src, tmp / name)
            os.replace(tmp, out)
        except Exception as exc:  # reported to every rank below
            status.fill_(1)
            error = f"{type(exc).__name__}: {exc}"
            if tmp is not None and tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        finally:
            for name, block, _ in swapped:
                model.set_submodule(name, block)
    if distributed:
        if dist.get_backend() == "nccl":
            status = status.cuda()
        dist.all_reduce(status)
        if int(status):
            message = [error]
            dist.broadcast_object_list(message, src=0)
            error = message[0]
    if int(status):
        raise OSError(f"saving {out} failed on rank 0" + (f": {error}" if error else ""))
    return out


__all__ = ["TOKENIZER_FILES", "save_finetuned"]
