"""What the transformers fine-tuning tests share."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from occult.integrations import hf

# the device of each expert, per MoE layer, of the tiny two-layer models on two ranks
PLACEMENT = [[1, 0, 0, 1, 0, 1, 1, 0], [0, 1, 1, 0, 1, 0, 0, 1]]
# the fine-tuning tests' run: a few fp32 steps that visibly learn `markov_tokens`
CFG = dict(steps=15, batch_size=4, seq_len=16, lr=1e-2, warmup_steps=2, adam_eps=1e-6, seed=3, precision="fp32")


VOCAB = 96  # the tiny models' vocabulary in the fine-tuning tests


def tiny_olmoe(root: Path) -> str:
    """A tiny random OLMoE (seed 1, `VOCAB` ids) saved under `root/olmoe`: the model the fine-tuning tests train."""
    path = str(Path(root) / "olmoe")
    hf.tiny_random_model("olmoe", path, seed=1, vocab_size=VOCAB)
    return path


def finetune_tokens() -> torch.Tensor:
    """The fine-tuning tests' stream: `markov_tokens` over `VOCAB` ids."""
    return markov_tokens(VOCAB)


def markov_tokens(vocab: int) -> torch.Tensor:
    """4000 ids, each id's successor fixed 80% of the time (a stream fine-tuning visibly learns)."""
    g = torch.Generator().manual_seed(7)
    succ = torch.randperm(vocab, generator=g).clamp(min=3)
    noise, coin = torch.randint(3, vocab, (4000,), generator=g), torch.rand(4000, generator=g) < 0.2
    x = [5]
    for i in range(1, 4000):
        x.append(int(noise[i]) if coin[i] else int(succ[x[-1]]))
    return torch.tensor(x)


def trained_weights(model) -> dict[str, np.ndarray]:
    """Routers and every expert (gathered, expert-id order): a collective on a converted model."""
    out = {}
    for name, block in hf.moe_blocks(model):
        gate_up, down = block.experts.gather_experts()
        out[f"{name}.gate"] = block.gate.weight.detach().numpy().copy()
        out[f"{name}.gate_up_proj"], out[f"{name}.down_proj"] = gate_up.numpy(), down.numpy()
    return out
