"""Helpers shared by the micro-batch schedule tests (two interleaved halves, paired micro-batches) on CPU gloo
ranks and on GPUs: the exchanges' call order, and the order combined 1F1B must issue them in."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from occult.moe import comm


@contextlib.contextmanager
def exchange_events() -> Iterator[list[tuple[str, int]]]:
    """Inside: every `_Exchange` forward ("f", its index) and backward ("b", its forward's index), in call order."""
    events: list[tuple[str, int]] = []
    forward, backward = comm._Exchange.forward, comm._Exchange.backward
    count = [0]

    def logged_forward(ctx, *args):
        ctx.logged_index = count[0]
        count[0] += 1
        events.append(("f", ctx.logged_index))
        return forward(ctx, *args)

    def logged_backward(ctx, *grads):
        events.append(("b", ctx.logged_index))
        return backward(ctx, *grads)

    comm._Exchange.forward, comm._Exchange.backward = staticmethod(logged_forward), staticmethod(logged_backward)
    try:
        yield events
    finally:
        comm._Exchange.forward, comm._Exchange.backward = staticmethod(forward), staticmethod(backward)


def paired_order(count: int, per_pass: int) -> list[tuple[str, int]]:
    """The first forward's exchanges, then each next forward's alternating with the previous backward's (the forward
    first; a backward issues its forward's exchanges in reverse), then the last backward's."""
    order = [("f", j) for j in range(per_pass)]
    for i in range(1, count):
        forward = [("f", i * per_pass + j) for j in range(per_pass)]
        backward = [("b", (i - 1) * per_pass + j) for j in reversed(range(per_pass))]
        order += [event for pair in zip(forward, backward) for event in pair]
    return order + [("b", (count - 1) * per_pass + j) for j in reversed(range(per_pass))]
