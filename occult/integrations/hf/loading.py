"""Load a transformers MoE model expert-parallel, each rank reading only its own experts
(`load_sharded`), from the safetensors files of a model directory.

The model is built on the meta device (no memory), the non-expert weights are read by name
(`safetensors.safe_open`) and put in place, non-persistent buffers (rotary frequencies) are
computed by the model's own `_init_weights`, and `convert` then builds every `OccultMoeBlock`
from this rank's experts only, sliced out of the files: a checkpoint may store a layer's
experts fused (`<block>.experts.gate_up_proj` [E, 2F, H], `.down_proj` [E, H, F], the layout of
transformers 5's modules) or one expert per key (`<block>.experts.<e>.gate_proj.weight`,
`up_proj`, `down_proj`; Mixtral `w1`, `w3`, `w2` under `block_sparse_moe`, the layout
transformers 5 still writes). Either way only this rank's rows are read. `LoadReport` (on
`model.occult_load_report`) counts what was read, which the tests check.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from occult.integrations.hf.block import moe_blocks
from occult.integrations.hf.convert import convert
from occult.integrations.hf.families import UnsupportedModelError, check_transformers_version, model_family
from occult.moe.config import ExecConfig, RoutingConfig, merge_settings
from occult.placement import Placement

# checkpoint name -> module name, per model type (what transformers' conversion mapping renames)
_RENAMES: dict[str, list[tuple[str, str]]] = {"mixtral": [(".block_sparse_moe.", ".mlp.")]}
# a per-expert checkpoint's projection names: (gate, up, down)
_PER_EXPERT = [("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")]


@dataclass
class LoadReport:
    """What `load_sharded` read on this rank (tensors as stored; expert rows count once each)."""

    tensors: int = 0
    bytes: int = 0
    expert_tensors: int = 0  # tensors (or row slices of fused tensors) holding expert weights
    expert_bytes: int = 0
    experts: dict[int, list[int]] = field(default_factory=dict)  # MoE layer -> expert ids read
    layout: str = ""  # "fused" or "per-expert"


class _Files:
    """The safetensors files of a model directory, tensors read by name (lazily, counted)."""

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        index = directory / "model.safetensors.index.json"
        if index.is_file():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            names = sorted(p.name for p in directory.glob("*.safetensors"))
        if not names:
            raise FileNotFoundError(
                f"{directory}: no *.safetensors weights (only safetensors checkpoints are supported)"
            )
        self.directory = directory
        self.handles = [safe_open(str(directory / n), framework="pt", device="cpu") for n in names]
        self.where = {k: h for h in self.handles for k in h.keys()}
        self.report = LoadReport()

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def get(self, key: str, expert: bool = False) -> torch.Tensor:
        return self._count(self.where[key].get_tensor(key), expert)

    def rows(self, key: str, ids: Sequence[int]) -> torch.Tensor:
        """Rows `ids` of a stored tensor (each read on its own: the others are never loaded)."""
        sl = self.where[key].get_slice(key)
        return torch.cat([self._count(sl[e : e + 1], True) for e in ids])

    def shape(self, key: str) -> list[int]:
        return list(self.where[key].get_slice(key).get_shape())

    def _count(self, t: torch.Tensor, expert: bool) -> torch.Tensor:
        r = self.report
        n = t.numel() * t.element_size()
        r.tensors, r.bytes = r.tensors + 1, r.bytes + n
        if expert:
            r.expert_tensors, r.expert_bytes = r.expert_tensors + 1, r.expert_bytes + n
        return t


def _set(model: nn.Module, name: str, value: torch.Tensor) -> None:
    mod_name, _, leaf = name.rpartition(".")
    mod = model.get_submodule(mod_name)
    if leaf in mod._parameters:
        old = mod._parameters[leaf]
        mod._parameters[leaf] = nn.Parameter(value, requires_grad=old.requires_grad)
    else:
        mod._buffers[leaf] = value


def keeps_fp32(model: nn.Module, name: str, dtype: torch.dtype) -> bool:
    """transformers' `_keep_in_fp32_modules(_strict)` rule (fp16: both lists; bf16: strict only)."""
    keep = set()
    if dtype == torch.float16:
        keep |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    if dtype in (torch.float16, torch.bfloat16):
        keep |= set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    return any(k in name for k in keep)


