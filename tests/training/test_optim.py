"""`occult.training.optim`: which parameter groups take AdamW's fused kernel (CUDA ones only: on a GPU,
tests/gpu/test_fused_adamw_one_gpu.py), and that the trainers' optimizers keep their groups and settings."""

from __future__ import annotations

import torch

from occult.training.optim import adamw, fusable


def test_cpu_and_empty_groups_keep_the_for_each_path():
    a, b = torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(2))
    assert not fusable([a, b]) and not fusable([])
    opt = adamw([{"params": [a], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}], lr=1e-3, eps=1e-6)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert all(not g["fused"] and g["lr"] == 1e-3 and g["eps"] == 1e-6 for g in opt.param_groups)
    assert not fusable([torch.zeros(2, dtype=torch.long)])  # not floating point


def test_a_group_mixing_shards_and_plain_tensors_is_not_fused(monkeypatch):
    """FSDP2's DTensors and plain tensors in one group: neither kernel takes the list (the trainers split them)."""
    from occult.training import optim

    a, b = torch.nn.Parameter(torch.randn(2)), torch.nn.Parameter(torch.randn(2))
    monkeypatch.setattr(optim, "is_sharded", lambda p: p is a)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # as on a GPU
    assert optim.fusable([a]) and optim.fusable([b]) and not optim.fusable([a, b])
