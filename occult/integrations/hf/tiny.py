"""Tiny random models of every supported family, for tests and smoke runs (`tiny_config`,
`tiny_random_model`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from occult.integrations.hf.block import moe_blocks
from occult.integrations.hf.families import FAMILIES, UnsupportedModelError

# model type -> (its transformers config class, the tiny sizes): hidden 32, 2 MoE layers
TINY_SIZES: dict[str, tuple[str, dict[str, Any]]] = {
    "olmoe": (
        "OlmoeConfig",
        dict(
            num_hidden_layers=2,
            num_key_value_heads=2,
            intermediate_size=16,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=False,
        ),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            num_hidden_layers=3,
            num_key_value_heads=2,
            intermediate_size=24,
            mlp_only_layers=[1],
            moe_intermediate_size=16,
            shared_expert_intermediate_size=20,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=False,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            num_hidden_layers=2,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=24,
            moe_intermediate_size=16,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=True,
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        dict(
            num_hidden_layers=2, num_key_value_heads=2, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2
        ),
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            num_hidden_layers=3,
            num_key_value_heads=4,
            intermediate_size=24,
            moe_intermediate_size=16,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
        ),
    ),
}


def tiny_config(model_type: str, vocab_size: int = 96, **overrides: Any):
    """A tiny config of a supported family (hidden 32, 2 MoE layers; `TINY_SIZES`), for tests and smoke runs.

    Qwen2-MoE gets a dense decoder layer between its two MoE layers (`mlp_only_layers=[1]`),
    DeepSeek-V3 a dense first layer and 16 experts in 4 groups (2 allowed per token), so the
    MoE-layer numbering and group-limited routing are exercised.
    """
    import transformers

    if model_type not in TINY_SIZES:
        raise UnsupportedModelError(f"no tiny config for {model_type!r}; supported: {', '.join(sorted(FAMILIES))}")
    common = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        num_attention_heads=4,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        initializer_range=0.1,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )
    class_name, sizes = TINY_SIZES[model_type]
    return getattr(transformers, class_name)(**{**common, **sizes, **overrides})


def tiny_random_model(model_type: str, path: str | None = None, seed: int = 0, **overrides: Any) -> nn.Module:
    """A tiny random causal LM of `model_type` (saved to `path` if given).

    Router weights are drawn with std 1 (DeepSeek-V3's correction bias with std 0.1) so that
    top-k choices are well separated, not near-ties as with the default 0.02-scale init.
    """
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides))
    with torch.no_grad():
        for _, block in moe_blocks(model):
            nn.init.normal_(block.gate.weight, std=1.0)
            bias = getattr(block.gate, "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(0.1 * torch.randn_like(bias))
    if path is not None:
        model.save_pretrained(path)
    return model
