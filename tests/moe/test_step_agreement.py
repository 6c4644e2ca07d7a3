"""`occult.agreed_step`: one agreement of the device transport's ranks per training step, on CPU gloo ranks.

The stand-in transport (`_gloo_transport`) moves the rows with gloo; the routing statuses it delivers
are deferred as a GPU's are (queued, read by a later call), so the step's error paths run as on GPUs:
a rank's bad input raises on that rank after its call's all-to-alls and on every other rank at its
next layer call or the backward's first all-to-all, and nobody is left inside an all-to-all.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn as nn
from _gloo_transport import GlooTransport  # (tests/moe)

from occult import DenseMoE, OccultMoE, Placement, RoutingError, agreed_step
from occult.distributed import run_ranks
from occult.moe import status as pending

E, H, F, LAYERS = 8, 16, 8, 3


@pytest.fixture(autouse=True)
def step_agreement_on(monkeypatch):
    """The step agreement is opt-in (`OCCULT_AGREEMENT=step`); the ranks inherit the environment."""
    monkeypatch.setenv("OCCULT_AGREEMENT", "step")


def defer_statuses() -> None:
    """Queue CPU statuses as CUDA ones are (read later by `take_ready` / `check_routing`), not at once."""
    pending.queue = lambda status_D: pending._PENDING.append((status_D.reshape(-1).clone(), None))


def make_stack(seed: int, world: int, top_k: int) -> tuple[nn.ModuleList, list[DenseMoE], GlooTransport]:
    """LAYERS device-transport layers sharing one stand-in transport, and their dense references."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    denses = [DenseMoE(H, F, E, top_k, dtype=torch.float64) for _ in range(LAYERS)]
    placement = Placement(torch.randperm(E, generator=gen).remainder(world).numpy()[None], world)
    layers = nn.ModuleList(OccultMoE.from_dense(d, placement, dispatcher="dedup") for d in denses)
    transport = GlooTransport(layers[0].dispatcher.group)
    for layer in layers:
        layer.dispatcher.transport = transport
    return layers, denses, transport


