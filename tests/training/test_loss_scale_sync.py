"""Each rank's loss scaled by `occult.training.grads.loss_scale` (1/W) and the gradients summed
(`sync_gradients(..., average=False)`, `BucketedSync(..., divide=1)`, DDP through `wrap_ddp(summed=True)`) give the
gradients the divided path gives, bit for bit on 2 ranks (scaling by a power of two is exact), and those of the
global batch's mean loss in one process; the summed path touches no expert gradient after the backward."""

from __future__ import annotations

import random

import torch
import torch.nn as nn

from occult.distributed import run_ranks
from occult.training.bucketed_sync import BucketedSync
from occult.training.grads import loss_scale, sync_gradients, wrap_ddp
from occult.training.parallel import setup_parallel

WORLD = 2


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 9), nn.Tanh(), nn.Linear(9, 4))


def _batch(seed: int, rank: int) -> torch.Tensor:
    return torch.randn(7, 6, generator=torch.Generator().manual_seed(seed * 31 + rank))


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _worker(rank: int, world: int, seed: int) -> dict:
    par = setup_parallel(ep_size=world)  # one EP group: no replicas, so "expert" gradients are only divided
    x = _batch(seed, rank)
    out = {}
    for how in ("divided", "summed", "bucketed", "ddp"):
        model = _model(seed)
        dense, experts = list(model[:2].parameters()), list(model[2:].parameters())  # the last layers as "experts"
        scale = 1.0 if how == "divided" else loss_scale(par)
        bucketed = BucketedSync(dense, par.sync_group, 1) if how == "bucketed" else None
        ignore = [n for n, _ in model.named_parameters() if not n.startswith("0.")]
        forward = wrap_ddp(model, ignore, par, summed=True) if how == "ddp" else model
        (_loss(forward, x) * scale).backward()
        before = [p.grad.data_ptr() for p in experts], [p.grad.clone() for p in experts]
        if bucketed is not None:
            bucketed.finish()
            bucketed.close()
        if how in ("bucketed", "ddp"):
            sync_gradients(dense, experts, par, replicated=False, average=False)
        else:
            sync_gradients(dense, experts, par, replicated=True, average=how == "divided")
        out[how] = _grads(model)
        if how != "divided":  # nothing rewrote the expert gradients
            out[f"{how}_experts_untouched"] = [p.grad.data_ptr() for p in experts] == before[0] and all(
                torch.equal(p.grad, g) for p, g in zip(experts, before[1])
            )
    return out


def test_scaled_losses_summed_give_the_divided_gradients_bit_for_bit_and_the_global_mean():
    seed = random.randrange(2**31)
    got = run_ranks(_worker, WORLD, seed, timeout_s=120)
    # the global batch's mean loss in one process: the mean of the ranks' means (equal rows per rank)
    ref = _model(seed)
    sum(_loss(ref, _batch(seed, r)) for r in range(WORLD)).div(WORLD).backward()
    n_dense = len(list(ref[:2].parameters()))
    for rank, out in enumerate(got):
        assert all(out[f"{how}_experts_untouched"] for how in ("summed", "bucketed", "ddp")), (rank, seed)
        for i, (a, b, c, d) in enumerate(zip(out["divided"], out["summed"], out["bucketed"], out["ddp"])):
            assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d), (rank, i, seed)
        for i, (g, p) in enumerate(zip(out["summed"][:n_dense], ref.parameters())):  # dense: every rank's tokens
            tol = 1e-6 * float(p.grad.abs().max()) + 1e-12
            assert torch.allclose(g, p.grad, rtol=1e-5, atol=tol), (rank, i, seed)
    assert all(torch.equal(a, b) for a, b in zip(got[0]["summed"][:n_dense], got[1]["summed"][:n_dense]))
