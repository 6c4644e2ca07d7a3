"""`TrainConfig.captured_step` (`occult train --captured-step`) is refused before any step where the whole step
cannot be recorded: DDP's reducer on several ranks (every rank raises the same error, none is left in a
collective), re-placement, a CPU device (FSDP2 gets as far as that: its units are recorded with the step);
nothing is written. The recorded step itself needs a GPU:
tests/gpu/test_captured_step_one_gpu.py (the loop's plumbing: tests/training/test_step_graph.py)."""

from __future__ import annotations

import pytest
from _train_helpers import config, load_tiny, refusal_on_rank, train_config

from occult.distributed import run_ranks
from occult.lm.model import OccultLM
from occult.lm.train import train

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.mark.parametrize(
    "grad_sync, needle", [("ddp", "--grad-sync explicit"), ("fsdp", "CUDA device"), ("explicit", "CUDA device")]
)
def test_refused_on_every_rank_where_the_step_cannot_be_recorded(tmp_path, grad_sync, needle):
    got = run_ranks(refusal_on_rank, 2, load_tiny(), str(tmp_path), grad_sync, "captured_step", timeout_s=180)
    assert len(got) == 2 and all(needle in message for message in got), got
    assert not list((tmp_path / grad_sync).glob("**/*.safetensors"))


@pytest.mark.parametrize("kw, needle", [({}, "needs a CUDA device"), ({"replace_every": 5}, "re-placement")])
def test_refused_in_one_process(tmp_path, kw, needle):
    data = load_tiny()
    model = OccultLM(config(data))
    with pytest.raises(ValueError, match=needle):
        train(model, data, train_config(captured_step=True, **kw), tmp_path / "run", progress=False, log=None)
    assert not list((tmp_path / "run").glob("*.safetensors"))
