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
import re
from collections.abc import Mapping, Sequence
from typing import Any

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
    return {
        "format": FORMAT_TAG,
        "model_config": json.dumps(model.config.to_dict()),
        "routing": model.routing.to_json(),
    }


def save_model(path: str | os.PathLike, model: OccultLM, metadata: Mapping[str, Any] | None = None) -> None:
    """Write the model's weights, config and routing rule (safetensors, atomically)."""
    import safetensors.torch

    meta = {str(k): (v if isinstance(v, str) else json.dumps(v)) for k, v in (metadata or {}).items()}
    meta.update(model_metadata(model))
    with atomic_path(path) as tmp:
        safetensors.torch.save_file(model_tensors(model), str(tmp), metadata=meta)


def read_checkpoint(
    path: str | os.PathLike, prefixes: Sequence[str] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
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


MAX_SEQ_LEN = 1 << 20  # rotary tables are [max_seq_len, head_dim / 2]: a corrupt size must not allocate them


def _check_values(cfg: ModelConfig) -> None:
    """What `ModelConfig` leaves to its callers: numbers, flags and a bounded max_seq_len."""
    if cfg.max_seq_len > MAX_SEQ_LEN:
        raise ValueError(f"max_seq_len must be at most {MAX_SEQ_LEN}, got {cfg.max_seq_len}")
    for name in ("rope_theta", "rms_eps", "init_std"):
        v = getattr(cfg, name)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < float("inf"):
            raise ValueError(f"{name} must be a positive finite number, got {v!r}")
    for name in ("norm_topk_prob", "tie_embeddings"):
        if not isinstance(getattr(cfg, name), bool):
            raise ValueError(f"{name} must be true or false, got {getattr(cfg, name)!r}")


def config_from_metadata(meta: Mapping[str, str], source: str = "checkpoint") -> ModelConfig:
    """The checkpoint's `ModelConfig`, every value checked (`CheckpointError` naming `source`)."""
    try:
        cfg = ModelConfig.from_dict(json.loads(meta["model_config"]))
        _check_values(cfg)
        return cfg
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
        raise CheckpointError(f"{source}: bad model_config in metadata ({exc})") from None


def check_sizes(cfg: ModelConfig, tensors: Mapping[str, torch.Tensor], source: str = "checkpoint") -> None:
    """Refuse a `model_config` that the checkpoint's own tensors contradict, before a model of that
    size is built: a corrupt size must be an error, not an allocation of any size."""
    want = {
        "model.embed.weight": (cfg.vocab_size, cfg.hidden_size),
        "model.blocks.0.moe.moe.router.gate.weight": (cfg.num_experts, cfg.hidden_size),
        "model.blocks.0.moe.moe.down_proj": (cfg.num_experts, cfg.hidden_size, cfg.expert_ffn_size),
    }
    for key, shape in want.items():
        t = tensors.get(key)
        got = "missing" if t is None else f"shape {list(t.shape)}"
        if t is None or tuple(t.shape) != shape:
            raise CheckpointError(f"{source}: {key} is {got}, but the metadata's model_config says {list(shape)}")
    blocks = {int(m.group(1)) for k in tensors if (m := re.match(r"model\.blocks\.(\d+)\.", k))}
    if blocks != set(range(cfg.num_layers)):
        raise CheckpointError(
            f"{source}: holds {len(blocks)} decoder block(s), but the metadata's model_config says "
            f"num_layers={cfg.num_layers}"
        )


def load_weights(model: OccultLM, tensors: Mapping[str, torch.Tensor], source: str = "checkpoint") -> None:
    """Copy `model.<name>` tensors into `model`; every parameter must be present with its shape."""
    params = dict(model.named_parameters())
    have = {k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")}
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
    placement = (
        None if doc.get("placement") is None else Placement.from_json_dict(doc["placement"], "checkpoint routing")
    )
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
    check_sizes(cfg, tensors, str(path))
    with torch.random.fork_rng(devices=[]):  # every weight is loaded next: no init, the caller's RNG untouched
        model = OccultLM(cfg, group=group, init_weights=False)
    load_weights(model, tensors, str(path))
    if routing:
        try:
            spec = routing_from_metadata(meta, tensors)
            if spec.max_devices is not None:
                model.set_routing(spec.max_devices, spec.placement, spec.method, spec.similarity)
        except (ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError) as exc:
            raise CheckpointError(f"{path}: bad routing in the metadata ({type(exc).__name__}: {exc})") from None
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
    "check_sizes",
    "routing_from_metadata",
]
