"""`occult profile --model DIR` for a transformers model directory.

`occult profile` serves two kinds of model: occult's own checkpoints (`occult.cli.lm`, running
`occult.lm.profile`) and Hugging Face transformers models (this module, running
`occult.integrations.hf.profile`). `is_transformers_model(path)` tells them apart
(a directory whose `config.json` names a `model_type`); `add_profile_arguments(parser)` adds the
options only this path needs, skipping any the parser already has, so both argument sets live
under one subcommand. Nothing here imports transformers until a profile actually runs.

    occult profile --model DIR --data calib.txt --out trace.safetensors [--tokens 65536]
    occult place --trace trace.safetensors --devices 4 --out placement.json

`--data`: a `.txt` file (documents one per line, tokenised with DIR's tokenizer), a `.jsonl`
file (field `text`), token ids in `.safetensors` (tensor `input_ids`), `.npy` or `.pt` (1-D
stream or [N, S]), or `random` (uniformly random ids, for smoke tests). The similarity table
for similarity pruning is written beside the trace (OUT.similarity.safetensors) or to
`--similarity PATH`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

_OWN_DEFAULTS = {"tokens": 65536, "batch_size": 8, "seq_len": None}


def is_transformers_model(path: str | os.PathLike) -> bool:
    """True for a directory holding a transformers `config.json` (with a `model_type`)."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    try:
        return "model_type" in json.loads(cfg.read_text())
    except (OSError, ValueError):
        return False


def add_profile_arguments(p: Any) -> None:
    """Add the transformers-only options of `occult profile` (existing ones are kept)."""
    have = set(getattr(p, "_option_string_actions", {}))

    def add(flag: str, **kw: Any) -> None:
        if flag not in have:
            p.add_argument(flag, **kw)

    add("--model", required=True, help="a transformers model directory (config.json + weights)")
    if "--model" in have and "transformers" not in (p._option_string_actions["--model"].help or ""):
        p._option_string_actions["--model"].help += ", or a transformers model directory (config.json)"
    add("--out", required=True, help="trace file to write (.safetensors)")
    add("--data", default=None,
        help="transformers models: calibration data (.txt, .jsonl, .safetensors/.npy/.pt token ids, or 'random')")
    add("--tokens", type=int, default=_OWN_DEFAULTS["tokens"], help="tokens to profile")
    add("--batch-size", type=int, default=_OWN_DEFAULTS["batch_size"])
    add("--seq-len", type=int, default=None, help="default: min(512, the model's max positions)")
    add("--scores", action="store_true", help="also store the router probabilities [T, E]")
    add("--similarity", default=None, help="similarity table path (default: OUT.similarity.safetensors)")
    add("--device", default="auto")
    add("--precision", default="auto", choices=["auto", "bf16", "fp32"])


def run_profile(args: Any) -> int:
    """Profile a transformers model directory (`args` from `add_profile_arguments`)."""
    import torch
    from transformers import AutoModelForCausalLM

    from occult.integrations import hf
    from occult.moe.pruning import similarity_path

    if not getattr(args, "data", None):
        raise ValueError("profiling a transformers model needs --data (a text/jsonl file, token ids, or 'random')")
    device = getattr(args, "device", "auto")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    precision = getattr(args, "precision", "auto")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(
        precision, torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    )
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device)
    hf.model_family(model)
    seq_len = getattr(args, "seq_len", None) or min(512, int(getattr(model.config, "max_position_embeddings", 512)))
    tokens = int(getattr(args, "tokens", None) or _OWN_DEFAULTS["tokens"])
    batch_size = int(getattr(args, "batch_size", None) or _OWN_DEFAULTS["batch_size"])
    ids = hf.token_stream(args.data, args.model, int(model.config.vocab_size))
    sim = getattr(args, "similarity", None) or str(similarity_path(args.out))
    batches = (b.to(device) for b in hf.calibration_windows(ids, seq_len, tokens).split(batch_size))
    trace = hf.profile(
        model, batches, scores="all" if getattr(args, "scores", False) else None, max_tokens=tokens,
        gather=False, path=args.out, similarity_path=sim,
        metadata={"checkpoint": str(args.model), "data": str(args.data)},
    )
    print(
        f"wrote {args.out}: {trace.num_layers} MoE layers x {trace.num_tokens[0]:,} tokens, "
        f"{trace.num_experts} experts, top-{trace.top_k}; similarity: {sim}"
    )
    print(f"next: occult place --trace {args.out} --devices D --out placement.json")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m occult.cli.hf --model DIR --data ... --out T` (what `occult profile` runs)."""
    import argparse

    p = argparse.ArgumentParser(prog="occult profile", description="record the routing trace of a transformers MoE model")
    add_profile_arguments(p)
    return run_profile(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