def run_stack(layers, x: torch.Tensor, bad: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """h = h + layer(h) through the stack; `bad[i]` replaces layer i's input."""
    h = x
    for i, layer in enumerate(layers):
        h = h + layer(bad[i] if bad and i in bad else h)
    return h


def step(layers, x, g, agreed: bool, declared: int | None = None):
    """One training step (forward, backward) inside `agreed_step` or not: (output, x grad, parameter grads)."""
    for p in layers.parameters():
        p.grad = None
    x = x.clone().requires_grad_()
    ctx = agreed_step(layers, x.shape[0] if declared is None else declared) if agreed else _no_step()
    with ctx:
        y = run_stack(layers, x)
        (y * g).sum().backward()
    return y.detach(), x.grad, [p.grad.clone() for p in layers.parameters()]


class _no_step:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def exactness_worker(rank: int, world: int, seed: int, tokens: tuple[int, ...], top_k: int) -> dict:
    defer_statuses()
    layers, denses, transport = make_stack(seed, world, top_k)
    agrees = []
    real_agree = transport.agree
    transport.agree = lambda *a: agrees.append(a) or real_agree(*a)
    out = {"worst": 0.0, "agrees": [], "bounds": []}
    for n in range(2):
        gen = torch.Generator().manual_seed(seed + 100 * n + rank)
        x = torch.randn(tokens[rank], H, dtype=torch.float64, generator=gen)
        g = torch.randn(x.shape, dtype=torch.float64, generator=gen)
        before = len(agrees)
        stepped = step(layers, x, g, agreed=True)
        out["agrees"].append(len(agrees) - before)  # blocking agreements in the step: its first only
        per_call = step(layers, x, g, agreed=False)
        with torch.no_grad():
            ref = x.clone()
            for d in denses:
                ref = ref + d(ref)
        pairs = [(stepped[0], per_call[0]), (stepped[1], per_call[1]), (stepped[0], ref)]
        pairs += list(zip(stepped[2], per_call[2]))
        out["worst"] = max([out["worst"]] + [float((a - b).abs().max()) if a.numel() else 0.0 for a, b in pairs])
    with agreed_step(layers, tokens[rank]) as bound:
        out["bounds"].append(bound)
    out["step_tokens_after"] = transport.step_tokens
    return out


@pytest.mark.parametrize(
    "tokens,top_k",
    [((5, 40), 3), ((0, 12), 1), ((7, 7), E)],
    ids=["uneven", "empty-rank-top1", "topk-all"],
)
def test_a_step_agreed_once_equals_per_call_agreement_and_reference(tokens, top_k):
    results = run_ranks(exactness_worker, 2, random.randrange(2**31), tokens, top_k, timeout_s=180)
    for out in results:
        assert out["worst"] < 1e-12, out
        assert out["agrees"] == [1, 1], out  # the layer calls posted, none waited for an agreement
        assert out["bounds"] == [max(tokens)] and out["step_tokens_after"] is None, out


def bad_call_worker(rank: int, world: int, seed: int, at_layer: int, kind: str) -> dict:
    """Rank 1 breaks layer `at_layer`'s call inside a step; then both ranks run a clean step."""
    defer_statuses()
    layers, _, transport = make_stack(seed, world, 2)
    x = torch.randn(6, H, dtype=torch.float64)
    g = torch.randn_like(x)
    bad = {}
    if rank == 1:
        bad[at_layer] = torch.randn(6, 7, dtype=torch.float64) if kind == "hidden" else torch.randn(9, H).double()
    out = {}
    try:
        with agreed_step(layers, 6):
            y = run_stack(layers, x.clone().requires_grad_(), bad)
            out["forward"] = "done"
            (y * g).sum().backward()
        out["error"] = "no error"
    except (RoutingError, ValueError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["step_tokens_after"] = transport.step_tokens
    out["pending_after"] = len(pending._PENDING)
    clean = step(layers, x, g, agreed=True)
    again = step(layers, x, g, agreed=False)
    out["clean"] = float((clean[0] - again[0]).abs().max())
    return out


@pytest.mark.parametrize("at_layer", [1, LAYERS - 1], ids=["middle-layer", "last-layer"])
@pytest.mark.parametrize("kind", ["hidden", "over-bound"])
def test_bad_input_inside_a_step_raises_on_every_rank(at_layer, kind):
    results = run_ranks(bad_call_worker, 2, random.randrange(2**31), at_layer, kind, timeout_s=180)
    own = "hidden size 7" if kind == "hidden" else "has 9 tokens but the training step's agreement allows at most 6"
    peer = "rank 1: input hidden size" if kind == "hidden" else "rank 1: more tokens than the training step's"
    assert results[1]["error"].startswith("ValueError") and own in results[1]["error"], results[1]
    assert results[0]["error"].startswith("RoutingError") and peer in results[0]["error"], results[0]
    # a peer of a bad call in the last layer finishes the forward and stops at the backward's first all-to-all
    assert ("forward" in results[0]) == (at_layer == LAYERS - 1), results[0]
    for out in results:
        assert out["step_tokens_after"] is None and out["pending_after"] == 0 and out["clean"] < 1e-12, out


def routing_worker(rank: int, world: int, seed: int) -> dict:
    """NaN gates from rank 1's first call inside a step: raised on every rank a few calls later."""
    defer_statuses()
    layers, _, _ = make_stack(seed, world, 2)
    x = torch.randn(6, H, dtype=torch.float64)
    bad = {0: x.clone()}
    if rank == 1:
        bad[0][2, 3] = float("nan")
    try:
        with agreed_step(layers, 6):
            run_stack(layers, x, bad)
        return "no error"
    except RoutingError as exc:
        return str(exc)


def test_routing_status_inside_a_step_reaches_every_rank():
    for out in run_ranks(routing_worker, 2, random.randrange(2**31), timeout_s=120):
        assert "rank 1: router produced NaN" in out, out


def setting_worker(rank: int, world: int, seed: int) -> dict:
    layers, _, transport = make_stack(seed, world, 2)
    with agreed_step(layers, 4) as bound:
        seen = transport.step_tokens
        layers[0](torch.randn(4, H, dtype=torch.float64))
    errors = []
    for bad in (-1, 2.5, True):
        try:
            with agreed_step(layers, bad):
                pass
        except ValueError as exc:
            errors.append(str(exc))
    return {"bound": bound, "seen": seen, "errors": errors}


@pytest.mark.parametrize("agreement", ["call", None])  # None: unset, the default
def test_occult_agreement_call_keeps_the_per_call_agreement(monkeypatch, agreement):
    if agreement is None:
        monkeypatch.delenv("OCCULT_AGREEMENT")
    else:
        monkeypatch.setenv("OCCULT_AGREEMENT", agreement)
    for out in run_ranks(setting_worker, 2, random.randrange(2**31), timeout_s=120):
        assert out["bound"] is None and out["seen"] is None, out
        assert len(out["errors"]) == 3 and all("an int >= 0" in e for e in out["errors"]), out


def nested_worker(rank: int, world: int, seed: int) -> str:
    layers, _, _ = make_stack(seed, world, 2)
    with agreed_step(layers, 4):
        try:
            with agreed_step(layers, 4):
                return "no error"
        except RuntimeError as exc:
            return str(exc)


def test_nested_steps_are_refused():
    for out in run_ranks(nested_worker, 2, random.randrange(2**31), timeout_s=120):
        assert "cannot be nested" in out, out


def test_a_model_without_device_transport_layers_agrees_nothing():
    layer = OccultMoE(H, F, E, 2, dtype=torch.float64)  # one rank: no transport
    with agreed_step(nn.Sequential(layer), 3) as bound:
        y = layer(torch.randn(3, H, dtype=torch.float64))
    assert bound is None and y.shape == (3, H)


def entry_error_worker(rank: int, world: int, seed: int) -> dict:
    """A routing status from a call before the step: raised on every rank as the step begins, and the
    transport is left outside any step."""
    defer_statuses()
    layers, _, transport = make_stack(seed, world, 2)
    x = torch.randn(6, H, dtype=torch.float64)
    bad = x.clone()
    if rank == 0:
        bad[1, 1] = float("nan")
    layers[0](bad)  # per-call agreement: the status is queued, read by a later call
    try:
        with agreed_step(layers, 6):
            return {"error": "no error"}
    except RoutingError as exc:
        error = str(exc)
    return {"error": error, "step_tokens": transport.step_tokens, "after": tuple(run_stack(layers, x).shape)}


def test_an_earlier_status_is_raised_as_the_step_begins_and_leaves_no_step():
    for out in run_ranks(entry_error_worker, 2, random.randrange(2**31), timeout_s=120):
        assert "rank 0: router produced NaN" in out["error"], out
        assert out["step_tokens"] is None and out["after"] == (6, H), out
