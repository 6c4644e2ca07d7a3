"""Two-batch overlap (`occult.two_batch_overlap`) on 1-3 spawned gloo ranks.

A small sequence model (a causal-mean "attention" stand-in, then an MoE layer, per block) runs
its batch as two interleaved halves; outputs and every gradient must equal a single-process
reference with `DenseMoE` layers over the global batch. Also: the halves really interleave at
the all-to-alls (forward and backward), tiny batches fall back to one piece on every rank, bad
input in one half raises on every rank, and the split follows grad mode and inference.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from occult import RoutingError, two_batch_overlap
from occult.distributed import run_ranks
from occult.moe.dense import DenseMoE
from occult.moe.layer import OccultMoE
from occult.placement import Placement

TOL = {torch.float64: 1e-10, torch.float32: 2e-5}


def _half() -> str:
    """'A' or 'B' in a two-batch thread, '-' elsewhere."""
    name = threading.current_thread().name
    return name[-1] if name.startswith("occult-two-batch-") else "-"


class Block(nn.Module):
    """h + tanh(W causal_mean(h)), then h + moe(h): batch rows stay independent, tokens mix."""

    def __init__(self, hidden: int, moe: nn.Module, dtype: torch.dtype, log: list | None = None) -> None:
        super().__init__()
        self.mix = nn.Linear(hidden, hidden, dtype=dtype)
        self.moe, self.log, self.index = moe, log, 0

    def forward(self, h_BSH: torch.Tensor) -> torch.Tensor:
        if self.log is not None:
            self.log.append(("fwd", _half(), self.index))
        steps = torch.arange(1, h_BSH.shape[1] + 1, dtype=h_BSH.dtype)[:, None]
        h_BSH = h_BSH + torch.tanh(self.mix(h_BSH.cumsum(1) / steps))
        out = h_BSH + self.moe(h_BSH)
        if self.log is not None and out.requires_grad:
            tag = ("bwd", _half(), self.index)
            out.register_hook(lambda g, tag=tag: self.log.append(tag))
        return out


def _models(case: dict, world_size: int, log: list | None = None) -> tuple[nn.Sequential, nn.Sequential]:
    torch.manual_seed(case["seed"])
    dtype, E, H, K = case["dtype"], case["experts"], case["hidden"], case["top_k"]
    placement = Placement.contiguous(E, world_size) if case["placement"] == "contiguous" else Placement(
        torch.randperm(E, generator=torch.Generator().manual_seed(case["seed"])).numpy()[None] % world_size, world_size)
    ref_blocks, ep_blocks = [], []
    for i in range(case["layers"]):
        dense = DenseMoE(H, 12, E, K, norm_topk_prob=case["norm"], dtype=dtype)
        with torch.no_grad():
            dense.router.gate.weight.mul_(3.0)
        ref = Block(H, dense, dtype)
        ep = Block(H, OccultMoE.from_dense(dense, placement=placement, dispatcher=case["dispatcher"],
                                           sync_free=case.get("sync_free", False)), dtype, log)
        ep.mix.load_state_dict(ref.mix.state_dict())
        ep.index = i
        ref_blocks.append(ref)
        ep_blocks.append(ep)
    return nn.Sequential(*ref_blocks), nn.Sequential(*ep_blocks)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).norm().item() / max(b.norm().item(), 1e-30)


def check_case(rank: int, world_size: int, case: dict) -> dict:
    """This rank's relative errors (TBO vs the global single-process reference) and the event log."""
    log: list = []
    ref, ep = _models(case, world_size, log)
    dtype, rows, S, H = case["dtype"], case["rows"], case["seq"], case["hidden"]
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    x_all = torch.randn(sum(rows), S, H, dtype=dtype, generator=gen)
    g_all = torch.randn(sum(rows), S, H, dtype=dtype, generator=gen)
    x_ref = x_all.clone().requires_grad_()
    (ref(x_ref) * g_all).sum().backward()
    y_ref = ref(x_all).detach()
    sl = slice(sum(rows[:rank]), sum(rows[: rank + 1]))
    x = x_all[sl].clone().requires_grad_()
    if case.get("no_grad"):
        with torch.no_grad():
            y = two_batch_overlap(ep, x)
        return {"errors": {"output": _rel(y, y_ref[sl])}, "log": log, "requires_grad": y.requires_grad}
    y = two_batch_overlap(ep, x)
    (y * g_all[sl]).sum().backward()
    errors = {"output": _rel(y, y_ref[sl]), "grad_x": _rel(x.grad, x_ref.grad[sl])}
    for i, (rb, eb) in enumerate(zip(ref, ep)):
        replicated = {"mix.weight": (eb.mix.weight.grad, rb.mix.weight.grad),
                      "router": (eb.moe.router.gate.weight.grad, rb.moe.router.gate.weight.grad)}
        for name, (mine, want) in replicated.items():
            mine = mine.clone()
            if world_size > 1:
                dist.all_reduce(mine)
            errors[f"{i}.{name}"] = _rel(mine, want)
        ids = eb.moe.local_expert_ids
        errors[f"{i}.gate_up"] = _rel(eb.moe.gate_up_proj.grad, rb.moe.gate_up_proj.grad[ids])
        errors[f"{i}.down"] = _rel(eb.moe.down_proj.grad, rb.moe.down_proj.grad[ids])
    return {"errors": errors, "log": log}


