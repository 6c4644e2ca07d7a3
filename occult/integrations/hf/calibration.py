"""Token ids to profile a transformers model with (`token_stream`) and their windows
(`calibration_windows`): text or JSONL tokenised with the model's tokenizer, token-id files
(.safetensors, .npy, .pt), or uniformly random ids ("random", for smoke tests).
"""

from __future__ import annotations

import json
from pathlib import Path


def token_stream(data: str, model_dir: str, vocab_size: int):
    """A 1-D LongTensor of token ids, or a 2-D [N, S] one, from the --data argument."""
    import numpy as np
    import torch

    if data == "random":
        g = torch.Generator().manual_seed(0)
        return torch.randint(0, vocab_size, (1 << 20,), generator=g)
    path = Path(data)
    if not path.is_file():
        raise ValueError(f"--data {data}: no such file (give .txt, .jsonl, .safetensors, .npy, .pt or 'random')")
    suffix = path.suffix.lower()
    if suffix in (".txt", ".jsonl"):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        lines = path.read_text(encoding="utf-8").splitlines()
        texts = (
            [json.loads(line)["text"] for line in lines if line.strip()]
            if suffix == ".jsonl"
            else [line for line in lines if line.strip()]
        )
        ids: list[int] = []
        sep = [tok.eos_token_id] if tok.eos_token_id is not None else []
        for text in texts:
            ids.extend(tok(text, add_special_tokens=True)["input_ids"] + sep)
        return torch.tensor(ids, dtype=torch.int64)
    if suffix == ".safetensors":
        from safetensors.torch import load_file

        tensors = load_file(str(path))
        t = tensors.get("input_ids", next(iter(tensors.values())) if len(tensors) == 1 else None)
        if t is None:
            raise ValueError(f"--data {data}: expected a tensor named 'input_ids' (found {sorted(tensors)})")
        return t.to(torch.int64)
    if suffix == ".npy":
        return torch.as_tensor(np.load(path)).to(torch.int64)
    if suffix == ".pt":
        return torch.as_tensor(torch.load(path, weights_only=True)).to(torch.int64)
    raise ValueError(f"--data {data}: unknown format {suffix!r}")


def calibration_windows(ids, seq_len: int, tokens: int):
    """[N, S] windows holding at least `tokens` tokens (fewer if the data runs out)."""
    if ids.dim() == 2:
        windows = ids[:, :seq_len]
    else:
        n = ids.numel() // seq_len
        windows = ids[: n * seq_len].view(n, seq_len) if n else ids[None]
    return windows[: max(1, -(-tokens // windows.shape[1]))]
