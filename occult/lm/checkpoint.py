"""Model weights files of `OccultLM`: save, read, check and load (safetensors).

Weights file (`save_model` / `load_model`, safetensors): tensors `model.<parameter name>`
(the tied head is stored once, as the embedding), optional `routing.similarity.<layer>`;
metadata `model_config` (JSON), `routing` (JSON: max_devices, method, placement) and
anything the caller adds. Training checkpoints (`occult.lm.train`) use the same file layout plus
optimizer tensors, so every checkpoint loads as a model.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Sequence

import torch

from occult._atomic import atomic_path
from occult.lm.fsdp import like_param
from occult.lm.model import ModelConfig, OccultLM, RoutingSpec
from occult.placement import Placement

FORMAT_TAG = "occult-lm-v1"


class CheckpointError(ValueError):
    """A model or training checkpoint that is missing, corrupted or does not match the model."""


def model_tensors(model: OccultLM) -> dict[str, torch.Tensor]:
    """`model.<name>` for every parameter (tied weights once), plus routing similarity tables."""
    out = {f"model.{n}": p.detach().contiguous().cpu() for n, p in model.named_parameters()}
    if model.routing.similarity is not None:
        for i, s in enumerate(model.routing.similarity):
            out[f"routing.similarity.{i}"] = s.detach().to(torch.float32).contiguous().cpu()
    return out


def model_metadata(model: OccultLM) -> dict[str, str]:
    return {"format": FORMAT_TAG, "model_config": json.dumps(model.config.to_dict()), "routing": model.routing.to_json()}


def save_model(path: str | os.PathLike, model: OccultLM, metadata: Mapping[str, Any] | None = None) -> None:
    """Write the model's weights, config and routing rule (safetensors, atomically)."""
    import safetensors.torch

    meta = {str(k): (v if isinstance(v, str) else json.dumps(v)) for k, v in (metadata or {}).items()}
    meta.update(model_metadata(model))
    with atomic_path(path) as tmp:
        safetensors.torch.save_file(model_tensors(model), str(tmp), metadata=meta)


def read_checkpoint(path: str | os.PathLike, prefixes: Sequence[str] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a checkpoint file, with clear errors for missing/corrupt files."""
    from safetensors import safe_open

    p = str(path)
    if not os.path.exists(p):
        raise CheckpointError(f"checkpoint {p} does not exist")
    if os.path.isdir(p):
        raise CheckpointError(f"{p} is a directory; pass the .safetensors checkpoint file inside it")
    try:
        with safe_open(p, framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys() if prefixes is None or k.startswith(tuple(prefixes))}
    except Exception as exc:
        raise CheckpointError(
            f"{p} is not a readable safetensors checkpoint ({type(exc).__name__}: {exc}); is it truncated or "
            "corrupted? Use an earlier checkpoint or train again"
        ) from None
    if meta.get("format") != FORMAT_TAG or "model_config" not in meta:
        raise CheckpointError(f"{p} is not an occult model checkpoint (metadata format={meta.get('format')!r})")
    return tensors, meta


def config_from_metadata(meta: Mapping[str, str], source: str = "checkpoint") -> ModelConfig:
    try:
        return ModelConfig.from_dict(json.loads(meta["model_config"]))
    except (ValueError, TypeError, KeyError) as exc:
        raise CheckpointError(f"{source}: bad model_config in metadata ({exc})") from None


def load_weights(model: OccultLM, tensors: Mapping[str, torch.Tensor], source: str = "checkpoint") -> None:
    """Copy `model.<name>` tensors into `model`; every parameter must be present with its shape."""
    params = dict(model.named_parameters())
    have = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    missing = sorted(set(params) - set(have))
    unexpected = sorted(set(have) - set(params))
    if missing or unexpected:
        raise CheckpointError(
            f"{source} does not match the model: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    with torch.no_grad():
        for name, p in params.items():
            t = have[name]
            if tuple(t.shape) != tuple(p.shape):
                raise CheckpointError(f"{source}: {name} has shape {list(t.shape)}, the model expects {list(p.shape)}")
            p.copy_(like_param(t.to(p.dtype), p))  # a full tensor into an FSDP shard: this rank's part


def routing_from_metadata(meta: Mapping[str, str], tensors: Mapping[str, torch.Tensor]) -> RoutingSpec:
    doc = json.loads(meta.get("routing", "null") or "null")
    if not doc:
        return RoutingSpec()
    placement = None if doc.get("placement") is None else Placement.from_json_dict(doc["placement"], "checkpoint routing")
    sims = None
    if doc.get("similarity"):
        n = 0
        while f"routing.similarity.{n}" in tensors:
            n += 1
        sims = [tensors[f"routing.similarity.{i}"] for i in range(n)]
    return RoutingSpec(doc.get("max_devices"), doc.get("method", "score"), placement, sims)


def load_model(
    path: str | os.PathLike, device: torch.device | str | None = None, routing: bool = True, group: Any = None
) -> OccultLM:
    """Build an `OccultLM` from any occult checkpoint (weights file or training checkpoint).

    `routing=True` restores the routing rule it was saved with (e.g. a pruned fine-tune). `group`:
    the process group its MoE layers span (default: the default group, or one process); pass a
    one-rank group for a full single-process copy inside a multi-rank job.
    """
    tensors, meta = read_checkpoint(path, prefixes=("model.", "routing."))
    cfg = config_from_metadata(meta, str(path))
    model = OccultLM(cfg, group=group)
    load_weights(model, tensors, str(path))
    if routing:
        spec = routing_from_metadata(meta, tensors)
        if spec.max_devices is not None:
            model.set_routing(spec.max_devices, spec.placement, spec.method, spec.similarity)
    if device is not None:
        model.to(device)
    return model


__all__ = [
    "CheckpointError",
    "save_model",
    "load_model",
    "read_checkpoint",
    "load_weights",
    "model_tensors",
    "model_metadata",
    "config_from_metadata",
    "routing_from_metadata",
]