def run_cases(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    return [check_case(rank, world_size, case) for case in cases]


def _case(**kw) -> dict:
    base = dict(dtype=torch.float64, experts=8, hidden=16, top_k=2, norm=False, placement="contiguous",
                dispatcher="dedup", layers=2, seq=5, seed=random.randrange(2**31))
    base.update(kw)
    return base


def _interleaved(log: list, layers: int) -> bool:
    """Forward blocks entered A0 B0 A1 B1 ...: each half waits for the other at every layer."""
    fwd = [(h, i) for kind, h, i in log if kind == "fwd"]
    return fwd == [(h, i) for i in range(layers) for h in "AB"]


def _check(cases: list[dict], per_rank: list[list[dict]], split: bool = True) -> None:
    for i, case in enumerate(cases):
        for rank, res in enumerate(r[i] for r in per_rank):
            for name, err in res["errors"].items():
                assert err <= TOL[case["dtype"]], f"case {case}, rank {rank}: {name} relative error {err:.3e}"
            if split:
                assert _interleaved(res["log"], case["layers"]), (case, rank, res["log"])


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_two_batch_matches_single_process_reference(world_size):
    rng = random.Random()
    uneven = [rng.randrange(2, 7) for _ in range(world_size)]  # odd sizes give unequal halves
    E = 12 if world_size == 3 else 8
    cases = []
    for dispatcher in ("dedup", "standard"):
        cases += [
            _case(dispatcher=dispatcher, rows=uneven, top_k=3, placement="permuted", norm=True),
            _case(dispatcher=dispatcher, rows=uneven, top_k=1, layers=3),
            _case(dispatcher=dispatcher, rows=uneven, top_k=E, dtype=torch.float32),  # top-k = all
            _case(dispatcher=dispatcher, rows=[4] * world_size, top_k=2, sync_free=True, placement="permuted"),
        ]
    cases.append(_case(rows=uneven, no_grad=True))
    for case in cases:
        case["experts"] = E
    _check(cases, run_ranks(run_cases, world_size, cases, timeout_s=240, collective_timeout_s=60))


def test_backward_interleaves_the_halves():
    """Autograd runs the halves' nodes latest-created first: their gradients arrive block by block,
    alternating halves, not one whole half after the other."""
    case = _case(rows=[4, 4], layers=3)
    per_rank = run_ranks(run_cases, 2, [case], timeout_s=120, collective_timeout_s=60)
    for res in (r[0] for r in per_rank):
        bwd = [(h, i) for kind, h, i in res["log"] if kind == "bwd"]
        assert sorted(bwd) == sorted((h, i) for i in range(3) for h in "AB"), bwd
        layers = [i for _, i in bwd]
        assert layers == sorted(layers, reverse=True), f"halves not interleaved in backward: {bwd}"


def test_tiny_batch_runs_unsplit_on_every_rank():
    """One rank with a single row: every rank runs its batch whole (no rank left waiting)."""
    cases = [_case(rows=[1, 5]), _case(rows=[3, 1], dispatcher="standard")]
    per_rank = run_ranks(run_cases, 2, cases, timeout_s=120, collective_timeout_s=60)
    _check(cases, per_rank, split=False)
    for res in (r for rr in per_rank for r in rr):
        assert {h for kind, h, _ in res["log"] if kind == "fwd"} == {"-"}  # the caller's thread: not split


def bad_half(rank: int, world_size: int, seed: int) -> str:
    _, ep = _models(_case(rows=[4] * world_size, seed=seed), world_size)
    x = torch.randn(4, 5, 16, dtype=torch.float64)
    if rank == 1:
        x[0, 0, 0] = float("nan")  # in the first half of rank 1 only
    try:
        two_batch_overlap(ep, x)
    except RoutingError as exc:
        return str(exc)
    return "no error"


def test_bad_input_in_one_half_raises_on_every_rank():
    messages = run_ranks(bad_half, 2, random.randrange(2**31), timeout_s=120, collective_timeout_s=30)
    for msg in messages:
        assert "rank 1" in msg and "NaN" in msg, msg


def checkpointed_half(rank: int, world_size: int, seed: int, reentrant: bool) -> str:
    from torch.utils.checkpoint import checkpoint

    _, ep = _models(_case(rows=[4] * world_size, seed=seed), world_size)
    x = torch.randn(4, 5, 16, dtype=torch.float64, requires_grad=True)
    try:
        y = two_batch_overlap(lambda h: checkpoint(ep, h, use_reentrant=reentrant), x)
        y.square().sum().backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_of_moe_layers_is_refused_on_every_rank(reentrant):
    """Recomputing a MoE layer in backward would exchange outside the halves' order: a clear error, no hang."""
    messages = run_ranks(checkpointed_half, 2, random.randrange(2**31), reentrant, timeout_s=120, collective_timeout_s=30)
    for msg in messages:
        assert "recomputed during backward" in msg and "two_batch_overlap" in msg, msg


def test_checkpointing_without_two_batch_still_works():
    """The check is off for layers not run under two_batch_overlap (and after a plain forward again)."""
    from torch.utils.checkpoint import checkpoint

    ref, ep = _models(_case(rows=[4], seed=random.randrange(2**31)), 1)
    x = torch.randn(4, 5, 16, dtype=torch.float64, requires_grad=True)
    two_batch_overlap(ep, x)  # marks the layers; the plain forward below clears the mark
    checkpoint(ep, x, use_reentrant=False).sum().backward()
    g, x.grad = x.grad, None
    ref(x).sum().backward()
    assert _rel(g, x.grad) < TOL[torch.float64]


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="batch in dim 0"):
        two_batch_overlap(lambda a, b: a, torch.zeros(4, 2), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="at least one tensor"):
        two_batch_overlap(lambda n: n, 3)
    with pytest.raises(ValueError, match="0-dim"):
        two_batch_overlap(lambda a: a.sum(), torch.zeros(4, 2))
    out = two_batch_overlap(lambda a, scale: {"y": a * scale, "tag": "t"}, torch.arange(6.0)[:, None], 2.0)
    assert out["tag"] == "t" and torch.equal(out["y"], 2 * torch.arange(6.0)[:, None])
