"""What the transformers fine-tuning tests share."""

from __future__ import annotations

import numpy as np

from occult.integrations import hf


def trained_weights(model) -> dict[str, np.ndarray]:
    """Routers and every expert (gathered, expert-id order): a collective on a converted model."""
    out = {}
    for name, block in hf.moe_blocks(model):
        gate_up, down = block.experts.gather_experts()
        out[f"{name}.gate"] = block.gate.weight.detach().numpy().copy()
        out[f"{name}.gate_up_proj"], out[f"{name}.down_proj"] = gate_up.numpy(), down.numpy()
    return out
