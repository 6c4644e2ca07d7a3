"""`TrainConfig.layer_graphs` (`occult train --layer-graphs`) is refused before any step where a CUDA graph cannot
record the MoE layers: FSDP2 ranks (it frees the routers' weights between blocks), the count exchange (a host
wait), a CPU device; on several ranks every rank raises the same error, none is left in a collective. The replays
themselves need a GPU: tests/gpu/test_lm_layer_graphs_one_gpu.py."""

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
    """The error `train` raises on this rank with layer graphs asked for (or "no error")."""
    par = setup_parallel()
    torch.manual_seed(0)
    model = shard_model(full_model(config(data), par), par, None)
    cfg = train_config(layer_graphs=True, grad_sync=grad_sync)
    try:
        train(model, data, cfg, Path(root) / grad_sync, parallel=par, progress=False, log=None)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("grad_sync, needle", [("fsdp", "grad_sync='fsdp'"), ("ddp", "--transport counts")])
def test_refused_on_every_rank_where_the_layers_cannot_be_recorded(tmp_path, grad_sync, needle):
    got = run_ranks(_refusal, 2, load_tiny(), str(tmp_path), grad_sync, timeout_s=180)
    assert len(got) == 2 and all(needle in message for message in got), got
    assert not list((tmp_path / grad_sync).glob("**/*.safetensors"))


def test_refused_without_a_cuda_device(tmp_path):
    data = load_tiny()
    model = OccultLM(config(data))
    with pytest.raises(ValueError, match="needs a CUDA device"):
        train(model, data, train_config(layer_graphs=True), tmp_path / "run", progress=False, log=None)
    assert not list((tmp_path / "run").glob("*.safetensors"))
    assert not any(layer.execution.graphs for layer in model.moe_layers())
