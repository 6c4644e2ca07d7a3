"""What the multi-rank training tests share (test_ddp.py, test_fsdp.py, test_parallel.py, test_replace.py):
the tiny model and corpus, the training settings, a run's snapshot, and the comparison with one process.

Imported by those modules at module level, so the ranks they spawn (`run_ranks`) import it too.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from occult.lm.data import TokenData
from occult.lm.fsdp import full_tensor
from occult.lm.model import ModelConfig, OccultLM
from occult.lm.parallel import full_model, shard_model
from occult.lm.train import TrainConfig, train

TINY = Path(__file__).resolve().parents[1] / "data" / "shakespeare_tiny"
MODEL = dict(hidden_size=32, num_layers=2, num_heads=2, num_experts=8, top_k=2, expert_ffn_size=16, max_seq_len=32)
# A non-contiguous placement: device of each expert, per layer.
PLACEMENT = [[1, 0, 0, 1, 0, 1, 1, 0], [0, 1, 1, 0, 1, 0, 0, 1]]
RTOL = 1e-5  # against one process (adam eps 1e-6: test_parallel.py's docstring says why)
TRAIN = dict(
    steps=20,
    batch_size=4,
    seq_len=32,
    lr=3e-3,
    warmup_steps=3,
    eval_every=10,
    save_every=10,
    eval_tokens=512,
    device="cpu",
    adam_eps=1e-6,
)


def load_tiny() -> TokenData:
    """The tiny Shakespeare corpus, tokenized (vocabulary 300, 10% validation)."""
    from occult.lm.data import load_dataset

    return load_dataset(TINY, vocab_size=300, val_fraction=0.1)


def train_config(**kw: Any) -> TrainConfig:
    """`TRAIN` with `kw` over it."""
    return TrainConfig(**{**TRAIN, **kw})


def config(data: TokenData, **kw: Any) -> ModelConfig:
    """The tiny model (`MODEL`, `kw` over it) on `data`'s vocabulary."""
    return ModelConfig(vocab_size=data.vocab_size, **{**MODEL, **kw})


def snapshot(model: OccultLM, result: Any) -> dict:
    """Losses per step, validation losses, every parameter (whole: a collective for FSDP shards) and
    the global ids of this rank's experts."""
    return {
        "losses": list(result.train_losses),
        "val": [h["val_loss"] for h in result.history],
        "params": {n: full_tensor(p.detach()).numpy().copy() for n, p in model.named_parameters()},
        "ids": {n: ids.numpy().copy() for n, (_, ids) in model.expert_parameters().items()},
    }


def run(
    par: Any,
    data: TokenData,
    out: Path,
    placement: Any = None,
    seed: int = 0,
    cfg: Callable[..., TrainConfig] = train_config,
    **kw: Any,
) -> dict:
    """Train a model seeded `seed`, sharded by `placement`, with `cfg(**kw["config"])` on `par` (the rest
    of `kw` goes to `train`); its snapshot."""
    torch.manual_seed(seed)
    model = shard_model(full_model(config(data), par), par, placement)
    c = cfg(**kw.pop("config", {}))
    return snapshot(model, train(model, data, c, out, parallel=par, progress=False, log=None, **kw))


def refusal_on_rank(rank: int, world_size: int, data: TokenData, root: str, grad_sync: str, option: str) -> str:
    """A `run_ranks` worker: the error `train` raises on this rank for an expert-parallel run with the boolean
    training option `option` (e.g. "captured_step") on and `grad_sync`, under `root/grad_sync` ("no error" if none)."""
    from occult.lm.parallel import setup_parallel

    par = setup_parallel()
    torch.manual_seed(0)
    model = shard_model(full_model(config(data), par), par, None)
    cfg = train_config(**{option: True, "grad_sync": grad_sync})
    try:
        train(model, data, cfg, Path(root) / grad_sync, parallel=par, progress=False, log=None)
    except ValueError as exc:
        return str(exc)
    return "no error"


def one_process(data: TokenData, c: TrainConfig, out: Path, seed: int = 0, **kw: Any) -> dict:
    """The one-process reference: the model seeded `seed`, trained with `c` (the rest of `kw` goes to
    `train`); its snapshot."""
    torch.manual_seed(seed)
    model = OccultLM(config(data))
    return snapshot(model, train(model, data, c, out, progress=False, log=None, **kw))


def rel(p: np.ndarray, q: np.ndarray) -> float:
    """max |p - q| / max |q|."""
    return float(np.abs(p - q).max() / max(np.abs(q).max(), 1e-30))


def assert_matches(got: dict, want: dict, rtol: float, steps: int = 20) -> None:
    """Losses per step, validation losses, and every parameter (full, or this rank's experts)."""
    assert len(got["losses"]) == len(want["losses"]) == steps
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=rtol)
    np.testing.assert_allclose(got["val"], want["val"], rtol=rtol)
    assert set(got["params"]) == set(want["params"])
    for name, p in got["params"].items():
        q = want["params"][name]
        if name in got["ids"] and len(want["ids"][name]) != len(got["ids"][name]):
            q = q[got["ids"][name]]  # one process holds every expert
        assert rel(p, q) <= rtol, f"{name}: max |diff| / max |weight| = {rel(p, q):.2e}"
