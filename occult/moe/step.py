"""One agreement of the ranks per training step instead of one per layer call (`agreed_step`).

The device transport (`occult.moe.symm`) sizes each call's all-to-alls by the largest token count
of any rank, which the ranks' hosts swap at every layer call (`occult.moe.agree`). Each host
waits there for the slowest one: where the ranks' hosts reach a layer at different times (FSDP2's
host work in a step differs between ranks) every layer call waits for the latest host, and the
GPU idles meanwhile (docs/training.md, "Where FSDP2's time goes").

In a training step every MoE layer call sees the same tokens, so the bound can be agreed once,
when the step begins. Inside the step a call posts its statuses without waiting and reads the
previous call's (`occult.moe.device_exchange.agree_and_check`): a host waits only for a peer more
than one layer call behind. What the per-call agreement guaranteed still holds:

- bad input on one rank (wrong hidden size or dtype, more tokens than agreed) raises on every
  rank: that rank takes part in its call's all-to-alls with no rows, then raises; the others raise
  `RoutingError` at their next layer call, the backward's first all-to-all, or the step's end,
  before any all-to-all the failing rank will not enter;
- routing statuses (ids out of range, NaN gates) travel with the rows as before and are raised at
  the next agreement or `check_routing()`;
- buffers grow, all or nothing, when the step's bound needs it (on its first call).

Opt-in: `OCCULT_AGREEMENT=step` (docs/settings.md) turns it on. The default, `call`, keeps the
per-call agreement until the step agreement has run and been timed on GPUs (docs/training.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.nn as nn

from occult import settings
from occult.moe import status as pending
from occult.moe.device_exchange import agree_and_check, settle_step
from occult.moe.layer import OccultMoE
from occult.moe.symm import DeviceTransport


def step_transports(module: nn.Module) -> list[DeviceTransport]:
    """The device transports `module`'s MoE layers agree over (several ranks, not sync-free), each once."""
    found: dict[int, DeviceTransport] = {}
    for layer in module.modules():
        if not isinstance(layer, OccultMoE) or layer.num_ranks == 1 or layer.sync_free:
            continue
        transport = layer.dispatcher.transport
        if isinstance(transport, DeviceTransport):
            found.setdefault(id(transport), transport)
    return list(found.values())


@contextlib.contextmanager
def agreed_step(module: nn.Module, num_tokens: int) -> Iterator[int | None]:
    """Agree once, for the step inside the block (forward and backward), on the largest token count of
    any rank (module docstring); yields it (None where `module` has no device-transport layer or
    `OCCULT_AGREEMENT` is not `step`). Every rank of each layer's group enters together, passing the largest
    token count of any MoE layer call it will make in the step (a call with more raises on every
    rank). Errors of earlier calls (routing statuses) are raised here, on every rank."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"agreed_step needs this rank's token count per layer call (an int >= 0), got {num_tokens!r}")
    transports = step_transports(module) if settings.current().agreement == "step" else []
    if any(t.step_tokens is not None for t in transports):
        raise RuntimeError("agreed_step blocks cannot be nested: a step is already being agreed on")
    if transports and pending.capturing():
        raise RuntimeError("agreed_step cannot begin inside a CUDA-graph capture or torch.compile")
    bound, ok = None, False
    try:
        for transport in transports:  # (an error here leaves no transport in a step: `finally`)
            transport.step_tokens = agree_and_check(transport, num_tokens, 0)
            bound = transport.step_tokens if bound is None else max(bound, transport.step_tokens)
        yield bound
        ok = True
    finally:
        error: Exception | None = None
        for transport in transports:  # every transport leaves the step, whatever the first one raises
            try:
                if ok and error is None:
                    settle_step(transport)  # the step's last call, checked on every rank
            except Exception as exc:  # noqa: BLE001  (raised below, once every transport has left)
                error = exc
            finally:
                transport.step_tokens = None
        if error is not None:
            raise error
