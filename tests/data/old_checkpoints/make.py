"""Writes the resume-compatibility fixtures in this directory with the code of a given checkout.

These were written by occult at commit 7bd1d94 (before `occult.training` existed), with:

    git archive 7bd1d94 | tar -x -C /tmp/occult_old
    PYTHONPATH=/tmp/occult_old python tests/data/old_checkpoints/make.py tests/data/old_checkpoints

tests/lm/test_resume_compat.py and tests/integrations/test_hf_resume.py resume them with today's
code and compare the continuation with what the old code did uninterrupted (`reference.json`).

    lm_one/      a one-process `occult train` run stopped at step 4 of 8 (checkpoint.safetensors)
    lm_two/      a 2-rank run (gloo) stopped at step 4 of 8: the sharded DCP checkpoint
    hf_one/      a one-process `hf.finetune` run (tiny OLMoE) stopped at step 3 of 6
    reference.json  the old code's losses of the uninterrupted runs
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

LM_MODEL = dict(hidden_size=16, num_layers=2, num_heads=2, num_experts=4, top_k=2, expert_ffn_size=8, max_seq_len=16)
LM_TRAIN = dict(
    steps=8,
    batch_size=4,
    seq_len=16,
    lr=3e-3,
    warmup_steps=2,
    eval_every=4,
    save_every=4,
    eval_tokens=128,
    device="cpu",
    adam_eps=1e-6,
)
HF_TRAIN = dict(steps=6, batch_size=2, seq_len=8, lr=1e-2, warmup_steps=1, adam_eps=1e-6, seed=3, precision="fp32")
VOCAB = 48
HF_MODEL = dict(vocab_size=96, hidden_size=16, num_attention_heads=2, intermediate_size=4)


def lm_data():
    from occult.lm.data import TokenData

    g = torch.Generator().manual_seed(7)
    return TokenData(
        torch.randint(0, VOCAB, (3000,), generator=g), torch.randint(0, VOCAB, (400,), generator=g), VOCAB, {}
    )


def lm_model(par=None):
    from occult.lm.model import ModelConfig
    from occult.lm.parallel import full_model, shard_model

    torch.manual_seed(0)
    model = full_model(ModelConfig(vocab_size=VOCAB, **LM_MODEL), par)
    return shard_model(model, par) if par is not None else model


def hf_tokens():
    return torch.randint(3, 96, (600,), generator=torch.Generator().manual_seed(11))


def _two_ranks(rank: int, world_size: int, out: str) -> list:
    from occult.lm.parallel import setup_parallel
    from occult.lm.train import TrainConfig, train

    par = setup_parallel()
    res = train(
        lm_model(par), lm_data(), TrainConfig(**LM_TRAIN), out, parallel=par, stop_after=4, progress=False, log=None
    )
    return res.train_losses


def main(out: Path) -> None:
    from occult.distributed import run_ranks
    from occult.integrations import hf
    from occult.lm.train import TrainConfig, train

    out.mkdir(parents=True, exist_ok=True)
    for d in ("lm_one", "lm_two", "hf_one"):
        shutil.rmtree(out / d, ignore_errors=True)
    ref = {}
    with tempfile.TemporaryDirectory() as tmp:
        ref["lm_straight"] = train(
            lm_model(), lm_data(), TrainConfig(**LM_TRAIN), f"{tmp}/straight", progress=False, log=None, plot=False
        ).train_losses
        train(lm_model(), lm_data(), TrainConfig(**LM_TRAIN), out / "lm_one", stop_after=4, progress=False, log=None)
        run_ranks(_two_ranks, 2, str(out / "lm_two"), timeout_s=300)
        model_dir = f"{tmp}/olmoe"
        hf.tiny_random_model("olmoe", model_dir, seed=1, **HF_MODEL)
        cfg = hf.FinetuneConfig(**HF_TRAIN)
        ref["hf_straight"] = hf.finetune(hf.load_sharded(model_dir), hf_tokens(), cfg, progress=False, log=None).losses
        hf.finetune(
            hf.load_sharded(model_dir),
            hf_tokens(),
            cfg,
            progress=False,
            log=None,
            checkpoint_dir=out / "hf_one",
            stop_after=3,
        )
    for d in ("lm_one", "lm_two"):  # the weights files are not what is tested
        for f in ("best.safetensors", "metrics.jsonl"):
            (out / d / f).unlink(missing_ok=True)
    (out / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
