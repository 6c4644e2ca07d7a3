"""Which transport a dispatcher gets (`occult.moe.symm.choose_transport`) where the device
transport cannot run (CPU gloo ranks): "auto" and "counts" give the count exchange, "device" a
clear error naming why; NCCL_P2P_DISABLE is a reason for "auto" to keep the count exchange. (On
NCCL GPUs of one host "auto" gives the dedup dispatchers the device transport: the GPU suite.)"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from occult import OccultMoE
from occult.distributed import run_ranks
from occult.moe import symm


def choice_worker(rank: int, world: int) -> dict:
    group = dist.group.WORLD
    out = {name: symm.choose_transport(name, group) is None for name in ("auto", "counts")}
    try:
        symm.choose_transport("device", group)
    except ValueError as e:
        out["device_error"] = str(e)
    layers = {d: OccultMoE(16, 8, 4, 2, dispatcher=d) for d in ("dedup", "standard")}
    out["names"] = {d: layer.dispatcher.transport_name for d, layer in layers.items()}
    out["repr"] = repr(layers["dedup"])
    return out


def test_auto_takes_the_count_exchange_on_gloo_and_device_says_why_not():
    for out in run_ranks(choice_worker, 2, timeout_s=120):
        assert out["auto"] and out["counts"], out
        why = out["device_error"]
        assert "device transport cannot run here" in why and ("no CUDA GPU" in why or "not nccl" in why), out
        assert out["names"] == {"dedup": "counts", "standard": "counts"}, out
        assert "transport=counts" in out["repr"]


def test_a_bad_choice_and_a_group_of_one_rank():
    with pytest.raises(ValueError, match="transport must be one of"):
        symm.choose_transport("nvshmem", None)
    assert symm.choose_transport("device", None) is None  # one rank: nothing to send


def test_nccl_p2p_disable_keeps_auto_off_the_peer_stores(monkeypatch):
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    assert "NCCL_P2P_DISABLE" in symm._peer_trouble()
