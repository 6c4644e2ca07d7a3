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

`occult finetune --hf DIR` runs in `occult.cli.hf_finetune` (re-exported here).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from occult.cli.hf_finetune import (  # noqa: F401  (occult.cli uses add_finetune_arguments, run_finetune here)
    add_finetune_arguments,
    quiet_unless_terminal,
    run_finetune,
)
from occult.cli.hf_flags import note_when_given
from occult.cli.inputs import check_data, loading_model, read_hf_config, read_token_ids
from occult.cli.registry import CommandError, check_output, positive_int
from occult.cli.run_checks import check_device, writing_named

_OWN_DEFAULTS = {"tokens": 65536, "batch_size": 8, "seq_len": None}
# (flag, dest, default) of `occult profile`'s flags for occult checkpoints (occult.cli.lm_args), refused here when
# the command line names them (`note_when_given`) or a caller's namespace holds another value
PROFILE_OCCULT_CHECKPOINT_ONLY = (
    ("--corpus-dir", "corpus_dir", None),
    ("--tokenizer", "tokenizer", None),
    ("--split", "split", "train"),
    ("--as-routed", "as_routed", False),
)


def is_transformers_model(path: str | os.PathLike) -> bool:
    """True for a directory holding a transformers `config.json` (a JSON object with a `model_type`)."""
    if not (Path(path) / "config.json").is_file():
        return False
    try:
        read_hf_config("--model", path)
    except CommandError:
        return False
    return True


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
    add(
        "--data",
        default=None,
        help="transformers models: calibration data (.txt, .jsonl, .safetensors/.npy/.pt token ids, or 'random')",
    )
    add(
        "--tokens",
        type=positive_int,
        default=_OWN_DEFAULTS["tokens"],
        help=f"tokens to profile (default {_OWN_DEFAULTS['tokens']})",
    )
    add(
        "--batch-size",
        type=positive_int,
        default=_OWN_DEFAULTS["batch_size"],
        help=f"sequences per forward pass (default {_OWN_DEFAULTS['batch_size']})",
    )
    add("--seq-len", type=positive_int, default=None, help="default: min(512, the model's max positions)")
    add("--scores", action="store_true", help="also store the router probabilities [T, E]")
    add("--similarity", default=None, help="similarity table path (default: OUT.similarity.safetensors)")
    add("--device", default="auto", help="auto (cuda if present, else cpu), cpu, cuda, cuda:1, ... (default auto)")
    add(
        "--precision",
        default="auto",
        choices=["auto", "bf16", "fp32"],
        help="auto: bf16 on GPU, fp32 on CPU (default auto)",
    )
    for flag, _, _ in PROFILE_OCCULT_CHECKPOINT_ONLY:
        action = p._option_string_actions.get(flag)
        if action is not None and "occult checkpoints only" not in (action.help or ""):
            action.help += " (occult checkpoints only)"
    note_when_given(p, [flag for flag, _, _ in PROFILE_OCCULT_CHECKPOINT_ONLY])


def run_profile(args: Any) -> int:
    """Profile a transformers model directory (`args` from `add_profile_arguments`)."""
    import torch
    from transformers import AutoModelForCausalLM

    from occult.integrations import hf
    from occult.integrations.hf.families import check_block
    from occult.moe.pruning import similarity_path

    quiet_unless_terminal()

    if not getattr(args, "data", None):
        raise ValueError("profiling a transformers model needs --data (a text/jsonl file, token ids, or 'random')")
    for flag, dest, default in PROFILE_OCCULT_CHECKPOINT_ONLY:
        if flag in getattr(args, "given_flags", ()) or getattr(args, dest, default) != default:
            raise CommandError(
                f"{flag} applies to occult checkpoints only; a transformers model is profiled on --data "
                "(tokenized with the model's own tokenizer)"
            )
    check_data(args.data)
    check_output("--out", args.out, "trace.safetensors")
    check_output("--similarity", getattr(args, "similarity", None), "similarity.safetensors")
    check_device(getattr(args, "device", "auto"))
    device = getattr(args, "device", "auto")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    precision = getattr(args, "precision", "auto")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(
        precision, torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    )
    with loading_model("--model", args.model):
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device)
        family = hf.model_family(model)
        for name, block in hf.moe_blocks(model):  # a bad config (e.g. top-k outside 1..E) names --model
            check_block(name, block, family)
        max_positions = int(getattr(model.config, "max_position_embeddings", 512))
    seq_len = getattr(args, "seq_len", None) or min(512, max_positions)
    tokens = int(getattr(args, "tokens", None) or _OWN_DEFAULTS["tokens"])
    batch_size = int(getattr(args, "batch_size", None) or _OWN_DEFAULTS["batch_size"])
    ids = read_token_ids(args.data, args.model, int(model.config.vocab_size))
    sim = getattr(args, "similarity", None) or str(similarity_path(args.out))
    batches = (b.to(device) for b in hf.calibration_windows(ids, seq_len, tokens).split(batch_size))
    with writing_named(("--similarity", getattr(args, "similarity", None)), ("--out", args.out)):
        trace = hf.profile(
            model,
            batches,
            scores="all" if getattr(args, "scores", False) else None,
            max_tokens=tokens,
            gather=False,
            path=args.out,
            similarity_path=sim,
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

    p = argparse.ArgumentParser(
        prog="occult profile", description="record the routing trace of a transformers MoE model"
    )
    add_profile_arguments(p)
    return run_profile(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
