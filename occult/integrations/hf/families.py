"""The transformers model families occult runs, and the checks a model and its blocks must pass.

`FAMILIES` maps a `config.model_type` to its MoE block class, its router's scoring family
(`occult.integrations.hf.routers`) and the shared-expert submodules the block keeps;
`check_transformers_version` and `model_family` reject what is not supported with a clear
`UnsupportedModelError`; `check_block` checks one MoE block's structure (fused SwiGLU
experts without biases, a gate with `top_k`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from occult.integrations.hf.routers import HFGateRouter, SigmoidGroupGateRouter, SoftmaxGateRouter

SUPPORTED_TRANSFORMERS = ">=5.17,<6"
_MIN_VERSION, _MAX_VERSION = (5, 17), (6, 0)


@dataclass(frozen=True)
class Family:
    """How one transformers model type lays out its MoE blocks."""

    model_type: str
    block_class: str  # class name of the model's MoE block
    router: type[HFGateRouter]  # scoring family (for device-limited routing)
    shared: tuple[str, ...] = ()  # local, replicated submodules kept from the block


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("olmoe", "OlmoeSparseMoeBlock", SoftmaxGateRouter),
        Family("qwen2_moe", "Qwen2MoeSparseMoeBlock", SoftmaxGateRouter, ("shared_expert", "shared_expert_gate")),
        Family("qwen3_moe", "Qwen3MoeSparseMoeBlock", SoftmaxGateRouter),
        Family("mixtral", "MixtralSparseMoeBlock", SoftmaxGateRouter),
        Family("deepseek_v3", "DeepseekV3MoE", SigmoidGroupGateRouter, ("shared_experts",)),
    )
}
_UNSUPPORTED = {
    "gpt_oss": "GPT-OSS experts have biases and a clamped SwiGLU (alpha=1.702, limit 7) on interleaved "
    "gate/up columns; occult's experts compute the plain SwiGLU of the fused [gate; up] layout",
}


class UnsupportedModelError(ValueError):
    """The model is not one whose MoE blocks occult can run expert-parallel."""


def check_transformers_version() -> str:
    """Return transformers' version; raise below 5.0, warn outside the tested range."""
    import transformers
    from packaging.version import Version

    v = Version(transformers.__version__)
    if v.major < 5:
        raise UnsupportedModelError(
            f"occult.integrations.hf needs transformers {SUPPORTED_TRANSFORMERS} (fused 3-D expert tensors and "
            f"routers returning (logits, weights, ids), new in 5.0); found {transformers.__version__}: "
            f"pip install 'transformers{SUPPORTED_TRANSFORMERS}'"
        )
    if not _MIN_VERSION <= (v.major, v.minor) < _MAX_VERSION:
        warnings.warn(
            f"occult.integrations.hf is tested with transformers {SUPPORTED_TRANSFORMERS}, found "
            f"{transformers.__version__}; every MoE block is still checked structurally before use",
            stacklevel=3,
        )
    return transformers.__version__


def model_family(model: nn.Module) -> Family:
    """The `Family` of a transformers model (by `config.model_type`), or a clear error."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    why = _UNSUPPORTED.get(model_type, "not one of the supported model types")
    raise UnsupportedModelError(
        f"model type {model_type!r} is not supported ({why}); supported: {', '.join(sorted(FAMILIES))}"
    )


def check_block(name: str, block: nn.Module, family: Family) -> tuple[int, int, int, int]:
    """Structural check of a model's MoE block; returns (E, k, H, F)."""
    experts, gate = getattr(block, "experts", None), getattr(block, "gate", None)
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == down.dim() == 3):
        raise UnsupportedModelError(
            f"{name}: expected fused expert tensors experts.gate_up_proj [E, 2F, H] and experts.down_proj "
            f"[E, H, F] (transformers {SUPPORTED_TRANSFORMERS}); found {type(experts).__name__}"
        )
    E, F2, H = gate_up.shape
    if F2 % 2 or tuple(down.shape) != (E, H, F2 // 2):
        raise UnsupportedModelError(f"{name}: expert shapes {list(gate_up.shape)} / {list(down.shape)} do not match")
    if any(n.endswith("bias") for n, _ in experts.named_parameters()):
        raise UnsupportedModelError(f"{name}: experts with biases are not supported")
    act = getattr(experts, "act_fn", None)
    if act is None or (not isinstance(act, nn.SiLU) and type(act).__name__ not in ("SiLUActivation", "SiLU")):
        raise UnsupportedModelError(f"{name}: expert activation {type(act).__name__} is not SiLU (SwiGLU experts only)")
    if gate is None or not hasattr(gate, "top_k") or int(getattr(gate, "num_experts", E)) != E:
        raise UnsupportedModelError(f"{name}: the block's gate has no top_k or disagrees on the expert count")
    if not 1 <= int(gate.top_k) <= E:
        raise UnsupportedModelError(
            f"{name}: the gate picks top_k={int(gate.top_k)} of {E} experts: the config's "
            f"experts per token (num_experts_per_tok) must be 1..{E}"
        )
    for sub in family.shared:
        if getattr(block, sub, None) is None:
            raise UnsupportedModelError(f"{name}: expected submodule {sub!r} in a {family.model_type} MoE block")
    return E, int(gate.top_k), H, F2 // 2


def group_size(group: Any) -> tuple[int, int]:
    """(size, this rank) of a process group (None: the default group, or (1, 0) without one)."""
    if group is None and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)
