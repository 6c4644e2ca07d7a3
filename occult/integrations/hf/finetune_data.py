"""The token stream of `occult.integrations.hf.finetune`: texts tokenized by the model's own tokenizer
(`tokenize_texts`), and each rank's rows of a global batch of windows (`batch_rows`)."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def batch_rows(
    tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int, step: int, rank: int = 0, world_size: int = 1
) -> torch.Tensor:
    """Rows [rank*B/W, (rank+1)*B/W) of global batch `step`: [B/W, S+1] windows of the stream."""
    n = tokens.numel() - seq_len - 1
    if n < 1:
        raise ValueError(f"the data hold {tokens.numel()} tokens, too few for seq_len={seq_len}")
    if batch_size % world_size:
        raise ValueError(f"the global batch size {batch_size} is not divisible by the {world_size} ranks")
    g = torch.Generator().manual_seed((int(seed) * 1_000_003 + int(step)) % (2**63 - 1))
    per = batch_size // world_size
    start = torch.randint(0, n + 1, (batch_size,), generator=g)[rank * per : (rank + 1) * per]
    return tokens[start[:, None] + torch.arange(seq_len + 1)[None, :]]


def tokenize_texts(texts: list[str], model_dir: str | os.PathLike, vocab_size: int) -> tuple[torch.Tensor, str]:
    """(1-D token ids, how): the model's own tokenizer when `model_dir` has one (documents joined by
    its EOS token), else the UTF-8 bytes as ids 0-255 (needs `vocab_size` >= 256)."""
    d = Path(model_dir)
    if any((d / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(d))
        sep = [tok.eos_token_id] if tok.eos_token_id is not None else []
        ids = [i for t in texts for i in tok(t, add_special_tokens=False)["input_ids"] + sep]
        return torch.tensor(ids, dtype=torch.int64), f"the model's tokenizer {type(tok).__name__}"
    if vocab_size < 256:
        raise ValueError(
            f"{d} has no tokenizer and its vocabulary ({vocab_size}) is too small for UTF-8 bytes: "
            "give token ids (--data)"
        )
    data = b"\n".join(t.encode("utf-8") for t in texts)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(
        torch.int64
    ), "no tokenizer in the model directory: UTF-8 bytes as ids"


__all__ = ["batch_rows", "tokenize_texts"]