def _ckpt_names(model_type: str, files: _Files, prefix: str) -> dict[str, str]:
    """module name -> checkpoint name for every stored tensor (renames; base-model checkpoints)."""
    out = {}
    bare = not any(k.startswith(prefix + ".") for k in files.where)
    for key in files.where:
        name = key
        for src, dst in _RENAMES.get(model_type, []):
            name = name.replace(src, dst)
        out[f"{prefix}.{name}" if bare and prefix else name] = key
    return out


def _expert_reader(files: _Files, names: dict[str, str], blocks: list[str], E: int):
    """`expert_weights(i, ids)` for `convert`: this rank's rows of MoE layer i from the files."""
    report = files.report

    def read(i: int, ids_local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids = [int(e) for e in ids_local.tolist()]
        report.experts[i] = ids
        base = f"{blocks[i]}.experts"
        fused = [names.get(f"{base}.gate_up_proj"), names.get(f"{base}.down_proj")]
        if all(fused):
            for key in fused:
                if files.shape(key)[0] != E:
                    raise UnsupportedModelError(
                        f"{key}: {files.shape(key)} does not hold {E} experts in its first dimension"
                    )
            report.layout = "fused"
            return files.rows(fused[0], ids), files.rows(fused[1], ids)
        for gate, up, down in _PER_EXPERT:
            keys = [[names.get(f"{base}.{e}.{p}.weight") for p in (gate, up, down)] for e in ids]
            if all(all(k) for k in keys):
                report.layout = "per-expert"
                gu = [torch.cat([files.get(k[0], True), files.get(k[1], True)]) for k in keys]
                return torch.stack(gu), torch.stack([files.get(k[2], True) for k in keys])
        raise UnsupportedModelError(
            f"MoE layer {i} ({blocks[i]}): found neither fused experts ({base}.gate_up_proj / down_proj) "
            f"nor per-expert weights ({base}.<e>.gate_proj|w1 / up_proj|w3 / down_proj|w2 .weight) for experts {ids}"
        )

    return read


def load_sharded(
    path: str | os.PathLike,
    group: Any = None,
    placement: Placement | str | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    dispatcher: Any = None,
    max_devices: int | None = None,
    routing: RoutingConfig | None = None,
    execution: ExecConfig | None = None,
    routing_placement: Placement | None = None,
    prune_method: str | None = None,
    similarity: Sequence[torch.Tensor] | None = None,
    expert_backend: str | None = None,
) -> nn.Module:
    """The converted model of a transformers directory, this rank holding only its experts.

    Equals `convert(AutoModelForCausalLM.from_pretrained(path, dtype=dtype), group, placement, ...)`
    without ever loading another rank's experts. `routing_placement` (with `max_devices`): the
    device of each expert for device-limited routing when it differs from where the experts
    are (e.g. 4 virtual devices in one process); default `placement`. Settings as for `convert`
    (`routing` / `execution` config objects, or the keywords). Call on every rank.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    check_transformers_version()
    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{directory}: not a transformers model directory (no config.json)")
    config = AutoConfig.from_pretrained(str(directory))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model_family(model)
    files = _Files(directory)
    if any(k.endswith("_scale_inv") or k.endswith(".weight_scale") for k in files.where):
        raise UnsupportedModelError(f"{directory}: quantized (FP8) checkpoints are not supported; use a bf16/fp32 copy")
    names = _ckpt_names(config.model_type, files, getattr(model, "base_model_prefix", ""))
    blocks = [name for name, _ in moe_blocks(model)]
    _load_dense_weights(model, files, names, blocks, dtype, device)
    _materialise_buffers(model, device)
    E = int(moe_blocks(model)[0][1].gate.num_experts)
    routing, execution = merge_settings(
        routing,
        execution,
        dispatcher=dispatcher,
        max_devices=max_devices,
        prune_method=prune_method,
        expert_backend=expert_backend,
    )
    limit_here = routing if routing_placement is None else replace(routing, max_devices=None)
    convert(
        model,
        group,
        placement,
        routing=limit_here,
        execution=execution,
        similarity=similarity,
        expert_weights=_expert_reader(files, names, blocks, E),
    )
    if routing_placement is not None and routing.max_devices is not None:
        set_routing_placement(model, routing_placement, routing.max_devices, routing.prune_method, similarity)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"load_sharded left tensors on the meta device: {left[:4]}")
    model.occult_load_report = files.report
    model.eval()
    return model


def _load_dense_weights(
    model: nn.Module,
    files: _Files,
    names: dict[str, str],
    blocks: list[str],
    dtype: torch.dtype,
    device: torch.device | str,
) -> None:
    """Every persistent tensor of the meta `model` but the experts, read from `files` (checkpoint
    name `names[module name]`), in `dtype` (fp32 where the model keeps it) on `device`; tied
    weights tied. A tensor with no weights in the checkpoint is an error."""
    expert_names = {f"{b}.experts.{t}" for b in blocks for t in ("gate_up_proj", "down_proj")}
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    missing = []
    for name in dict(model.state_dict(keep_vars=True)):
        if name in expert_names:
            continue
        if name not in names:
            if name not in tied:
                missing.append(name)
            continue
        value = files.get(names[name])
        want = (
            torch.float32 if keeps_fp32(model, name, dtype) else (dtype if value.is_floating_point() else value.dtype)
        )
        _set(model, name, value.to(device=device, dtype=want))
    if missing:
        raise UnsupportedModelError(f"{files.directory}: no weights for {len(missing)} tensors, e.g. {missing[:4]}")
    if tied:
        model.tie_weights()


def _materialise_buffers(model: nn.Module, device: torch.device | str) -> None:
    """The non-persistent buffers still on the meta device (rotary frequencies) computed by the
    model's own `_init_weights`; one it cannot compute is an error."""
    for name, buf in model.named_buffers():
        if buf.is_meta:
            owner = model.get_submodule(name.rpartition(".")[0])
            if any(True for _ in owner.parameters(recurse=False)) or not buf.is_floating_point():
                raise UnsupportedModelError(
                    f"cannot materialise buffer {name} (not a float buffer of a parameter-free module)"
                )
            _set(model, name, torch.full_like(buf, float("nan"), device=device))
            model._init_weights(owner)  # transformers' own init of non-persistent buffers (rotary frequencies)
            if model.get_buffer(name).isnan().any():
                raise UnsupportedModelError(
                    f"cannot materialise buffer {name}: the model's _init_weights leaves it unset"
                )


def set_routing_placement(
    model: nn.Module, placement: Placement, max_devices: int, prune_method: str = "score", similarity=None
) -> None:
    """Device-limited routing by `placement` (any device count) on a converted model, in place.

    The experts stay where they are; only the routers' choice is limited to `max_devices` of the
    placement's devices (e.g. fine-tuning in one process for a placement on 4 GPUs).
    """
    blocks = moe_blocks(model)
    family = model_family(model)
    E, k = int(blocks[0][1].gate.num_experts), int(blocks[0][1].gate.top_k)
    placement = placement.for_layers(len(blocks))  # a one-layer placement serves every layer
    placement.check_fits(E, placement.num_devices, len(blocks))
    if max_devices * (E // placement.num_devices) < k:
        raise ValueError(f"max_devices={max_devices} devices hold fewer than top_k={k} of the {E} experts")
    for i, (_, block) in enumerate(blocks):
        router = family.router(
            block.gate,
            max_devices=max_devices,
            prune_method=prune_method,
            similarity_EE=None if similarity is None else torch.as_tensor(similarity[i]),
        )
        router.set_expert_device(torch.as_tensor(placement.expert_device_LE[i].copy(), device=block.gate.weight.device))
        block.experts.router = router


__all__ = ["LoadReport", "load_sharded", "set_routing_placement"]
