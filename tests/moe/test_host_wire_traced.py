"""A traced exchange over the host transport stays the host transport: torch.compile keeps it as one opaque
operator (`occult::host_all_to_all`) that calls the wire at run time, forward and backward, with no graph break.
Checked here on the CPU with a stand-in wire (one rank, rows reversed: a transport no real one is, so a path that
skipped it shows); the real wire against NCCL under Inductor: tests/gpu/test_collective_traced_moe.py."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from occult.moe import host_wire
from occult.moe.comm import CommStats, exchange
from occult.moe.host_wire import HostWire


class StandInWire(HostWire):
    """One rank's wire whose exchange reverses the rows (and counts its calls)."""

    def __init__(self, name: str) -> None:  # (no group, no GPU: nothing of HostWire's own state is used)
        self.name, self.calls = name, []

    def all_to_all(self, x: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        assert sum(send_splits) == x.shape[0] == sum(recv_splits)
        self.calls.append((list(send_splits), list(recv_splits)))
        return x.flip(0).clone()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_traced_exchange_calls_the_wire_forward_and_backward(monkeypatch, backend):
    from torch._dynamo.utils import counters

    wire = StandInWire(f"stand-in-{random.randrange(1 << 30)}")
    monkeypatch.setitem(host_wire._WIRES, wire.name, wire)
    rows = torch.randn(random.randint(2, 40), 8, requires_grad=True)
    weight = torch.randn(rows.shape)
    state = SimpleNamespace(stats=CommStats(), rank=0)  # (what the exchange books its rows in)

    def loss(x: torch.Tensor) -> torch.Tensor:
        got, _, _ = exchange(x, None, None, [x.shape[0]], [x.shape[0]], wire, state)
        return (got * weight).sum()

    want = torch.autograd.grad(loss(rows), rows)[0]
    assert len(wire.calls) == 2  # eager: the forward's exchange and the backward's
    torch._dynamo.reset()
    counters.clear()
    got = torch.autograd.grad(torch.compile(loss, backend=backend, fullgraph=True)(rows), rows)[0]
    assert not counters["graph_break"]
    assert len(wire.calls) == 4 and wire.calls[2:] == [([rows.shape[0]], [rows.shape[0]])] * 2
    assert torch.equal(got, want) and torch.equal(want, weight.flip(0))


def test_the_operator_gives_the_received_shape_without_running():
    from torch._subclasses.fake_tensor import FakeTensorMode

    send, recv = [random.randint(0, 9) for _ in range(3)], [random.randint(0, 9) for _ in range(3)]
    with FakeTensorMode():
        x = torch.empty(sum(send), 4, 2, dtype=torch.bfloat16)
        out = torch.ops.occult.host_all_to_all(x, send, recv, "no wire")  # (a real call would need the wire)
    assert out.shape == (sum(recv), 4, 2) and out.dtype == torch.bfloat16
