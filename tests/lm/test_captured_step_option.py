"""`TrainConfig.captured_step` (`occult train --captured-step`) is refused before any step where the whole step
cannot be recorded: DDP's reducer on several ranks (every rank raises the same error, none is left in a
collective), re-placement, a CPU device (FSDP2 gets as far as that: its units are recorded with the step);
nothing is written. The recorded step itself needs a GPU:
tests/gpu/test_captured_step_one_gpu.py (the loop's plumbing: tests/training/test_step_graph.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _train_helpers import config, load_tiny, train_config

from occult.distributed import run_ranks
from occult.lm.model import OccultLM
from occult.lm.parallel import full_model, setup_parallel, shard_model
from occult.lm.train import train

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _refusal(rank: int, world_size: int, data, root: str, grad_sync: str) -> str:
    """The error `train` raises on this rank with a captured step asked for (or "no error")."""
    par = setup_parallel()
    torch.manual_seed(0)
    model = shard_model(full_model(config(data), par), par, None)
    cfg = train_config(captured_step=True, grad_sync=grad_sync)
    try:
        train(model, data, cfg, Path(root) / grad_sync, parallel=par, progress=False, log=None)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(
    "grad_sync, needle", [("ddp", "--grad-sync explicit"), ("fsdp", "CUDA device"), ("explicit", "CUDA device")]
)
def test_refused_on_every_rank_where_the_step_cannot_be_recorded(tmp_path, grad_sync, needle):
    got = run_ranks(_refusal, 2, load_tiny(), str(tmp_path), grad_sync, timeout_s=180)
    assert len(got) == 2 and all(needle in message for message in got), got
    assert not list((tmp_path / grad_sync).glob("**/*.safetensors"))


@pytest.mark.parametrize("kw, needle", [({}, "needs a CUDA device"), ({"replace_every": 5}, "re-placement")])
def test_refused_in_one_process(tmp_path, kw, needle):
    data = load_tiny()
    model = OccultLM(config(data))
    with pytest.raises(ValueError, match=needle):
        train(model, data, train_config(captured_step=True, **kw), tmp_path / "run", progress=False, log=None)
    assert not list((tmp_path / "run").glob("*.safetensors"))
