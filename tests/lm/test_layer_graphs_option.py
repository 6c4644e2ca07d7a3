"""`TrainConfig.layer_graphs` (`occult train --layer-graphs`) is refused before any step where a CUDA graph cannot
record the MoE layers: FSDP2 ranks (it frees the routers' weights between blocks), the count exchange (a host
wait), a CPU device; on several ranks every rank raises the same error, none is left in a collective. The replays
themselves need a GPU: tests/gpu/test_lm_layer_graphs_one_gpu.py."""

from __future__ import annotations

import pytest
from _train_helpers import config, load_tiny, refusal_on_rank, train_config

from occult.distributed import run_ranks
from occult.lm.model import OccultLM
from occult.lm.train import train

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.mark.parametrize("grad_sync, needle", [("fsdp", "grad_sync='fsdp'"), ("ddp", "--transport counts")])
def test_refused_on_every_rank_where_the_layers_cannot_be_recorded(tmp_path, grad_sync, needle):
    got = run_ranks(refusal_on_rank, 2, load_tiny(), str(tmp_path), grad_sync, "layer_graphs", timeout_s=180)
    assert len(got) == 2 and all(needle in message for message in got), got
    assert not list((tmp_path / grad_sync).glob("**/*.safetensors"))


def test_refused_without_a_cuda_device(tmp_path):
    data = load_tiny()
    model = OccultLM(config(data))
    with pytest.raises(ValueError, match="needs a CUDA device"):
        train(model, data, train_config(layer_graphs=True), tmp_path / "run", progress=False, log=None)
    assert not list((tmp_path / "run").glob("*.safetensors"))
    assert not any(layer.execution.graphs for layer in model.moe_layers())
