"""Dense gradients all-reduced while the backward runs, a bucket at a time, recordable in a CUDA graph.

`sync_gradients(replicated=True)` all-reduces the replicated (dense) gradients after the backward: on a slow link
that is a serial piece of every step (OLMoE's embeddings, attention and routers: ~0.55 GB a step, ~20 ms at
28 GB/s). torch DDP overlaps it with the backward, but its reducer keeps host state that a step replayed from a
CUDA graph skips (`occult.training.step_graph` refuses it). `BucketedSync` does what DDP's buckets do with no
state beyond the step: each parameter's post-accumulate hook counts its bucket's gradients, and a bucket whose
gradients are all in is flattened (on the backward's stream; a bucket of one gradient is not copied) and
all-reduced on a side stream while the backward goes on; `finish()` (after the backward) launches what is left,
waits for the side stream and copies the sums (divided by `divide`) back.

A step of accumulated micro-batches runs every backward but the last inside `held()`: their gradients add up in
`.grad` with nothing launched, and the last backward's hooks launch the sums (one all-reduce a bucket a step).

Every rank issues the buckets' all-reduces in one order, the buckets' (never the order the hooks fire in: a
bucket waits for the ones before it), on a group of their own (`Parallel.sync_group`, apart from the group the
MoE layers' all-to-alls run on, whose order the backward sets). A gradient that never arrives counts as zeros,
as in `all_reduce_grads`. Buckets hold parameters of one dtype and device, in reverse order (the backward makes
the last layers' gradients first), of about `bucket_bytes` each.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size
_STREAMS: dict[int, torch.cuda.Stream] = {}


class BucketedSync:
    """The dense gradients of `params` summed over `group` and divided by `divide` during the backward (module
    docstring). Call `finish()` after each backward, before the gradients are read; `close()` removes the hooks."""

    def __init__(self, params: Sequence[nn.Parameter], group: Any, divide: int, bucket_bytes: int = BUCKET_BYTES):
        if divide < 1 or bucket_bytes < 1:
            raise ValueError(f"need divide >= 1 and bucket_bytes >= 1, got {divide}, {bucket_bytes}")
        self.group, self.divide = group, divide
        self.reduce = dist.get_world_size(group) > 1
        self.buckets = _buckets([p for p in reversed(list(params)) if p.requires_grad], bucket_bytes)
        self._bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self._hooks = [p.register_post_accumulate_grad_hook(self._arrived) for b in self.buckets for p in b]
        self._held = False
        self._reset()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """While entered the hooks neither count nor launch: the backwards run inside accumulate gradients that the
        next backward outside (before `finish()`) reduces with its own (module docstring)."""
        if self._held:
            raise RuntimeError("BucketedSync.held() cannot be nested")
        if any(self._arrivals) or self._flats:
            raise RuntimeError("BucketedSync.held() after a backward that counted: call finish() first")
        self._held = True
        try:
            yield
        finally:
            self._held = False

    def finish(self) -> None:
        """Launch the buckets not launched yet (missing gradients as zeros), wait for the side stream, and leave
        every gradient the average over the group."""
        self._launch_ready(everything=True)
        for bucket, flat in zip(self.buckets, self._flats):
            device = bucket[0].device
            if device.type == "cuda":
                current = torch.cuda.current_stream(device)
                current.wait_stream(_side_stream(device))
            if self.divide != 1:  # (1: the ranks' losses were scaled instead, `occult.training.grads.loss_scale`)
                flat.div_(self.divide)
            if flat is bucket[0].grad:  # (reduced where it lies)
                continue
            offset = 0
            for p in bucket:
                n = p.grad.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                offset += n
        self._reset()

    def close(self) -> None:
        """Remove the hooks (the gradients are left as they are)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _reset(self) -> None:
        self._arrivals = [0] * len(self.buckets)
        self._flats: list[torch.Tensor] = []

    def _arrived(self, p: torch.Tensor) -> None:
        if self._held:
            return
        i = self._bucket_of[id(p)]
        self._arrivals[i] += 1
        if self._arrivals[i] > len(self.buckets[i]):
            raise RuntimeError(
                "BucketedSync: a gradient arrived twice before finish() (two backwards in one step, e.g. accumulated "
                "micro-batches): run every backward but the last inside held(), or call finish() after each"
            )
        self._launch_ready()

    def _launch_ready(self, everything: bool = False) -> None:
        """Launch, in bucket order, every bucket whose gradients are all in (`everything`: all the rest)."""
        while len(self._flats) < len(self.buckets):
            i = len(self._flats)
            if not everything and self._arrivals[i] < len(self.buckets[i]):
                return
            self._flats.append(self._launch(self.buckets[i]))

    def _launch(self, bucket: list[nn.Parameter]) -> torch.Tensor:
        """The bucket's gradients flattened on the compute stream (a bucket of one gradient: that gradient), then
        all-reduced on the side stream on a GPU.
        The flatten stays with the backward: on the side stream it would queue behind the previous bucket's
        all-reduce, and in a replayed graph a node waiting there holds up the compute that shares its hardware
        queue (docs/overlap.md, "The host transport, round 3")."""
        for p in bucket:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if len(bucket) == 1 and bucket[0].grad.is_contiguous():  # one gradient (e.g. an LM head's): where it lies
            flat = bucket[0].grad
        else:
            flat = torch.cat([p.grad.detach().reshape(-1) for p in bucket])
        device = bucket[0].device
        if device.type != "cuda":
            if self.reduce:
                dist.all_reduce(flat, group=self.group)
            return flat
        side = _side_stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            if self.reduce:
                dist.all_reduce(flat, group=self.group)
        if not torch.cuda.is_current_stream_capturing():
            flat.record_stream(side)  # (reduced there)
        return flat


def _buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Consecutive parameters of one dtype and device, about `bucket_bytes` a bucket."""
    buckets: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        last = buckets[-1] if buckets else None
        if last is None or size >= bucket_bytes or (p.dtype, p.device) != (last[0].dtype, last[0].device):
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.numel() * p.element_size()
    return buckets


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream buckets are all-reduced on, one per device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _STREAMS:
        _STREAMS[index] = torch.cuda.Stream(torch.device("cuda", index))
    return _STREAMS[index]


__all__ = ["BUCKET_BYTES", "BucketedSync"]
